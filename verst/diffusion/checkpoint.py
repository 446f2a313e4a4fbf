"""Diffusion checkpoints on the LM's protocol: a partial directory renamed when whole.

`checkpoints/step_000042/` is a model directory (usable as `model.path`: `transformer/`,
`scheduler/`, the metadata file) plus `trainer_state.pt` (optimizer, step, weight version and,
fully asynchronous, the prompt source's state). With LoRA, `adapter/` (the adapters in peft's
format) stands in place of `transformer/`, and `--resume` rebuilds the base from `model.path`.
Writing, committing, keeping the newest `checkpoint.keep_last`, listing and removing what a
crash left half-written are `verst.train.checkpoint`'s, so `--resume` picks the same checkpoint
an LM run would.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from verst.diffusion import adapters
from verst.diffusion import model as tiny
from verst.models.lora import LoraConfig, has_lora, is_adapter_dir, load_adapter
from verst.train import checkpoint as lm
from verst.train.checkpoint import STATE_FILE


def save(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    model_dir: Path,
    state: dict[str, Any],
    *,
    keep_last: int,
    lora: LoraConfig | None = None,
) -> Path:
    """Write and commit checkpoint `step` (with `lora`, the adapters alone); a failed write
    leaves no partial directory."""
    partial = lm.partial_dir(lm.checkpoint_dir(run_dir, step))
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        if lora is not None:
            adapters.save(partial / adapters.ADAPTER_DIR, model, lora)
        else:
            model.save_pretrained(partial / "transformer")
        for name in ("scheduler", tiny.META_FILE):
            source = model_dir / name
            if source.is_dir():
                shutil.copytree(source, partial / name)
            elif source.is_file():
                shutil.copy2(source, partial / name)
        with open(partial / STATE_FILE, "wb") as f:
            torch.save(state, f)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return lm.commit_checkpoint(run_dir, step, keep_last=keep_last)


def restore_latest(run_dir: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load the newest committed checkpoint's weights into `model`; its state (with `path`).
    Drops metrics logged after it; ValueError when the run has no checkpoint."""
    removed = lm.remove_partial_checkpoints(run_dir)
    found = lm.list_checkpoints(run_dir)
    if not found:
        raise ValueError(f"--resume: {run_dir / 'checkpoints'} holds no committed checkpoint")
    path = found[-1]
    load_weights(path, model)
    state = lm.load_state(path)
    lm.truncate_metrics(run_dir / "metrics.jsonl", state["step"])
    return state | {"path": str(path), "removed_partial": [str(p) for p in removed]}


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Checkpoint `path`'s weights into `model`: its adapters when it holds some (the model
    must carry the same), else the whole transformer."""
    adapter_dir = path / adapters.ADAPTER_DIR
    saved_lora, model_lora = is_adapter_dir(adapter_dir), has_lora(model)
    if saved_lora != model_lora:
        held = "LoRA adapters" if saved_lora else "full weights"
        raise ValueError(
            f"--resume: {path} holds {held}; resume with the model.lora the run was started with"
        )
    if saved_lora:
        adapters.load_into(model, load_adapter(adapter_dir), field="--resume")
        return
    weights = tiny.read_weights(path / "transformer", field="--resume")
    with torch.no_grad():
        model.load_state_dict(weights)
