"""Checkpoints: HF model directories (safetensors + tokenizer) plus the state to resume exactly.

`run_dir/checkpoints/step_000042/` holds the model as any HF loader reads it, and
`trainer_state.pt` (optimiser, schedule, step, weight version, data order, RNG). A checkpoint is
written to a temporary directory and renamed when complete, so a crash never leaves a half
checkpoint that `--resume` would pick up.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from verst import distributed
from verst.configbase import ConfigBase

STATE_FILE = "trainer_state.pt"


class CheckpointConfig(ConfigBase):
    interval_steps: int = Field(
        0, ge=0, description="save every N RL steps (and at the end); 0 = only at the end"
    )
    keep_last: int = Field(2, ge=1, description="how many checkpoints to keep on disk")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    shell: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Rank 0 writes; `shell` is an unsharded model of the same architecture (its config and
    tied-weight layout are used; its own weights are not)."""
    final = checkpoint_dir(run_dir, step)
    if distributed.rank() == 0:
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        shell.save_pretrained(partial, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        torch.save(state, partial / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old)
    distributed.barrier()
    return final


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights of an HF model directory, tied entries included."""
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model.state_dict()


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full fp32 weights and the resume state."""
    return load_weights(path), torch.load(path / STATE_FILE, weights_only=False)
