"""Constrained decoding's cost: the scheduler with grammars off, and every (or every other)
request under a JSON schema, in one run on one model.

Configurations, alternated and each the best of `--repeats` runs at every batch size:
- `no_tokenizer`: a scheduler built without a tokenizer, so no grammar machinery at all;
- `off`: a scheduler with a tokenizer (grammars possible) and no constrained request, which
  must cost nothing over `no_tokenizer`;
- `json_half`: every other request under the JSON schema below;
- `json_all`: every request under it.

The tokenizer is word-level over the bench model's whole vocabulary: id 0 is the
end-of-sequence token, ids 1-95 the printable ASCII characters, the rest the strings `w<id>`,
so a mask is computed over the full vocabulary (about 152k tokens on the h200 preset). The
schema, an object holding one string, lets a random model keep writing (inside the string
every `w<id>` is allowed, and only `"` closes it), so requests run close to their full
length; tokens/s counts the tokens actually generated, and the mean output length of each
configuration is saved next to it. Ratios are of wall time on CUDA and of the process's
CPU time on the CPU.

    python bench/grammar_ab.py --preset cpu --batches 16 64 --threads 1 --repeats 3
    python bench/grammar_ab.py --preset h200 --batches 16 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import string
import time
from pathlib import Path

import torch
from engine_throughput import PRESETS, batch_prompts, build_model, new_scheduler, timed
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from verst.engine import GenerateRequest, SamplingParams
from verst.engine.grammar import Constraint
from verst.engine.scheduler import Scheduler

REPO = Path(__file__).resolve().parent.parent
EOS = 0
SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string"}},
    "required": ["note"],
    "additionalProperties": False,
}
CONSTRAINT = Constraint("json_schema", json.dumps(SCHEMA))
CONFIGS = ("no_tokenizer", "off", "json_half", "json_all")


def char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One token per id: `<eos>`, the printable ASCII characters, then `w<id>` fillers."""
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    pieces = ["<eos>", *chars]
    pieces += [f"w{i}" for i in range(len(pieces), vocab_size)]
    tok = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<eos>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def constrained_requests(prompts, new: int, every: int) -> list[GenerateRequest]:
    """Requests for `prompts`; every `every`-th one (0: none) under the JSON schema."""
    out = []
    for i, prompt in enumerate(prompts):
        constraint = CONSTRAINT if every and i % every == 0 else None
        params = SamplingParams(max_new_tokens=new, constraint=constraint)
        out.append(GenerateRequest(input_ids=list(prompt), sampling_params=params))
    return out


def generate(scheduler: Scheduler, prompts, new: int, every: int) -> list:
    """Fresh requests on an empty prefix cache; their requests and outputs."""
    scheduler.flush_cache()
    requests = constrained_requests(prompts, new, every)
    return list(zip(requests, scheduler.generate(requests), strict=True))


def timed_generate(scheduler: Scheduler, prompts, new: int, every: int) -> tuple[float, int]:
    """Wall seconds and tokens generated; after the clock stops, a constrained output must
    start as the schema's JSON does (proof the grammar was applied)."""
    done: list = []
    wall = timed(lambda: done.extend(generate(scheduler, prompts, new, every)))
    for request, result in done:
        if request.sampling_params.constraint is not None:
            text = scheduler.grammars.tokenizer.decode(result.output_ids)
            assert text.startswith('{"note"') or '{"note"'.startswith(text), text
    return wall, sum(len(result.output_ids) for _, result in done)


def run_batch(model, args, preset, dtype, device, batch: int, tokenizer) -> dict:
    prompts = batch_prompts(model, preset, batch)
    new = preset["new_tokens"]
    budget = args.kv_budget_mb << 20
    schedulers = {
        "no_tokenizer": new_scheduler(model, dtype, device, budget, (EOS,)),
        "with_tokenizer": new_scheduler(model, dtype, device, budget, (EOS,), tokenizer),
    }
    plan = {  # config: (scheduler, every how many requests one is constrained)
        "no_tokenizer": ("no_tokenizer", 0),
        "off": ("with_tokenizer", 0),
        "json_half": ("with_tokenizer", 2),
        "json_all": ("with_tokenizer", 1),
    }
    for which, every in plan.values():  # untimed: graphs, kernels, grammar compile
        schedulers[which].runner.capture_graphs(batch)
        generate(schedulers[which], prompts, 4, every)
    best = {name: {"wall_s": float("inf"), "cpu_s": float("inf")} for name in CONFIGS}
    tokens = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, (which, every) in plan.items():
            cpu_start = time.process_time()
            wall, made = timed_generate(schedulers[which], prompts, new, every)
            best[name]["wall_s"] = min(best[name]["wall_s"], wall)
            best[name]["cpu_s"] = min(best[name]["cpu_s"], time.process_time() - cpu_start)
            tokens[name].append(made)
    return batch_row(batch, new, device, best, tokens)


def batch_row(batch: int, new: int, device: str, best: dict, tokens: dict) -> dict:
    basis = "wall_s" if device == "cuda" else "cpu_s"
    row = {"batch": batch, "max_new_tokens": new, "ratio_of": basis.removesuffix("_s")}
    rate = {}
    for name in CONFIGS:
        made = min(tokens[name])  # tokens vary little between runs; the lower is conservative
        rate[name] = made / best[name][basis]
        row[f"{name}_tok_s"] = made / best[name]["wall_s"]
        row[f"{name}_tok_per_cpu_s"] = made / best[name]["cpu_s"]
        row[f"{name}_mean_output_tokens"] = made / batch
        row[f"{name}_over_no_tokenizer"] = rate[name] / rate["no_tokenizer"]
    print(
        f"grammar A/B, batch {batch} ({row['ratio_of']} time): "
        + " | ".join(f"{n} {rate[n]:.1f} tok/s" for n in CONFIGS)
        + "".join(f" | {n}/no_tokenizer {row[f'{n}_over_no_tokenizer']:.3f}" for n in CONFIGS[1:])
        + f" | mean output tokens (json_all) {row['json_all_mean_output_tokens']:.1f}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--batches", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-budget-mb", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, help="tokens per request (default: preset's)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N alternated runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = dict(PRESETS[args.preset])
    if args.new_tokens:
        preset["new_tokens"] = args.new_tokens
    device = "cuda" if preset["dtype"] == "bfloat16" and torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, preset["dtype"])
    model = build_model(preset["model"], dtype, device)
    tokenizer = char_tokenizer(model.config.vocab_size)
    rows = [
        run_batch(model, args, preset, dtype, device, batch, tokenizer) for batch in args.batches
    ]
    result = {
        "bench": "grammar_ab",
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "threads": args.threads,
        "repeats": args.repeats,
        "schema": SCHEMA,
        "rows": rows,
    }
    out = args.out or REPO / "bench" / "results" / f"grammar_ab_{args.preset}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
