"""`verst train --max-restarts N`: the trainer runs as a child process, restarted from its last
checkpoint when it crashes.

A child that dies by a signal (SIGKILL from the OOM killer, a segfault) or exits with any code
but 0 and `verst.exitcodes.FINAL` has crashed. The next attempt resumes from the newest
checkpoint (`--resume`), or starts the run over when the crash came before the first checkpoint
(the run's metrics and checkpoint directory are cleared first). Each restart prints one line and
appends a record to `run_dir/restarts.jsonl`. After N restarts the supervisor gives up with one
line and the child's status. SIGINT, SIGTERM and SIGHUP go to the child, and the supervisor
then ends with the child's status, restarting nothing. The child runs in a session of its own so
that a Ctrl-C reaches it once, through the supervisor.

The supervisor exits as the child did: its code, or 128 + the signal that killed it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from verst import exitcodes
from verst.rundir import append_record, clear_run
from verst.train.checkpoint import list_checkpoints

RESTARTS_FILE = "restarts.jsonl"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def describe(returncode: int) -> str:
    """A child's exit as people say it: "exit code 1", "signal SIGKILL"."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def exit_status(returncode: int) -> int:
    """The shell's code for a child's exit: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    def __init__(self, train_args: list[str], run_dir: Path, max_restarts: int) -> None:
        self.train_args = train_args  # `verst train` arguments, without --resume / --overwrite
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.process: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None

    def run(self, *, resume: bool) -> int:
        """Train to the end, restarting crashed attempts; returns the exit status."""
        previous = {signum: signal.signal(signum, self._forward) for signum in FORWARDED}
        try:
            restarts = 0
            while True:
                returncode = self._attempt(resume)
                done = returncode == 0 or returncode in exitcodes.FINAL
                if done or self.stop_signal is not None:
                    return exit_status(returncode)
                if restarts == self.max_restarts:
                    print(
                        f"verst: error: trainer exited with {describe(returncode)}; giving up "
                        f"after {restarts} restart{'s' * (restarts != 1)} (--max-restarts "
                        f"{self.max_restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                    return exit_status(returncode)
                restarts += 1
                resume = self._prepare_restart(restarts, returncode)
                if self.stop_signal is not None:  # it came between two attempts
                    return 128 + self.stop_signal
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _attempt(self, resume: bool) -> int:
        command = [sys.executable, "-m", "verst", "train", *self.train_args]
        self.process = subprocess.Popen(command + ["--resume"] * resume, start_new_session=True)
        if self.stop_signal is not None:  # it came while the child was starting
            self.process.send_signal(self.stop_signal)
        return self.process.wait()

    def _forward(self, signum: int, frame: object) -> None:
        self.stop_signal = signum
        if self.process is not None:
            self.process.send_signal(signum)  # a no-op once the child has been reaped

    def _prepare_restart(self, restarts: int, returncode: int) -> bool:
        """Record restart number `restarts` and ready the run directory for it; returns
        whether it resumes (False: no checkpoint yet, the run starts over)."""
        checkpoints = list_checkpoints(self.run_dir)
        resumed_from = checkpoints[-1].name if checkpoints else None
        if resumed_from is None:
            clear_run(self.run_dir)
        origin = f"checkpoint {resumed_from}" if resumed_from else "scratch (no checkpoint yet)"
        print(
            f"verst: trainer exited with {describe(returncode)}; restart "
            f"{restarts}/{self.max_restarts} from {origin}",
            file=sys.stderr,
            flush=True,
        )
        record = {
            "time": time.time(),
            "restart": restarts,
            "exit_status": describe(returncode),
            "returncode": returncode,
            "resumed_from": resumed_from,
        }
        append_record(self.run_dir / RESTARTS_FILE, record)
        return resumed_from is not None
