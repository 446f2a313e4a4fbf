"""Prefix-cache hit rate of multi-turn sessions over two engine processes: key affinity vs
plain load-based routing.

The stack is the one an agentic rollout uses: 2 `verst serve` processes (a tiny random model
written here, one torch thread each), the router in this process, and the session server in
this process. 64 sessions (8 tasks × 8 samples, as a GRPO rollout's groups) run 8 turns each,
all at once: each session starts at a random time in the first `--start-jitter-s` (its
environment's reset), and every turn asks for up to 32 new tokens, then appends a short
observation ("obs 3: 41772") as the next user message. Each prompt opens with a 1,500-token
system prompt shared by every session (an agent's instructions and tool list) and the task.

Two runs, each on fresh engine processes (warmed up, then their caches flushed):
- `affinity`: the router pins each session id (the `X-SMG-Routing-Key` the session server
  sends) to one engine for the session's life;
- `load`: the router ignores the key and sends each request to the engine with the fewest
  active requests (what a key-less router does).

The hit rate is the engines' own count: the sum of `cached_tokens` (prompt tokens whose KV came
from the radix cache, reported per request in `meta_info` and passed on by the session server
as `usage.prompt_tokens_details.cached_tokens`) over the sum of prompt tokens. Throughput is
turns and tokens per second of wall clock for the whole run.

    python bench/multiturn_cache.py            # ~2 min on 2 CPU cores
    python bench/multiturn_cache.py --sessions 16 --turns 4   # smoke

Prints both runs and their ratio, and saves JSON in bench/results/multiturn_cache.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from verst.fleet.launcher import LocalEngine, launch_local_engines
from verst.models.tiny import TinyModelConfig, build_char_tokenizer, create_tiny
from verst.router import Router
from verst.router.server import make_router_app
from verst.sessions import ChatTokenizer
from verst.sessions.server import make_session_app

RESULTS = Path(__file__).parent / "results" / "multiturn_cache.json"
TOOLS = ["search", "calculator", "python", "read_file", "write_file", "browser", "shell"]


class LoadOnlyRouter(Router):
    """Plain load-based routing: every request goes to the least-loaded engine, key or not."""

    def pick(self, key: str | None) -> str:
        return super().pick(None)


def system_prompt(chars: int) -> str:
    """An agent's instructions and tool list, about `chars` characters (= tokens here)."""
    lines = ["You are an agent. Solve the task step by step; call a tool when you need one."]
    i = 0
    while sum(len(line) + 1 for line in lines) < chars:
        tool = TOOLS[i % len(TOOLS)]
        lines.append(f"- {tool}_{i}: takes a JSON object with 'query' and returns plain text.")
        i += 1
    return "\n".join(lines)[:chars]


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def post(client: aiohttp.ClientSession, url: str, body: Any = None) -> Any:
    async with client.post(url, json=body) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"POST {url} answered {r.status}: {text[:500]}")
        return json.loads(text) if text.strip().startswith(("{", "[")) else text


async def session_episode(
    client: aiohttp.ClientSession,
    sessions_url: str,
    system: str,
    task: str,
    turns: int,
    max_tokens: int,
    seed: int,
    start_delay_s: float,
) -> list[dict[str, int]]:
    """One session: `turns` chat calls, each appending a short observation; per-turn usage."""
    await asyncio.sleep(start_delay_s)  # the environment's reset
    sid = (await post(client, f"{sessions_url}/sessions"))["session_id"]
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    usage = []
    try:
        for turn in range(turns):
            body = {
                "model": "tiny",
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": seed * 1000 + turn,
            }
            reply = await post(client, f"{sessions_url}/sessions/{sid}/v1/chat/completions", body)
            u = reply["usage"]
            usage.append(
                {
                    "prompt": u["prompt_tokens"],
                    "cached": u["prompt_tokens_details"]["cached_tokens"],
                    "completion": u["completion_tokens"],
                }
            )
            messages.append(
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
            )
            messages.append({"role": "user", "content": f"obs {turn}: {rng.randint(0, 99999)}"})
    finally:
        async with client.delete(f"{sessions_url}/sessions/{sid}") as r:
            await r.read()
    return usage


async def run_mode(
    mode: str, engines: list[LocalEngine], chat_tokenizer: ChatTokenizer, args: argparse.Namespace
) -> dict[str, Any]:
    urls = [e.url for e in engines]
    router = Router(urls, sessions=True) if mode == "affinity" else LoadOnlyRouter(urls)
    routed_runner, router_url = await start(make_router_app(router, health_interval_s=5.0))
    app = make_session_app(router_url, chat_tokenizer, model_name="tiny")
    sessions_runner, sessions_url = await start(app)
    system = system_prompt(args.system_chars)
    tasks = [
        f"Task {t}: find the record with id {random.Random(t).randint(10**5, 10**6)} and report "
        "its owner."
        for t in range(args.sessions // args.group_size)
    ]
    jitter = random.Random(0)
    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector) as client:
            for url in urls:  # cold caches for both modes
                await post(client, f"{url}/flush_cache")
            started = time.perf_counter()
            per_session = await asyncio.gather(
                *(
                    session_episode(
                        client,
                        sessions_url,
                        system,
                        tasks[i // args.group_size],
                        args.turns,
                        args.max_tokens,
                        seed=i,
                        start_delay_s=jitter.uniform(0, args.start_jitter_s),
                    )
                    for i in range(args.sessions)
                )
            )
            wall = time.perf_counter() - started
    finally:
        await sessions_runner.cleanup()
        await routed_runner.cleanup()
    turns = [u for session in per_session for u in session]
    prompt = sum(u["prompt"] for u in turns)
    cached = sum(u["cached"] for u in turns)
    completion = sum(u["completion"] for u in turns)
    later = [u for session in per_session for u in session[1:]]
    by_turn = [
        sum(s[t]["cached"] for s in per_session) / sum(s[t]["prompt"] for s in per_session)
        for t in range(args.turns)
    ]
    per_engine = {url: s["requests"] for url, s in router.metrics()["engines"].items()}
    return {
        "mode": mode,
        "wall_s": wall,
        "turns": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "hit_rate": cached / prompt,
        "hit_rate_later_turns": sum(u["cached"] for u in later)
        / max(sum(u["prompt"] for u in later), 1),
        "hit_rate_by_turn": by_turn,
        "recomputed_prompt_tokens": prompt - cached,
        "turns_per_s": len(turns) / wall,
        "completion_tok_s": completion / wall,
        "prompt_tok_s": prompt / wall,
        "requests_per_engine": per_engine,
        "active_keys_after": router.metrics()["active_keys"],
    }


async def warm_up(engines: list[LocalEngine], chat_tokenizer: ChatTokenizer) -> None:
    """A few requests per engine so that first-call costs stay out of the timed runs."""
    ids = chat_tokenizer.render_prompt([{"role": "user", "content": "warm up " * 20}], None)
    async with aiohttp.ClientSession() as client:
        for url in (e.url for e in engines):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}
            await asyncio.gather(*(post(client, f"{url}/generate", body) for _ in range(8)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8, help="sessions per task prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per turn")
    parser.add_argument(
        "--system-chars", type=int, default=1500, help="shared system prompt, in tokens"
    )
    parser.add_argument(
        "--start-jitter-s",
        type=float,
        default=4.0,
        help="sessions start at uniform random times in [0, this] (their environment resets)",
    )
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="torch threads per engine process"
    )
    parser.add_argument(
        "--modes", nargs="+", default=["affinity", "load"], choices=["affinity", "load"]
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.sessions % args.group_size:
        parser.error("--sessions must be a multiple of --group-size")

    # The engine processes inherit this: one thread each, so two engines share 2 cores.
    os.environ["OMP_NUM_THREADS"] = str(args.engine_threads)
    with tempfile.TemporaryDirectory(prefix="verst-bench-") as tmp:
        model_dir = Path(tmp) / "tiny"
        shape = TinyModelConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=128,
            max_position_embeddings=4096,
        )
        create_tiny(model_dir, shape, seed=0)
        chat_tokenizer = ChatTokenizer(build_char_tokenizer())
        results = {}
        for mode in args.modes:
            # Fresh engine processes for each mode, so that nothing carries over between runs.
            engines = launch_local_engines(
                model_dir, args.engines, extra_args=["--device", "cpu", "--seed", "0"]
            )
            try:
                asyncio.run(warm_up(engines, chat_tokenizer))
                row = asyncio.run(run_mode(mode, engines, chat_tokenizer, args))
            finally:
                for engine in engines:
                    engine.stop()
            results[mode] = row
            print(
                f"{mode:>8}: hit rate {row['hit_rate']:.3f} "
                f"(turns 2+: {row['hit_rate_later_turns']:.3f}) | "
                f"{row['turns_per_s']:.1f} turns/s, {row['completion_tok_s']:.0f} new tok/s, "
                f"{row['prompt_tok_s']:.0f} prompt tok/s | {row['wall_s']:.1f} s | "
                f"recomputed {row['recomputed_prompt_tokens']} | "
                f"requests per engine {list(row['requests_per_engine'].values())}",
                flush=True,
            )
            print(
                "          hit rate by turn: "
                + " ".join(f"{h:.3f}" for h in row["hit_rate_by_turn"]),
                flush=True,
            )
    if set(results) != {"affinity", "load"}:
        return
    a, b = results["affinity"], results["load"]
    ratios = {
        "hit_rate": a["hit_rate"] / b["hit_rate"],
        "turns_per_s": a["turns_per_s"] / b["turns_per_s"],
        "recomputed_load_over_affinity": b["recomputed_prompt_tokens"]
        / max(a["recomputed_prompt_tokens"], 1),
    }
    print(
        f"affinity / load: hit rate {ratios['hit_rate']:.2f}x, throughput "
        f"{ratios['turns_per_s']:.2f}x; load routing recomputes "
        f"{ratios['recomputed_load_over_affinity']:.2f}x the prompt tokens; target hit rate "
        f">= 0.96 with affinity: {'met' if a['hit_rate'] >= 0.96 else 'NOT met'}"
    )
    out = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": shape.model_dump(),
        "results": results,
        "ratios": ratios,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
