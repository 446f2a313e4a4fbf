"""The config's limits as rlimits, and the host-side checks that keep them real.

Two rules decide how a provider applies them:

- root is exempt from the process cap (the kernel skips RLIMIT_NPROC for uid 0), so a sandbox
  started by root runs its commands as `run_as_uid`;
- RLIMIT_NPROC counts every process of the uid in the process's user namespace, so a cap
  means "processes of this sandbox" only inside a user namespace of its own, set after the
  namespace is made. bubblewrap makes one per command; the process provider makes one where
  the kernel lets it and otherwise counts the uid's processes already running as used.
"""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

from verst.envs.sandbox.config import SandboxConfig

MARKER = "VERST_SANDBOX_ID"  # in every sandboxed process's environment, to find leftovers


def rlimits(cfg: SandboxConfig) -> dict[int, tuple[int, int]]:
    """(soft, hard) per resource, the process cap left out. The CPU hard limit is a second
    above the soft one, so an overrun ends with SIGXCPU (reported as "cpu_time") first."""
    return {
        resource.RLIMIT_CPU: (cfg.cpu_time_s, cfg.cpu_time_s + 1),
        resource.RLIMIT_AS: (cfg.memory_bytes, cfg.memory_bytes),
        resource.RLIMIT_FSIZE: (cfg.max_file_bytes, cfg.max_file_bytes),
        resource.RLIMIT_NOFILE: (cfg.max_open_files, cfg.max_open_files),
        resource.RLIMIT_CORE: (0, 0),
    }


def prlimit_argv(cfg: SandboxConfig, max_processes: int | None = None) -> list[str]:
    """`prlimit` (util-linux) with every limit, the process cap (`max_processes`, default the
    config's) included, for a command run inside a user namespace that is already made."""
    names = {
        resource.RLIMIT_CPU: "cpu",
        resource.RLIMIT_AS: "as",
        resource.RLIMIT_FSIZE: "fsize",
        resource.RLIMIT_NOFILE: "nofile",
        resource.RLIMIT_CORE: "core",
    }
    argv = ["prlimit"] + [
        f"--{names[res]}={soft}:{hard}" for res, (soft, hard) in rlimits(cfg).items()
    ]
    cap = cfg.max_processes if max_processes is None else max_processes
    return argv + [f"--nproc={cap}:{cap}", "--"]


def sandbox_uid(cfg: SandboxConfig) -> int:
    """The uid commands run as: the caller's own, or `run_as_uid` when the caller is root."""
    uid = os.getuid()
    return cfg.run_as_uid if uid == 0 else uid


def drop_root_argv(cfg: SandboxConfig) -> list[str]:
    """`setpriv` (util-linux) to become `run_as_uid` (and its gid, no other groups) when running
    as root, for the front of a command line; nothing otherwise. Dropping root in the exec'd
    program rather than in a `preexec_fn` lets CPython start the command with vfork: a fork
    with a Python pre-exec hook copies the caller's page tables under the GIL, 80 ms a command
    from a trainer process of 1 GB, and every thread of the process waits for it."""
    if os.getuid() != 0:
        return []
    uid = cfg.run_as_uid
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def tasks_of_uid(uid: int) -> int:
    """Processes and threads whose real uid is `uid` (what RLIMIT_NPROC counts)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":", 1) for line in status.read_text().splitlines() if ":" in line
            )
        except OSError:  # the process ended while we looked
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def marked_pids(sandbox_id: str) -> list[int]:
    """Live processes carrying `sandbox_id` in their environment (leftovers of a sandbox)."""
    needle = f"{MARKER}={sandbox_id}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:  # ended, or not ours to read
            continue
    return [p for p in pids if p != os.getpid()]


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def killed_reason(exit_code: int) -> str | None:
    """What a shell-style exit code (128 + signal for a killed process) says about a kill."""
    if exit_code <= 128 or exit_code > 128 + 64:
        return None
    sig = exit_code - 128
    named = {signal.SIGXCPU: "cpu_time", signal.SIGXFSZ: "file_size", signal.SIGKILL: "killed"}
    try:
        return named.get(signal.Signals(sig), f"signal {signal.Signals(sig).name}")
    except ValueError:
        return f"signal {sig}"
