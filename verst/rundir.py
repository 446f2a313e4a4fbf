"""The run directory: what marks a run there, and one clear error when it cannot be written.

`verst train` writes everything under its run directory (`config.yaml`, `metrics.jsonl`,
`checkpoints/`, `restarts.jsonl`, `engine_init/`, `weights/`, ...). A write that fails there (a
full disk, a quota, a read-only mount, a missing permission, a path through a regular file)
raises `RunDirError`, which names the path and the cause in one line:
`cannot write runs/x/metrics.jsonl: No space left on device (ENOSPC)`. `verst train` prints it
and exits with code 3 (`verst.exitcodes.RUN_DIR`).

Writers that know their path wrap the write in `writing(path)`; `run_dir_error` converts what
reaches the top of a run from any other writer under the run directory. Both look through the
exception chain, since libraries report a failed write their own way: torch raises its own
RuntimeError over the OSError of a Python file, and safetensors (Rust) puts "(os error N) at
path ..." in its message.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Their presence means the directory holds a run (`--resume` continues it, `--overwrite` clears
# it); an attempt that crashed before its first checkpoint starts over without them.
# what a run writes that a start from scratch must not find: its records, its checkpoints and
# its prompt ledger (`verst.rollout.ledger.LEDGER_FILE`)
RUN_MARKERS = ("metrics.jsonl", "checkpoints", "prompts.jsonl")

# A failed write that names no file (a flush at close) is the run directory's when it says
# the storage is full or read-only: nothing else a run writes to fails that way with no path.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})

_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)(?: at path \"([^\"]*)\")?")


class RunDirError(OSError):
    """A write under the run directory failed; `str()` is the one line the user sees."""

    def __init__(self, path: Path | str, cause: OSError, *, under: bool = False) -> None:
        super().__init__(cause.errno, cause.strerror, str(path))
        name = errno.errorcode.get(cause.errno or 0, f"errno {cause.errno}")
        target = f"under {path}" if under else str(path)
        self.message = f"cannot write {target}: {cause.strerror or os.strerror(cause.errno or 0)}"
        self.message += f" ({name})"

    def __str__(self) -> str:
        return self.message


def os_error_in(error: BaseException) -> OSError | None:
    """The operating system's error behind `error`: `error` itself, one it was raised from or
    while handling, or the errno a Rust library wrote into its message; None if there is none."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        match = _RUST_IO_ERROR.search(str(current))
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code), match.group(2))
        current = current.__cause__ or current.__context__
    return None


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Writes to `path` (a file, or a directory written as a whole, like a checkpoint): a
    failure the operating system reports becomes a `RunDirError` naming `path`."""
    try:
        yield
    except RunDirError:
        raise
    except Exception as error:
        cause = os_error_in(error)
        if cause is None:
            raise
        raise RunDirError(path, cause) from error


def _is_under(path: str, run_dir: Path) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(Path(os.path.abspath(run_dir)))


def run_dir_error(error: BaseException, run_dir: Path) -> RunDirError | None:
    """`error` as a `RunDirError` when the operating system's error behind it is a write under
    `run_dir` (named, or a full or read-only storage naming no file); None otherwise."""
    if isinstance(error, RunDirError):
        return error
    cause = os_error_in(error)
    if cause is None:
        return None
    for name in (cause.filename, cause.filename2):
        if isinstance(name, (str, os.PathLike)) and _is_under(os.fspath(name), run_dir):
            return RunDirError(os.fspath(name), cause)
    if cause.filename is None and cause.errno in STORAGE_ERRNOS:
        return RunDirError(run_dir, cause, under=True)
    return None


def check_writable(run_dir: Path) -> None:
    """Create `run_dir` and write, sync and remove a small file in it, so an unwritable
    directory stops the run before any model is built."""
    probe = run_dir / f".verst-write-check-{os.getpid()}"
    with writing(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as f:
            f.write(b"verst")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON object as one line at the end of `path`."""
    line = json.dumps(record) + "\n"
    with writing(path), path.open("a") as f:
        f.write(line)


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_MARKERS)


def clear_run(run_dir: Path) -> None:
    """Remove the markers of a run (its metrics and checkpoints), so the directory can start the
    run over; the rest (config, engine files, restart records) a new start rewrites or keeps."""
    with writing(run_dir):
        for name in RUN_MARKERS:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
