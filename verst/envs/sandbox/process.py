"""The process provider: a plain subprocess under the same limits, for trusted code on hosts
where bubblewrap cannot run. It isolates nothing: the command sees the host's file system and
network as the uid it runs as.

The process cap: a user namespace of its own (`unshare --user` in front of the command) where
the kernel allows one (so RLIMIT_NPROC counts this command's processes only); where it does
not, the cap is set above the processes the uid already runs, so it bounds what the command
adds, shared with any other sandbox of the same uid. Leftovers are found by the marker in their
environment, so a process that starts a session of its own and clears that variable escapes
the clean-up: another reason to trust the code.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import subprocess

from verst.envs.sandbox.base import Sandbox
from verst.envs.sandbox.config import SandboxConfig
from verst.envs.sandbox.limits import (
    drop_root_argv,
    kill_pids,
    marked_pids,
    prlimit_argv,
    sandbox_uid,
    tasks_of_uid,
)

log = logging.getLogger(__name__)
_warned = False


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "SANDBOX PROVIDER 'process' DOES NOT ISOLATE: commands see this host's files and "
            "network. Use it for trusted code only; use provider 'bubblewrap' for model output."
        )


@functools.lru_cache(maxsize=4)
def _own_user_namespace(run_as_uid: int) -> bool:
    """Whether a command run as `run_as_uid` (when root) may make a user namespace."""
    probe = [*drop_root_argv(SandboxConfig(run_as_uid=run_as_uid)), "unshare", "--user", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def limited_argv(cfg: SandboxConfig, argv: list[str]) -> list[str]:
    """`argv` behind the uid, a user namespace of its own where the kernel allows one, then
    every limit (see the module doc). The programs in front apply them as they exec one another,
    so CPython starts the command with vfork rather than forking the caller to run Python."""
    own = _own_user_namespace(cfg.run_as_uid)
    cap = cfg.max_processes + (0 if own else tasks_of_uid(sandbox_uid(cfg)))
    namespace = ["unshare", "--user"] if own else []
    return [*drop_root_argv(cfg), *namespace, *prlimit_argv(cfg, cap), *argv]


class ProcessSandbox(Sandbox):
    provider = "process"

    def _start(self) -> None:
        _warn_once()

    async def _spawn(
        self, argv: list[str], env: dict[str, str], timeout_s: float
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *limited_argv(self.cfg, argv),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=self.workdir,
            start_new_session=True,
        )

    def _kill(self, pid: int) -> None:
        super()._kill(pid)
        kill_pids(marked_pids(self.id))  # those that left the group
