"""Checkpoints: HF model directories (safetensors + tokenizer) plus the state to resume exactly.

`run_dir/checkpoints/step_000042/` holds the model as any HF loader reads it (with LoRA, the
adapters as peft reads them: `adapter_config.json`, `adapter_model.safetensors`), and
`trainer_state.pt` (optimiser, schedule, step, weight version, data order, RNG). A checkpoint is
written to `step_000042.partial/` and renamed when complete, so a crash never leaves a half
checkpoint that `--resume` would pick up; a save that fails (a full disk) removes its partial
directory and raises `RunDirError` naming the checkpoint, and the previous checkpoints stay.
A partial directory left by a process that died mid-save is removed when the run resumes.
A committed checkpoint holds an empty `.complete` marker, for readers in other threads or
processes (a snapshot evaluation) that must not read it before it is whole.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from verst import distributed
from verst.configbase import ConfigBase
from verst.models.lora import is_adapter_dir, load_adapter
from verst.rollout.ledger import LEDGER_FILE, undo_after
from verst.rundir import writing

STATE_FILE = "trainer_state.pt"
COMPLETE_MARKER = ".complete"  # written last: the directory is whole (a snapshot evaluation waits)
CHECKPOINT_NAME = re.compile(r"step_\d+")


class CheckpointConfig(ConfigBase):
    interval_steps: int = Field(
        0, ge=0, description="save every N steps (and at the end); 0 = only at the end"
    )
    keep_last: int = Field(2, ge=1, description="how many checkpoints to keep on disk")
    at_end: bool = Field(
        True,
        description="save after the last step; false with interval_steps 0 = no checkpoints "
        "(a benchmark's run)",
    )


def due(cfg: CheckpointConfig, step: int, *, last: bool) -> bool:
    """Whether a checkpoint is written after `step` (`last`: the run's final step)."""
    every = cfg.interval_steps
    return (last and cfg.at_end) or bool(every and step % every == 0)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The committed checkpoints, oldest first; a partial directory never counts, whatever it
    holds (a save killed midway may have written a truncated `trainer_state.pt`)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    committed = (p for p in root.glob("step_*") if CHECKPOINT_NAME.fullmatch(p.name))
    return sorted(p for p in committed if (p / STATE_FILE).is_file())


def partial_dir(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".partial")


def write_checkpoint(
    run_dir: Path,
    step: int,
    *,
    save_weights: Callable[[Path], None],
    tokenizer: PreTrainedTokenizerBase,
    state: dict[str, Any],
) -> Path:
    """Rank 0 writes checkpoint `step` into its partial directory (returned), which
    `commit_checkpoint` makes the checkpoint; `save_weights` writes the model's files into a
    directory (`PolicyModels.weights_writer`)."""
    partial = partial_dir(checkpoint_dir(run_dir, step))
    if distributed.rank() == 0:
        with writing(checkpoint_dir(run_dir, step)):
            try:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
                save_weights(partial)
                tokenizer.save_pretrained(partial)
                # through a Python file, so a failed write raises the OSError (with its errno)
                # that torch's own writer would turn into "file write failed"
                with open(partial / STATE_FILE, "wb") as f:
                    torch.save(state, f)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
    distributed.barrier()
    return partial


def commit_checkpoint(run_dir: Path, step: int, *, keep_last: int) -> Path:
    """Rename checkpoint `step`'s partial directory to the checkpoint and keep the newest
    `keep_last` checkpoints."""
    final = checkpoint_dir(run_dir, step)
    if distributed.rank() == 0:
        with writing(final):
            shutil.rmtree(final, ignore_errors=True)
            partial_dir(final).rename(final)
            (final / COMPLETE_MARKER).touch()
            for old in list_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(old)
    distributed.barrier()
    return final


def remove_partial_checkpoints(run_dir: Path) -> list[Path]:
    """Rank 0 removes the partial directories of saves that never finished; returns them."""
    root = run_dir / "checkpoints"
    if distributed.rank() != 0 or not root.is_dir():
        return []
    stale = sorted(p for p in root.glob("step_*.partial") if p.is_dir())
    with writing(root):
        for path in stale:
            shutil.rmtree(path)
    return stale


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights of an HF model directory, tied entries included."""
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model.state_dict()


def load_state(path: Path) -> dict[str, Any]:
    """A checkpoint's resume state, read with `weights_only=True`: the file holds only tensors
    and plain data (Python's RNG state is tuples of ints), so a crafted pickle that would run
    code on `--resume` is refused instead of executed."""
    try:
        return torch.load(path / STATE_FILE, weights_only=True)
    except pickle.UnpicklingError as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"{path / STATE_FILE}: refusing to load it: it holds more than tensors and plain "
            f"data ({first_line})"
        ) from error


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full fp32 weights (with LoRA, the adapters alone: one peft directory, or with
    multi-LoRA one in a subdirectory per adapter) and the resume state."""
    if is_adapter_dir(path):
        return load_adapter(path), load_state(path)
    adapters = [d for d in sorted(path.iterdir()) if d.is_dir() and is_adapter_dir(d)]
    if adapters:
        weights = {name: t for d in adapters for name, t in load_adapter(d, d.name).items()}
    else:
        weights = load_weights(path)
    return weights, load_state(path)


class Checkpointer:
    """Saves the run's whole state as one checkpoint and restores the newest one: the policy's
    weights and optimizer (through `policy`), the data order (`data_state`, from the rollout
    source, which knows which prompts it holds), and every RNG, the embedded engine's included.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        *,
        policy: Any,
        tokenizer: PreTrainedTokenizerBase,
        data_state: Callable[[], dict[str, Any]],
        load_data_state: Callable[[dict[str, Any]], None],
        engine_generator: torch.Generator | None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.policy = policy  # a verst.train.policy.PolicyModels
        self.tokenizer = tokenizer
        self.data_state = data_state
        self.load_data_state = load_data_state
        self.engine_generator = engine_generator  # serving engines keep their own RNG

    def due(self, step: int, *, last: bool) -> bool:
        return due(self.cfg, step, last=last)

    def save(self, step: int, version: int, *, keep_existing: bool = False) -> Path:
        """Save the current state as checkpoint `step` (collective: every rank calls it)."""
        existing = checkpoint_dir(self.run_dir, step)
        if keep_existing and existing in list_checkpoints(self.run_dir):
            return existing
        self.write(step, version)
        return self.commit(step)

    def write(self, step: int, version: int) -> None:
        """Write the current state as checkpoint `step`, not yet committed: until `commit`, a
        resume picks the previous checkpoint (collective)."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.engine_generator is not None:
            rng["engine"] = self.engine_generator.get_state()
        state = {
            "step": step,
            "weight_version": version,
            "trainer": self.policy.trainer.optimizer_state(),
            "data": self.data_state(),
            "rng": rng,
        }
        write_checkpoint(
            self.run_dir,
            step,
            save_weights=self.policy.weights_writer(),
            tokenizer=self.tokenizer,
            state=state,
        )

    def commit(self, step: int) -> Path:
        """Make the written checkpoint `step` the newest one (collective)."""
        return commit_checkpoint(self.run_dir, step, keep_last=self.cfg.keep_last)

    def restore_latest(self) -> tuple[int, int]:
        """Load the newest complete checkpoint; returns (step, weight version). The run's
        records are rewound with it: metrics of later steps are removed, and the prompt
        ledger's lines of later steps are marked `undone`."""
        checkpoints = list_checkpoints(self.run_dir)
        if not checkpoints:
            raise FileNotFoundError(
                f"--resume: no checkpoint under {self.run_dir / 'checkpoints'} to resume from"
            )
        weights, state = load_checkpoint(checkpoints[-1])
        self.policy.restore(weights, state["trainer"])
        self.load_data_state(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if self.engine_generator is not None:
            self.engine_generator.set_state(state["rng"]["engine"])
        truncate_metrics(self.run_dir / "metrics.jsonl", state["step"])
        undo_after(self.run_dir / LEDGER_FILE, state["step"])
        return state["step"], state["weight_version"]


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after the checkpoint we resume from, so each step appears once."""
    if distributed.rank() != 0 or not path.is_file():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    with writing(path):
        path.write_text("".join(line + "\n" for line in kept))
