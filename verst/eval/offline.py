"""`verst eval CHECKPOINT CONFIG`: a saved checkpoint (any HF model directory) scored on the
config's evaluation sets by the embedded engine, and the table it prints."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verst import distributed
from verst.engine import Scheduler
from verst.eval.build import build_evaluators
from verst.models.loading import eos_token_ids
from verst.models.lora import is_adapter_dir
from verst.rollout.rewards import load_reward_fn

COLUMNS = ("num_prompts", "accuracy", "pass@*", "response_len_mean")


def evaluate_checkpoint_dir(checkpoint: Path, cfg: object) -> dict[str, float]:
    """Every evaluation set of `cfg` (a `RunConfig`) on `checkpoint`'s weights."""
    if not (checkpoint / "config.json").is_file():
        hint = (
            " (a LoRA adapter: merge it first, verst model merge-lora)"
            if (is_adapter_dir(checkpoint))
            else ""
        )
        raise FileNotFoundError(f"{checkpoint} is not an HF model directory{hint}")
    device = distributed.resolve_device(cfg.trainer.device)  # type: ignore[attr-defined]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    engine = Scheduler.for_model(model, eos_token_ids=eos, pad_token_id=pad, seed=cfg.seed)  # type: ignore[attr-defined]
    evaluator = build_evaluators(
        cfg.eval,  # type: ignore[attr-defined]
        load_reward_fn(cfg.rollout.reward),  # type: ignore[attr-defined]
        tokenizer,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        device,
        seed=cfg.seed,  # type: ignore[attr-defined]
        reward_timeout_s=cfg.rollout.reward_timeout_s,  # type: ignore[attr-defined]
        sharded=False,
        rollout_function=cfg.rollout.function,  # type: ignore[attr-defined]
    )
    with torch.inference_mode():
        return evaluator.run(engine)


def format_table(metrics: dict[str, float]) -> str:
    """One row per set (`eval/<set>/...`; the default set is `-`), a column per score."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.removeprefix("eval/").split("/")
        name, score = ("-", parts[0]) if len(parts) == 1 else ("/".join(parts[:-1]), parts[-1])
        if name.endswith("weight_version"):
            continue
        rows.setdefault(name, {})[score] = value
    if len(rows) > 1:
        rows.pop("-", None)  # the mean over the sets is the sets' rows, weighted
    passes = sorted(
        {s for r in rows.values() for s in r if s.startswith("pass@")},
        key=lambda s: int(s.removeprefix("pass@")),
    )
    columns = ["num_prompts", "accuracy", *passes, "response_len_mean"]
    width = max(len("set"), *(len(n) for n in rows))
    lines = ["  ".join([f"{'set':<{width}}", *(f"{c:>12}" for c in columns)])]
    for name, scores in rows.items():
        cells = [f"{scores[c]:>12.4g}" if c in scores else f"{'':>12}" for c in columns]
        lines.append("  ".join([f"{name:<{width}}", *cells]))
    return "\n".join(lines)
