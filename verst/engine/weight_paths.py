"""Which paths `/update_weights_from_disk` may read: only under the allowed weight directories.

`verst serve` allows the served model's parent directory by default (for an engine the trainer
starts, that is the run directory, where disk sync publishes) plus `--allowed-weight-dirs`. A
path is resolved with every symlink followed (`os.path.realpath`), and it and every entry of
the directory must land under an allowed root: a link that points out is refused. A refused
path and a missing one get the same answer, so the route cannot probe the filesystem, and a
file that does not parse is reported by name only, never by its bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path


def refusal(model_path: str) -> str:
    return (
        f"model_path {model_path!r} is no weights directory or file under the allowed weight "
        "directories (--allowed-weight-dirs)"
    )


def _inside(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def allowed_weight_path(model_path: str, roots: Sequence[Path] | None) -> Path | None:
    """The resolved path when it may be read, else None; `roots` None allows any path (an
    engine built in-process, whose only caller is the trainer)."""
    if roots is None:
        return Path(model_path).expanduser()
    resolved_roots = [os.path.realpath(root) for root in roots]
    resolved = os.path.realpath(os.path.expanduser(model_path))
    if not _inside(resolved, resolved_roots) or not os.path.exists(resolved):
        return None
    if os.path.isdir(resolved):
        with os.scandir(resolved) as entries:
            for entry in entries:
                if not _inside(os.path.realpath(entry.path), resolved_roots):
                    return None
    return Path(resolved)


def load_quietly(load: Callable[[], tuple[bool, str]], model_path: str) -> tuple[bool, str]:
    """`load()`, with an unreadable file reported by its type of error only (a parser's message
    can quote the file's bytes)."""
    try:
        return load()
    except Exception as error:  # e.g. safetensors' SafetensorsError on a file that is not one
        return False, f"could not read weights at {model_path!r}: {type(error).__name__}"
