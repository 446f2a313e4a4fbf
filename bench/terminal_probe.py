"""What RL does to the terminal recipe's policy, step by step: after each RL step of
`examples/terminal_agent.yaml` (with overrides), the trainer's log-prob of the canonical
solution of fixed held-out prompts (`examples/data/terminal_dev.jsonl`), split by part:

    <tool_call>{"name":"sh","arguments":{"cmd":"  CMD  "}}</tool_call>  <|im_end|>
    `-------------- scaffold ------------------'  cmd  `- scaffold -'`close'  end

`scaffold` and `close` are per-token means over the fixed characters, `cmd` over the command,
`end` the end-of-turn token after a correct call, `seq` the whole solution's summed log-prob
(at the sampling temperature, so exp(seq) is about the chance of sampling it). The rollout's
reward and cut-turn share are printed beside it. The warm start runs once and is saved
(`--warm-start DIR` reuses one), so runs with different RL settings start from the same
policy.

    python bench/terminal_probe.py --steps 30 -- trainer.lr=3e-4 rollout.temperature=1.0
    python bench/terminal_probe.py --warm-start /tmp/ws0 --steps 60

Each run is appended to bench/results/terminal_probe_cpu.json with its settings and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from verst import launch
from verst.config import load_config
from verst.loop import begin, rl_step
from verst.models.tiny import build_char_tokenizer
from verst.monitor.metrics import MetricsLogger
from verst.train.batching import TrainItem, collate

RECIPE = "examples/terminal_agent.yaml"
DEV = Path("examples/data/terminal_dev.jsonl")
CLOSE = "</tool_call>"


def probe_items(prompts: int) -> tuple[list[TrainItem], list[dict[str, slice | int]]]:
    """The canonical solutions of the first `prompts` dev rows as train items (prompt + label),
    and where each part of each label lies."""
    tokenizer = build_char_tokenizer()
    items, parts = [], []
    for line in DEV.read_text().splitlines()[:prompts]:
        row = json.loads(line)
        messages = [{"role": "user", "content": row["prompt"]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        label = tokenizer.encode(row["label"], add_special_tokens=False)
        items.append(TrainItem(prompt + label, len(label), [1] * len(label), [0.0] * len(label), 0))
        # one token per character, the end-of-turn token last
        text = row["label"]
        cmd = slice(text.index('"cmd":"') + 7, text.index('"}}' + CLOSE))
        close = text.index(CLOSE)
        parts.append({"cmd": cmd, "close": slice(close, close + len(CLOSE)), "end": len(label) - 1})
    return items, parts


def probe(trainer, items: list[TrainItem], parts: list[dict]) -> dict[str, float]:
    with torch.no_grad():
        logprobs_B_T = trainer._logprobs(
            trainer.model, collate(items, trainer.pad_token_id, trainer.device)
        ).cpu()
    sums = {"scaffold": [], "cmd": [], "close": [], "end": [], "seq": []}
    for row, part in zip(logprobs_B_T.tolist(), parts, strict=True):
        end, cmd, close = part["end"], part["cmd"], part["close"]
        sums["cmd"] += row[cmd]
        sums["close"] += row[close]
        sums["scaffold"] += row[: cmd.start] + row[cmd.stop : close.start]
        sums["end"].append(row[end])
        sums["seq"].append(sum(row[: end + 1]))
    return {key: round(sum(v) / len(v), 4) for key, v in sums.items()}


def warm_start(out: Path, overrides: list[str]) -> Path:
    """Run the recipe's warm start once; save the policy as an HF directory."""
    cfg = load_config(RECIPE, overrides)
    torch.set_num_threads(cfg.num_threads)
    (out / "run").mkdir(parents=True, exist_ok=True)
    run = launch.build(cfg, out / "run")
    try:
        with MetricsLogger(out / "run", 0, 0, monitor=cfg.monitor, config={}) as log:
            begin(cfg, run, log, 0, 0)
        weights = run.policy.trainer.full_state_dict()
        run.policy.shell.save_pretrained(out / "model", state_dict=weights)
        build_char_tokenizer().save_pretrained(out / "model")
    finally:
        run.close()
    return out / "model"


def rl_with_probes(model: Path, run_dir: Path, steps: int, overrides: list[str]) -> list[dict]:
    fixed = [f"model.path={model}", "model.tiny=null", "warm_start.enabled=false"]
    cfg = load_config(RECIPE, [*fixed, f"num_steps={steps}", *overrides])
    torch.set_num_threads(cfg.num_threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = launch.build(cfg, run_dir)
    items, parts = probe_items(48)
    rows = []
    try:
        with MetricsLogger(run_dir, steps, 0, monitor=cfg.monitor, config={}) as log:
            version = begin(cfg, run, log, 0, 0)
            rows.append({"step": 0, **probe(run.policy.trainer, items, parts)})
            run.rollout.start()
            for step in range(1, steps + 1):
                version = rl_step(cfg, run, log, step, version)
                metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
                rows.append({
                    "step": step,
                    **probe(run.policy.trainer, items, parts),
                    "reward": round(metrics["rollout/reward_mean"], 4),
                    "truncated": round(metrics["rollout/truncated_ratio"], 4),
                    "entropy": round(metrics.get("train/entropy", float("nan")), 4),
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    finally:
        run.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the RL run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-start", type=Path, default=None, help="a saved warm start")
    parser.add_argument("--seed", type=int, default=0, help="the warm start's seed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/verst-terminal-probe"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/terminal_probe_cpu.json"))
    args = parser.parse_args()
    model = args.warm_start or warm_start(args.work / f"ws{args.seed}", [f"seed={args.seed}"])
    rows = rl_with_probes(model, args.work / "rl", args.steps, args.overrides)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    record = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit.stdout.strip(),
        "machine": f"{os.cpu_count()} CPU cores, shared",
        "overrides": args.overrides,
        "steps": rows,
    }
    old = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    old["runs"].append(record)
    args.out.write_text(json.dumps(old, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
