"""The embedded engine alone, true on-policy mode against the normal mode, timed in process
CPU time (a shared machine's load moves wall-clock figures far more than CPU time).

The default tiny Qwen3 (4 layers x 128) at `--dtype`, 8 prompts x 8 samples, 32 new tokens
(EOS ignored), one scheduler per mode, `--rounds` alternated generate calls per mode after
one warm-up (each round in the reverse order of the one before); the figure is the median tokens
per CPU second. `--baseline CHECKOUT` adds a third scheduler, true on-policy through that
checkout's `verst/models/{batch_invariant,invariant_forward}.py`: before/after in one process,
its rounds paired with this code's (`baseline_speedup`, the median of the pairs' ratios).

    python bench/true_on_policy_engine.py --threads 1 --rounds 7
    python bench/true_on_policy_engine.py --threads 1 --rounds 25 --baseline ../main

Writes bench/results/true_on_policy_engine_cpu_<dtype>.json (`_baseline.json` with `--baseline`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.models.tiny import TinyModelConfig, build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--baseline", help="another checkout, its invariant forward as a third")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TinyModelConfig(family=args.family)
    model = build_tiny_model(cfg, vocab_size=64, seed=0).to(getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (int(8 + i),), generator=g).tolist() for i in range(8)]
    params = SamplingParams(max_new_tokens=32, temperature=1.0, ignore_eos=True)
    engines = {
        name: Scheduler.for_model(
            model, eos_token_ids=[1], pad_token_id=0, max_running=64, true_on_policy=on, seed=0
        )
        for name, on in (("normal", False), ("true_on_policy", True))
    }
    if args.baseline:
        engines["baseline"] = Scheduler.for_model(
            model, eos_token_ids=[1], pad_token_id=0, max_running=64, true_on_policy=True, seed=0
        )
        engines["baseline"].runner.invariant = baseline_decoder(args.baseline, model)

    def tokens_per_cpu_s(engine: Scheduler) -> float:
        requests = [GenerateRequest(list(p), params) for p in prompts for _ in range(8)]
        start = time.process_time()
        outputs = engine.generate(requests)
        return sum(len(o.output_ids) for o in outputs) / (time.process_time() - start)

    rates: dict[str, list[float]] = {name: [] for name in engines}
    with torch.no_grad():
        for engine in engines.values():
            tokens_per_cpu_s(engine)
        for r in range(args.rounds):
            for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                rates[name].append(tokens_per_cpu_s(engines[name]))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {
        "bench": "true_on_policy_engine",
        "machine": f"{platform.machine()} CPU, {args.threads} threads",
        "torch": torch.__version__,
        "commit": commit.stdout.strip(),
        "args": vars(args),
        "tokens_per_cpu_s": medians,
        "rounds": rates,
        "engine_slowdown": medians["normal"] / medians["true_on_policy"],
    }
    if args.baseline:
        pairs = zip(rates["true_on_policy"], rates["baseline"], strict=True)
        result["baseline_slowdown"] = medians["normal"] / medians["baseline"]
        result["baseline_speedup"] = statistics.median(new / old for new, old in pairs)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rounds", "args", "machine")}))
    suffix = ("" if args.family == "qwen3" else f"_{args.family}") + (
        "_baseline" if args.baseline else ""
    )
    out = Path(args.out) / f"true_on_policy_engine_cpu_{args.dtype}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def baseline_decoder(checkout: str, model: torch.nn.Module) -> object:
    """`InvariantDecoder(model)` of another checkout's code, its `batch_invariant` with it."""
    modules = {}
    for name in ("batch_invariant", "invariant_forward"):
        path = Path(checkout) / "verst" / "models" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    modules["invariant_forward"].bi = modules["batch_invariant"]
    return modules["invariant_forward"].InvariantDecoder(model)


if __name__ == "__main__":
    main()
