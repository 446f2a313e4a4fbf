"""The trainer's model FLOPs utilisation and peak memory on one device, against a plain HF loop.

The verst trainer's full RL step (forward, log-probs of the sampled tokens, GRPO loss,
backward, AdamW) on a random model, next to a plain PyTorch loop over the same tokens in the
same run: HF forward with bf16 autocast over fp32 weights, cross-entropy of the response
tokens (`logits_to_keep`: no head on the prompt), backward, fused AdamW. Each variant runs in
a fresh process so its peak memory is its own.

MFU counts the work an RL step needs, the same for every variant: 6 × (non-embedding
parameters) per token of every sequence, 6 × d_model × vocabulary per response token (the
head), and causal attention, 6 × layers × heads × head_dim × (t + 1) for the token at
position t; over measured step time and the device's dense bf16 peak.

    python bench/trainer_mfu.py --preset h200   # Qwen2-0.5B's shape, 16 × 2,048 tokens
    python bench/trainer_mfu.py --preset cpu    # a small model, a check that it runs
    python bench/trainer_mfu.py --preset h200 --megatron   # and the megatron backend
    python bench/trainer_mfu.py --preset h200 --megatron --kinds hf megatron   # those two only
    python bench/trainer_mfu.py --preset h200 --profile   # and where each variant's time goes

Suffixes of a kind switch options on: `-liger` (`--variants verst-liger:16384:4096`) runs
Liger's Triton RMSNorm, SwiGLU MLP and rotary kernels (`trainer.kernels=liger`; for `hf`, patched
into Qwen2's classes; `pip install liger-kernel`), `-ckpt` the trainer's
`gradient_checkpointing` (`verst-liger-ckpt:65536:4096` both).

`-cudnn` lets SDPA use cuDNN's attention again (the trainer leaves it out on CUDA:
`verst.models.forward.SHAPE_FREE_SDPA`); with `--vary-lengths` every step's prompts and
responses are shorter by a multiple of 8 tokens on the H200 preset (0, 8, ..., 120 in turn,
one token on the CPU preset), so each step brings
new shapes as an RL step does (`--variants verst-cudnn:65536:4096 verst:65536:4096
--vary-lengths` measures what cuDNN's per-shape plans cost); rates then use the timed steps'
mean FLOPs.

`--profile` runs one more step of each variant under `torch.profiler` and stores its kernels'
device time by operator (the top 25), beside the step's total, in the variant's row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from weight_sync import QWEN2_05B  # Qwen2-0.5B's shapes (494M parameters, tied embeddings)

REPO = Path(__file__).resolve().parent.parent
PRESETS = {
    "h200": dict(
        model=QWEN2_05B,
        device="cuda",
        peak_flops=989e12,  # H200 SXM dense bf16
        sequences=16,
        prompt_tokens=1024,
        response_tokens=1024,
        warmup_steps=2,
        steps=6,
        hf_micro_sequences=4,
        variants=[
            ("hf", 0, 0),
            ("verst", 16384, 0),
            ("verst", 16384, 2048),
            ("verst", 16384, 4096),
            ("verst", 65536, 0),
            ("verst", 65536, 2048),
            ("verst", 65536, 4096),
            ("verst", 32768, 4096),
        ],
    ),
    "cpu": dict(
        model=dict(
            vocab_size=4096,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
        device="cpu",
        peak_flops=None,
        sequences=4,
        prompt_tokens=32,
        response_tokens=32,
        warmup_steps=1,
        steps=3,
        hf_micro_sequences=2,
        variants=[("hf", 0, 0), ("verst", 256, 0), ("verst", 256, 32)],
    ),
}


TRIM_CYCLE = 16  # --vary-lengths: step i is shorter by (i % 16) units


def trim(preset: dict, step: int, vary: bool) -> int:
    """Tokens off each prompt and each response at `step` (0 without `--vary-lengths`): units
    of 1/128 of the shorter of the two (8 tokens on the H200 preset), at least one token."""
    unit = max(1, min(preset["prompt_tokens"], preset["response_tokens"]) // 128)
    return unit * (step % TRIM_CYCLE) if vary else 0


def model_flops(preset: dict, trimmed: int = 0) -> float:
    """The FLOPs of one training step's forward and backward over the preset's batch, each
    prompt and response `trimmed` tokens shorter."""
    preset = preset | {
        "prompt_tokens": preset["prompt_tokens"] - trimmed,
        "response_tokens": preset["response_tokens"] - trimmed,
    }
    spec = preset["model"]
    d, ffn, layers = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"]
    head_dim = d // spec["num_attention_heads"]
    kv = spec["num_key_value_heads"] * head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * ffn  # q, o, k, v, gate / up / down
    length = preset["prompt_tokens"] + preset["response_tokens"]
    attention = 6 * layers * d * (length * (length + 1) // 2)  # QKᵀ and AV, causal
    backbone = 6 * layers * per_layer * length
    head = 6 * d * spec["vocab_size"] * preset["response_tokens"]
    return float(preset["sequences"] * (backbone + attention + head))


def build(preset: dict) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**preset["model"], attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(config)


def batch(preset: dict, trimmed: int = 0):
    """Distinct random prompts (no prefix shared, so no variant skips work) and responses, each
    `trimmed` tokens shorter than the preset's."""
    from verst.train.batching import TrainItem

    gen = torch.Generator().manual_seed(0)
    vocab, length = preset["model"]["vocab_size"], preset["response_tokens"] - trimmed
    items = []
    for i in range(preset["sequences"]):
        prompt_length = preset["prompt_tokens"] - trimmed
        prompt = torch.randint(10, vocab, (prompt_length,), generator=gen).tolist()
        response = torch.randint(10, vocab, (length,), generator=gen).tolist()
        logprobs = (-3 * torch.rand(length, generator=gen)).tolist()
        advantage = 1.0 if i % 2 else -1.0
        items.append(TrainItem(prompt + response, length, [1] * length, logprobs, advantage))
    return items


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def verst_steps(
    preset: dict,
    backend: str,
    micro_tokens: int,
    chunk_tokens: int,
    device: torch.device,
    options: set[str],
    vary: bool,
):
    from verst.train.algorithms import LossConfig
    from verst.train.trainer import Trainer, TrainerConfig

    cfg = TrainerConfig(
        lr=1e-6,
        micro_batch_tokens=micro_tokens,
        logprob_chunk_tokens=chunk_tokens,
        backend=backend,
        kernels="liger" if "liger" in options else "torch",
        gradient_checkpointing="ckpt" in options,
    )
    common = dict(total_steps=100, pad_token_id=0, device=device)
    if backend == "megatron":
        from verst.train.megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer(build(preset), cfg, LossConfig(), seed=0, **common)
    else:
        trainer = Trainer(build(preset), cfg, LossConfig(), **common)
    batches = {}

    def step(index: int) -> float:
        trimmed = trim(preset, index, vary)
        items = batches.setdefault(trimmed, batch(preset, trimmed))
        return trainer.step(items, step=index)["train/loss"]

    return step


def hf_steps(preset: dict, device: torch.device, vary: bool):
    model = build(preset).to(device).train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused)
    micro = preset["hf_micro_sequences"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    batches = {}

    def step(index: int) -> float:
        trimmed = trim(preset, index, vary)
        items = batches.setdefault(trimmed, batch(preset, trimmed))
        ids = torch.tensor([item.tokens for item in items], device=device)
        length = preset["response_tokens"] - trimmed
        total = 0.0
        for start in range(0, len(items), micro):
            rows = ids[start : start + micro]
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                logits = model(input_ids=rows[:, :-1], logits_to_keep=length).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), rows[:, -length:].flatten()
            ) * (len(rows) / len(items))
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def worker(spec: dict) -> dict:
    preset = PRESETS[spec["preset"]]
    device = torch.device(preset["device"])
    kind, *suffixes = spec["kind"].split("-")
    options = set(suffixes)
    if options - {"liger", "ckpt", "cudnn"} or (kind == "hf" and options & {"ckpt", "cudnn"}):
        raise SystemExit(f"unknown kind {spec['kind']}")
    if "cudnn" in options:
        from torch.nn.attention import SDPBackend

        from verst.models import forward

        forward.SHAPE_FREE_SDPA.insert(0, SDPBackend.CUDNN_ATTENTION)
    vary = spec.get("vary_lengths", False)
    if kind == "hf":
        if "liger" in options:  # Liger's Triton RMSNorm, SwiGLU and RoPE in Qwen2's classes
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2

            apply_liger_kernel_to_qwen2(fused_linear_cross_entropy=False)
        step = hf_steps(preset, device, vary)
    else:
        backend = "megatron" if kind == "megatron" else "fsdp2"
        micro, chunk = spec["micro_tokens"], spec["chunk_tokens"]
        step = verst_steps(preset, backend, micro, chunk, device, options, vary)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(preset["warmup_steps"] + preset["steps"]):
        sync(device)
        start = time.perf_counter()
        losses.append(step(i + 1))
        sync(device)
        times.append(time.perf_counter() - start)
    timed = times[preset["warmup_steps"] :]
    result = {"step_s": times, "step_median_s": statistics.median(timed), "losses": losses}
    first = preset["warmup_steps"] + 1
    flops = [model_flops(preset, trim(preset, i, vary)) for i in range(first, first + len(timed))]
    result["flops_per_step"] = statistics.mean(flops)
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    if spec.get("profiled"):
        result["profile"] = profile_step(step, len(times) + 1, device)
    return result


def profile_step(step, index: int, device: torch.device, top: int = 25) -> dict:
    """One more step under `torch.profiler`: the device time of the top operators (self time
    of their kernels, ms) and the total over all of them."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step(index)
        sync(device)
    attribute = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attribute) > 0]
    events.sort(key=lambda e: getattr(e, attribute), reverse=True)
    return {
        "total_ms": sum(getattr(e, attribute) for e in events) / 1e3,
        "top_ms": {e.key: round(getattr(e, attribute) / 1e3, 3) for e in events[:top]},
        "calls": {e.key: e.count for e in events[:top]},
    }


def run_variant(
    preset_name: str,
    kind: str,
    micro_tokens: int,
    chunk_tokens: int,
    profile: bool = False,
    vary_lengths: bool = False,
) -> dict:
    spec = dict(
        preset=preset_name,
        kind=kind,
        micro_tokens=micro_tokens,
        chunk_tokens=chunk_tokens,
        profiled=profile,
        vary_lengths=vary_lengths,
    )
    out = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        return spec | {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return spec | json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results)")
    parser.add_argument(
        "--megatron",
        action="store_true",
        help="also the megatron backend (pip install 'verst[megatron]') at the smallest budget",
    )
    parser.add_argument(
        "--kinds",
        nargs="*",
        choices=["hf", "verst", "megatron"],
        help="run only these variants' kinds (default: all; hf is the ratios' baseline)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile one more step of each variant"
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        help="run these variants, each KIND:MICRO_TOKENS:CHUNK_TOKENS (hf first: the baseline)",
    )
    parser.add_argument(
        "--vary-lengths",
        action="store_true",
        help="each step's sequences shorter by step %% 16 units of 8 tokens (H200 preset): new "
        "shapes every step",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    preset = PRESETS[args.preset]
    flops = model_flops(preset)
    variants = list(preset["variants"])
    if args.megatron:
        # the smallest budget: megatron's loss takes full logits (65,536 tokens of them do
        # not fit next to a 0.5B model's activations on an H200)
        variants.append(("megatron", min(v[1] for v in variants if v[0] == "verst"), 0))
    if args.kinds:
        variants = [v for v in variants if v[0] in args.kinds]
    if args.variants:
        variants = [parse_variant(text) for text in args.variants]
    result = {
        "bench": "trainer_mfu",
        "preset": args.preset,
        "model": preset["model"],
        "batch": {k: preset[k] for k in ("sequences", "prompt_tokens", "response_tokens")},
        "vary_lengths": args.vary_lengths,
        "model_flops_per_step": flops,
        "device": torch.cuda.get_device_name() if preset["device"] == "cuda" else "cpu",
        "torch": torch.__version__,
        "variants": [],
    }
    out = args.out or REPO / "bench" / "results" / f"trainer_mfu_{args.preset}.json"
    baseline = None
    for variant in variants:  # each row printed and saved as it comes (a long run may be cut)
        row = run_variant(
            args.preset, *variant, profile=args.profile, vary_lengths=args.vary_lengths
        )
        if row["kind"] == "hf" and "error" not in row:
            baseline = row["step_median_s"]
        report(row, row.get("flops_per_step", flops), preset["peak_flops"], baseline)
        result["variants"].append(row)
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def parse_variant(text: str) -> tuple[str, int, int]:
    """ "KIND:MICRO_TOKENS:CHUNK_TOKENS" (e.g. verst:16384:4096; hf:0:0)."""
    kind, micro, chunk = text.split(":")
    return kind, int(micro), int(chunk)


def report(row: dict, flops: float, peak_flops: float | None, baseline: float | None) -> None:
    """Add the row's rates (and its speed against the HF loop's `baseline` step) and print it."""
    name = f"{row['kind']:5} micro {row['micro_tokens']:6} chunk {row['chunk_tokens']:5}"
    if "error" in row:
        print(f"{name}: {row['error']}")
        return
    row["tflops_per_s"] = flops / row["step_median_s"] / 1e12
    if peak_flops:
        row["mfu"] = flops / row["step_median_s"] / peak_flops
    row["speed_vs_hf"] = baseline / row["step_median_s"] if baseline else None
    versus = f" | {row['speed_vs_hf']:.2f}x the HF loop" if baseline else ""
    mfu = f" | MFU {row['mfu']:.1%}" if "mfu" in row else ""
    memory = f" | peak {row['peak_memory_gb']:.1f} GB" if "peak_memory_gb" in row else ""
    print(
        f"{name} | {row['step_median_s']:.3f} s/step | {row['tflops_per_s']:.1f} TFLOP/s"
        f"{mfu}{memory}{versus}",
        flush=True,
    )
    for op, ms in list(row.get("profile", {}).get("top_ms", {}).items())[:12]:
        print(f"      {ms:9.1f} ms  {op[:90]}", flush=True)


if __name__ == "__main__":
    main()
