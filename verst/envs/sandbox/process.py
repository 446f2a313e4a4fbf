"""The process provider: a plain subprocess under the same limits, for trusted code on hosts
where bubblewrap cannot run. It isolates nothing: the command sees the host's file system and
network as the uid it runs as.

The process cap: in the child, before exec, a user namespace of its own where the kernel
allows one (so RLIMIT_NPROC counts this command's processes only); where it does not, the cap
is set above the processes the uid already runs, so it bounds what the command adds, shared
with any other sandbox of the same uid. Leftovers are found by the marker in their
environment, so a process that starts a session of its own and clears that variable escapes
the clean-up: another reason to trust the code.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import resource
import subprocess

from verst.envs.sandbox.base import Sandbox
from verst.envs.sandbox.config import SandboxConfig
from verst.envs.sandbox.limits import (
    drop_root,
    kill_pids,
    marked_pids,
    rlimits,
    sandbox_uid,
    tasks_of_uid,
)

log = logging.getLogger(__name__)
_CLONE_NEWUSER = 0x10000000
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not dlopen
_warned = False


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "SANDBOX PROVIDER 'process' DOES NOT ISOLATE: commands see this host's files and "
            "network. Use it for trusted code only; use provider 'bubblewrap' for model output."
        )


def _unshare_user() -> None:
    if _LIBC.unshare(_CLONE_NEWUSER) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")


@functools.lru_cache(maxsize=4)
def _own_user_namespace(run_as_uid: int) -> bool:
    """Whether a child dropped to `run_as_uid` (when root) may make a user namespace."""
    cfg = SandboxConfig(run_as_uid=run_as_uid)

    def child() -> None:
        drop_root(cfg)
        _unshare_user()

    try:
        return subprocess.run(["/bin/true"], preexec_fn=child, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limit_in_child(cfg: SandboxConfig, cap: int, own_namespace: bool) -> None:
    """In the forked child: limits, the uid, then the process cap (see the module doc)."""
    for res, pair in rlimits(cfg).items():
        resource.setrlimit(res, pair)
    drop_root(cfg)
    if own_namespace:
        _unshare_user()
    resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))


class ProcessSandbox(Sandbox):
    provider = "process"

    def _start(self) -> None:
        _warn_once()

    async def _spawn(
        self, argv: list[str], env: dict[str, str], timeout_s: float
    ) -> asyncio.subprocess.Process:
        cfg = self.cfg
        own = _own_user_namespace(cfg.run_as_uid)
        cap = cfg.max_processes + (0 if own else tasks_of_uid(sandbox_uid(cfg)))
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=self.workdir,
            start_new_session=True,
            preexec_fn=lambda: _limit_in_child(cfg, cap, own),
        )

    def _kill(self, pid: int) -> None:
        super()._kill(pid)
        kill_pids(marked_pids(self.id))  # those that left the group
