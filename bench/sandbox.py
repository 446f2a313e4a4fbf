"""Sandboxes and the environment layer: start latency, episode throughput, rollout overhead.

1. Start latency per provider (bubblewrap, process; docker where a daemon answers): the time
   from nothing to the first command's result (`open()` + `run(["true"])`), p50 and p99 over
   `--starts` sandboxes, one at a time. The limit it is compared with, in the same run, is a
   bare `asyncio.create_subprocess_exec("true")`: what any isolation costs above a fork + exec.
2. Episodes per second per provider: an episode opens a sandbox, writes a file, runs the
   toy terminal task's command and checker (`sh -c`, two commands), and closes the sandbox;
   `--episodes` of them, with 1 and then 16 at a time. The ratio is what concurrency gains on
   this machine's cores.
3. The environment layer's own cost per episode: the same two-turn episode (one tool call,
   then an answer) played by a bare agent function (aiohttp to /chat/completions, the
   tool handled inline) and by `EnvironmentAgent` (an Environment with a tool, the runner's
   parsing, checks, tally), both against one local OpenAI-shaped endpoint that answers at
   once, so that the model's time, identical for both, does not hide the difference. No
   sandbox in either, so this is the layer alone.

    python bench/sandbox.py                        # ~1 min on 2 CPU cores
    python bench/sandbox.py --starts 20 --episodes 32   # smoke

Prints each figure with its comparison and saves JSON in bench/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from verst.envs.base import StepResult, ToolEnvironment, tool
from verst.envs.runner import EnvConfig, EnvironmentAgent
from verst.envs.sandbox import SandboxConfig, bubblewrap_problem, docker_problem, make_sandbox

RESULTS = Path(__file__).parent / "results" / "sandbox.json"
TASK = {"cmd": "echo 42>a3", "check": '[ "$(cat a3)" = 42 ]'}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def providers() -> list[str]:
    names = ["process"]
    if bubblewrap_problem() is None:
        names.insert(0, "bubblewrap")
    if docker_problem() is None:
        names.append("docker")
    return names


async def start_latencies(provider: str, n: int) -> list[float]:
    cfg = SandboxConfig(provider=provider, pool_size=0)
    out = []
    for _ in range(n):
        began = time.perf_counter()
        box = await asyncio.to_thread(make_sandbox(cfg).open)
        result = await box.run(["true"])
        out.append(time.perf_counter() - began)
        assert result.ok, result
        await asyncio.to_thread(box.close)
    return out


async def bare_spawns(n: int) -> list[float]:
    out = []
    for _ in range(n):
        began = time.perf_counter()
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()
        out.append(time.perf_counter() - began)
    return out


async def episodes_per_s(provider: str, n: int, concurrency: int) -> float:
    cfg = SandboxConfig(provider=provider, pool_size=0)
    gate = asyncio.Semaphore(concurrency)

    async def episode() -> None:
        async with gate:
            async with make_sandbox(cfg) as box:
                box.put("task.txt", "put 42 in a3\n")
                await box.run(TASK["cmd"])
                verdict = await box.run(["/bin/sh", "-c", TASK["check"]])
                assert verdict.ok, verdict

    began = time.perf_counter()
    await asyncio.gather(*(episode() for _ in range(n)))
    return n / (time.perf_counter() - began)


# ---- the environment layer vs a bare agent function -----------------------------------------

CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}


def instant_app() -> web.Application:
    """An OpenAI-shaped endpoint: a tool call when the last message is the user's, then an
    answer."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][-1]["role"] == "user":
            message = {"role": "assistant", "content": "", "tool_calls": [CALL]}
        else:
            message = {"role": "assistant", "content": "4"}
        return web.json_response({"choices": [{"message": message, "finish_reason": "stop"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


class AddEnv(ToolEnvironment):
    async def reset(self, prompt: Any, metadata: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": str(prompt)}]

    @tool("add 2", {"a": {"type": "integer"}})
    async def add(self, a: int) -> str:
        return str(a + 2)

    async def answer(self, text: str) -> StepResult:
        return StepResult(reward=float(text.strip() == "4"), done=True)


async def bare_agent(base_url: str, prompt: str, kwargs: dict, metadata: dict) -> dict:
    """What an agent function does without the layer: two chat calls, the tool inline."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    async with aiohttp.ClientSession() as client:
        for _ in range(2):
            async with client.post(
                f"{base_url}/chat/completions", json={**kwargs, "messages": messages}
            ) as r:
                message = (await r.json())["choices"][0]["message"]
            messages.append(message)
            if not message.get("tool_calls"):
                return {"reward": float(message["content"] == "4")}
            args = json.loads(message["tool_calls"][0]["function"]["arguments"])
            messages.append({"role": "tool", "content": str(args["a"] + 2)})
    return {"reward": 0.0}


async def per_episode_s(agent: Any, base_url: str, n: int) -> float:
    began = time.perf_counter()
    for _ in range(n):
        result = await agent(base_url, "2+2", {"model": "m"}, {})
        assert result.get("reward", result.get("env_reward")) == 1.0, result
    return (time.perf_counter() - began) / n


async def layer_overhead(n: int) -> dict[str, float]:
    runner = web.AppRunner(instant_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/v1"
    env_agent = EnvironmentAgent(EnvConfig(name="bench.sandbox:AddEnv"))
    try:
        await per_episode_s(bare_agent, url, 20)  # warm up both paths
        await per_episode_s(env_agent, url, 20)
        bare = await per_episode_s(bare_agent, url, n)
        layered = await per_episode_s(env_agent, url, n)
    finally:
        await runner.cleanup()
    return {
        "bare_agent_ms": bare * 1e3,
        "environment_ms": layered * 1e3,
        "overhead_ms": (layered - bare) * 1e3,
        "ratio": layered / bare,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    spawn = await bare_spawns(args.starts)
    out: dict[str, Any] = {
        "bare_spawn_ms": {"p50": percentile(spawn, 0.5) * 1e3, "p99": percentile(spawn, 0.99) * 1e3}
    }
    print(f"bare fork+exec of true: p50 {out['bare_spawn_ms']['p50']:.2f} ms")
    for provider in providers():
        starts = await start_latencies(provider, args.starts)
        p50, p99 = percentile(starts, 0.5) * 1e3, percentile(starts, 0.99) * 1e3
        one = await episodes_per_s(provider, args.episodes, 1)
        many = await episodes_per_s(provider, args.episodes, 16)
        out[provider] = {
            "start_ms": {"p50": p50, "p99": p99},
            "start_vs_bare_spawn_p50": p50 / out["bare_spawn_ms"]["p50"],
            "episodes_per_s": {"concurrency_1": one, "concurrency_16": many},
            "concurrency_16_vs_1": many / one,
        }
        print(
            f"{provider}: start p50 {p50:.1f} ms, p99 {p99:.1f} ms "
            f"({p50 / out['bare_spawn_ms']['p50']:.1f}x a bare spawn); episodes/s "
            f"{one:.1f} at 1, {many:.1f} at 16 ({many / one:.2f}x)"
        )
    out["layer"] = await layer_overhead(args.layer_episodes)
    layer = out["layer"]
    print(
        f"environment layer: {layer['environment_ms']:.2f} ms per 2-turn episode vs "
        f"{layer['bare_agent_ms']:.2f} ms bare ({layer['ratio']:.2f}x, "
        f"+{layer['overhead_ms']:.2f} ms)"
    )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=100)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--layer-episodes", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = asyncio.run(main(args))
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    results["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {args.out}")
