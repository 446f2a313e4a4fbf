"""`eval.mode: external`: the user's `evaluate_checkpoint(checkpoint_dir, request) -> scores`.

The function runs in a process of its own (spawned once per run, `eval.nice` steps below
normal CPU priority), never in the trainer's: a thread there would share the trainer's GIL and
could not be given a lower priority than the trainer. The process imports the function before
the run's first step (its start-up would otherwise be the first point's, and hold up the
points behind it) and serves one point at a time. A function that raises `EvalSkip` skips
its point; any other exception, a malformed result or the process dying (it is started again
for the next point) makes the point `crashed`; the run goes on. A process that cannot import
the function stops the run before its first step, naming `eval.function`.
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import os
import signal
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from verst.plugin_loader import PluginError, load_plugin
from verst.plugins import CheckpointEvalFunction, EvalRequest, EvalSkip

FIELD = "eval.function"
CLOSE_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 600.0


class ExternalCrash(RuntimeError):
    """The function raised (not `EvalSkip`), returned no scores, or its process died."""


def flat_scores(path: str, scores: Any) -> dict[str, float]:
    """`scores` as `eval/<name>` metrics; TypeError unless it is a dict of finite numbers."""
    if not isinstance(scores, Mapping):
        raise TypeError(f"{FIELD} {path} returned {type(scores).__name__}, not a dict")
    metrics = {}
    for name, value in scores.items():
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise TypeError(f"{FIELD} {path} returned {name}={value!r}, not a finite number")
        metrics[name if name.startswith("eval/") else f"eval/{name}"] = float(value)
    return metrics


def _serve(conn: Connection, path: str, sets: list[dict[str, Any]], nice: int) -> None:
    """The function's process: lower its priority before anything starts a thread, then
    answer each (checkpoint_dir, step, version) with ("ok", metrics), ("skip", reason,
    detail) or ("error", text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; it closes us
    if nice:
        os.nice(nice)
    try:
        fn = load_plugin(path, CheckpointEvalFunction, field=FIELD)
    except Exception as error:
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready",))
    while (job := conn.recv()) is not None:
        checkpoint_dir, step, version = job
        try:
            scores = fn(checkpoint_dir, EvalRequest(step, version, sets))
            answer: tuple = ("ok", flat_scores(path, scores))
        except EvalSkip as skip:
            answer = ("skip", skip.reason, str(skip))
        except Exception as error:  # the point's failure, reported to the trainer's side
            answer = ("error", f"{type(error).__name__}: {error}")
        conn.send(answer)


class ExternalScorer:
    """Calls `eval.function` on a snapshot in its own process; scores come back as `eval/*`."""

    def __init__(self, path: str, sets: list[dict[str, Any]], *, nice: int = 0) -> None:
        load_plugin(path, CheckpointEvalFunction, field=FIELD)  # fails here, not in the child
        self.path = path
        self.sets = sets
        self.nice = nice
        self._context = multiprocessing.get_context("spawn")  # no copy of the trainer's threads
        self._process: Any = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        ours, theirs = self._context.Pipe()
        self._process = self._context.Process(
            target=_serve,
            args=(theirs, self.path, self.sets, self.nice),
            name="verst-eval-external",
            daemon=True,
        )
        self._process.start()
        theirs.close()
        self._conn = ours
        if not ours.poll(READY_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the {FIELD} process did not start in {READY_TIMEOUT_S:.0f} s")
        try:
            answer = ours.recv()
        except EOFError:
            answer = ("error", f"its process exited with code {self._process.exitcode}")
        if answer[0] != "ready":
            self.close()
            raise PluginError(f"{FIELD}: {self.path} cannot be loaded in its process: {answer[1]}")

    def __call__(self, checkpoint_dir: Path, step: int, version: int) -> dict[str, float]:
        if self._process is None or not self._process.is_alive():
            self.close()
            try:
                self._start()
            except (RuntimeError, PluginError) as error:
                raise ExternalCrash(str(error)) from error
        assert self._conn is not None
        try:
            self._conn.send((str(checkpoint_dir), step, version))
            answer = self._conn.recv()
        except (EOFError, OSError) as error:
            code = self._process.exitcode if self._process is not None else None
            self.close()
            raise ExternalCrash(f"the {FIELD} process died (exit code {code})") from error
        if answer[0] == "skip":
            raise EvalSkip(answer[1], answer[2])
        if answer[0] == "error":
            raise ExternalCrash(answer[1])
        return answer[1]

    @property
    def pid(self) -> int | None:
        """The function's process, while it runs."""
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.join(CLOSE_TIMEOUT_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            self._process = None
