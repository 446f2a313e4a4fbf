"""GRPO step time, verst vs TRL's GRPOTrainer, on the same model, prompts and batch, in one run.

Both sides train the same tiny random Qwen3-shaped model (written once by `verst model
create-tiny`) on the same two-digit-addition prompts: P prompts × G samples per step, at most
T new tokens, temperature 1.0, exact-match reward, one AdamW step per batch, token-mean loss,
no KL. A step is everything: generation, reward, loss, backward, optimiser step (and, for
verst, the weight sync). Each side runs in its own subprocess with the same thread count; the
first two steps of each are warm-up and excluded.

    python bench/grpo_step_vs_trl.py [--steps 12] [--threads 2] [--out bench/results/...json]

Prints verst's mean step time divided by TRL's and saves everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP_STEPS = 2

VERST_SIDE = """
import json, sys, torch
from pathlib import Path
from verst.config import load_config
from verst.loop import train
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
cfg = load_config(None, args["overrides"])
run_dir = train(cfg, Path(args["run_dir"]))
rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
steps = [r for r in rows if r["step"] > 0]
print(json.dumps({"step_times_s": [r["perf/step_time_s"] for r in steps],
                  "response_len_mean_per_step": [r["rollout/response_len_mean"] for r in steps]}))
"""

TRL_SIDE = """
import json, sys, torch
sys.path.insert(0, {here!r})
from trl_grpo_side import run_trl_grpo
args = json.loads(sys.argv[1])
torch.set_num_threads(args.pop("threads"))
print(json.dumps(run_trl_grpo(**args)))
"""


def _run(code: str, payload: dict) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(payload)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "grpo_step_vs_trl.json")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    from trl_grpo_side import addition_prompts

    from verst.models.tiny import create_tiny

    work = Path(tempfile.mkdtemp(prefix="verst-bench-"))
    model_dir = work / "model"
    create_tiny(model_dir, seed=0)
    n_prompts = args.prompts_per_step * args.steps
    prompts, labels = addition_prompts(n_prompts, seed=0)
    data = work / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": p, "label": y}) + "\n"
            for p, y in zip(prompts, labels, strict=True)
        )
    )

    verst_side = json.loads(
        _run(
            VERST_SIDE,
            {
                "threads": args.threads,
                "run_dir": str(work / "verst-run"),
                "overrides": [
                    f"model.path={model_dir}",
                    f"data.path={data}",
                    "data.shuffle=false",
                    f"num_steps={args.steps}",
                    f"rollout.prompts_per_step={args.prompts_per_step}",
                    f"rollout.n_samples_per_prompt={args.group_size}",
                    f"rollout.max_new_tokens={args.max_new_tokens}",
                    "rollout.temperature=1.0",
                    f"trainer.lr={args.lr}",
                    "loss.loss_aggregation=token_mean",
                    "trainer.dtype=float32",
                ],
            },
        )
    )
    trl = json.loads(
        _run(
            TRL_SIDE.format(here=str(HERE)),
            {
                "threads": args.threads,
                "model_dir": str(model_dir),
                "prompts": prompts,
                "labels": labels,
                "num_generations": args.group_size,
                "prompts_per_step": args.prompts_per_step,
                "max_completion_length": args.max_new_tokens,
                "steps": args.steps,
                "lr": args.lr,
                "temperature": 1.0,
                "seed": 0,
                "out_dir": str(work / "trl-run"),
            },
        )
    )

    verst_times = verst_side["step_times_s"]
    verst_mean = statistics.mean(verst_times[WARMUP_STEPS:])
    trl_mean = statistics.mean(trl["step_times_s"][WARMUP_STEPS:])
    result = {
        "ratio_verst_over_trl": verst_mean / trl_mean,
        "verst": {"mean_step_time_s": verst_mean} | verst_side,
        "trl": trl,
        "workload": vars(args) | {"out": str(args.out)},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    verst_len = statistics.mean(verst_side["response_len_mean_per_step"][WARMUP_STEPS:])
    trl_len = statistics.mean(trl["completion_tokens_mean_per_step"][WARMUP_STEPS:])
    print(
        f"verst {verst_mean:.3f} s/step ({verst_len:.1f} tokens a response) | TRL "
        f"{trl_mean:.3f} s/step ({trl_len:.1f}) | verst / TRL = {verst_mean / trl_mean:.2f}x"
        f"  (saved {args.out})"
    )


if __name__ == "__main__":
    main()
