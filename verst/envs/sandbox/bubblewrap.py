"""The bubblewrap provider: each command in namespaces of its own (`bwrap`, Debian package
`bubblewrap`).

What a command sees: the work directory at /sandbox (writable), a private /tmp, fresh /proc
and /dev, and `ro_paths` read-only (by default /usr and the loader's files in /etc; on a
merged-/usr system /bin, /lib, /lib64 and /sbin are its symlinks). Nothing else of the host
exists for it: no home directories, no checkout, no /etc/shadow. It has no network at all
(a network namespace with only a down loopback), its own PID namespace (it sees only its
processes, and all of them die with it), its own user namespace (no capabilities, no nested
namespaces), and the limits of `verst.envs.sandbox.limits`, the process cap among them,
applied by `prlimit` once the namespaces exist.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from verst.envs.sandbox.base import Sandbox, SandboxError
from verst.envs.sandbox.config import SandboxConfig
from verst.envs.sandbox.limits import drop_root_argv, prlimit_argv

_MERGED_USR = ("/bin", "/lib", "/lib64", "/sbin")


def bwrap_argv(cfg: SandboxConfig, workdir: Path, tmpdir: Path) -> list[str]:
    """The `bwrap` command line up to the command itself (which follows `prlimit --`), run as
    `run_as_uid` when verst runs as root."""
    argv = [
        *drop_root_argv(cfg),
        "bwrap",
        "--unshare-all",  # user, ipc, pid, net, uts, cgroup
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
    ]
    for path in cfg.ro_paths:
        argv += ["--ro-bind-try", path, path]
    for path in _MERGED_USR:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif path not in cfg.ro_paths:
            argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--bind", str(tmpdir), "/tmp", "--bind", str(workdir), BubblewrapSandbox.INSIDE]
    argv += ["--remount-ro", "/"]  # the skeleton bwrap built: no writable scratch in it
    argv += ["--chdir", BubblewrapSandbox.INSIDE, "--"]
    return argv + prlimit_argv(cfg)


class BubblewrapSandbox(Sandbox):
    provider = "bubblewrap"
    namespaced = True  # `--unshare-all`: a PID namespace a command, killed when it exits
    INSIDE = "/sandbox"

    def _start(self) -> None:
        problem = bubblewrap_problem(self.cfg)
        if problem is not None:
            raise SandboxError(
                f"env.sandbox.provider=bubblewrap cannot run here: {problem}; install "
                "bubblewrap, allow user namespaces, or use provider process (trusted code only)"
            )

    @property
    def workdir_inside(self) -> str:
        return self.INSIDE

    @property
    def tmpdir_inside(self) -> str:
        return "/tmp"

    async def _spawn(
        self, argv: list[str], env: dict[str, str], timeout_s: float
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *bwrap_argv(self.cfg, self.workdir, self.tmpdir),
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )


@functools.lru_cache(maxsize=8)
def _probe(cfg_json: str) -> str | None:
    cfg = SandboxConfig.model_validate_json(cfg_json)
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o711)
        work, tmp = Path(root, "work"), Path(root, "tmp")
        for d in (work, tmp):
            d.mkdir()
            if os.getuid() == 0:
                os.chown(d, cfg.run_as_uid, cfg.run_as_uid)
        try:
            done = subprocess.run(
                [*bwrap_argv(cfg, work, tmp), "/bin/sh", "-c", "true"],
                capture_output=True,
                text=True,
                timeout=30,
                env={"PATH": "/usr/bin:/bin"},
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"bwrap could not run: {error}"
    if done.returncode != 0:
        return f"bwrap exits {done.returncode}: {done.stderr.strip()[:500]}"
    return None


def bubblewrap_problem(cfg: SandboxConfig | None = None) -> str | None:
    """Why bubblewrap cannot sandbox here (None when it can): a real `bwrap` run of `true`
    with the provider's own namespaces, mounts and limits, done once per config."""
    return _probe((cfg or SandboxConfig()).model_dump_json())
