"""Weights from disk for a serving engine: HF safetensors checkpoints and the disk transport's
published snapshots and deltas (`verst.sync.disk`).

Both check everything they can before the first copy, so a bad checkpoint leaves the engine's
weights as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch


def checkpoint_files(path: Path, params: dict[str, torch.Tensor]) -> tuple[list[Path], str]:
    """The `*.safetensors` files of a directory (or the one file), and a problem ("" if none):
    missing files, a name the model lacks, or a shape that differs."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        return [], f"no .safetensors weights found at {str(path)!r}"
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in params:
                    return [], f"{file.name}: unknown parameter name {name!r}"
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(params[name].shape):
                    return [], (
                        f"{file.name}: shape mismatch for {name!r}: model "
                        f"{tuple(params[name].shape)}, checkpoint {shape}"
                    )
    return files, ""


def checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_published(
    target: dict[str, torch.Tensor], path: Path, current_version: int | None
) -> tuple[bool, str, int | None]:
    """Apply a directory of the disk transport (a full snapshot, or a delta with checksums) to
    `target` in place: (ok, message, the version now held).

    A delta whose base is not `current_version`, or that fails its checksums, is replaced by a
    full reload from the newest snapshot and its deltas: the engine never keeps running
    silently wrong weights.
    """
    from verst.sync import disk

    try:
        result = disk.apply_published(target, path, current_version=current_version)
        how = f"applied {result.mode} version {result.version}"
    except (disk.StaleBase, disk.ChecksumMismatch) as error:
        result = disk.load_full(target, path.parent)
        how = f"full reload to version {result.version} ({type(error).__name__})"
    except disk.DiskSyncError as error:
        return False, str(error), current_version
    return True, f"Succeeded to update model weights: {how}.", result.version
