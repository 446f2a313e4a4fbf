"""The docker provider: one container per episode, started when the sandbox opens and removed
when it closes; each command is a `docker exec` in it.

The container has no network (`--network none`), a read-only root, the work directory at
/sandbox and a size-limited /tmp, no capabilities, and the limits as Docker's own: memory
(`--memory`, swap included), processes (`--pids-limit`), and CPU time, file size and open
files as ulimits. Each command runs under coreutils' `timeout` inside as well as the host's
clock, so a command that overruns is killed in the container, not only its `docker exec`.
"""

from __future__ import annotations

import asyncio
import functools
import math
import shutil
import subprocess

from verst.envs.sandbox.base import Sandbox, SandboxError
from verst.envs.sandbox.config import SandboxConfig
from verst.envs.sandbox.limits import sandbox_uid

_LABEL = "verst.sandbox"


@functools.lru_cache(maxsize=1)
def docker_problem() -> str | None:
    """Why the docker provider cannot run here (None when a daemon answers)."""
    if shutil.which("docker") is None:
        return "the docker command is not installed"
    try:
        done = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"docker info failed: {error}"
    if done.returncode != 0:
        return f"no Docker daemon: {done.stderr.strip()[:300]}"
    return None


class DockerSandbox(Sandbox):
    provider = "docker"
    INSIDE = "/sandbox"

    def __init__(self, cfg: SandboxConfig) -> None:
        super().__init__(cfg)
        self._container: str | None = None

    @property
    def workdir_inside(self) -> str:
        return self.INSIDE

    @property
    def tmpdir_inside(self) -> str:
        return "/tmp"

    def _start(self) -> None:
        problem = docker_problem()
        if problem is not None:
            raise SandboxError(f"env.sandbox.provider=docker cannot run here: {problem}")
        cfg, uid = self.cfg, sandbox_uid(self.cfg)
        argv = ["docker", "run", "--detach", "--rm", "--init", "--network", "none"]
        argv += ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
        argv += ["--tmpfs", f"/tmp:rw,size={cfg.max_file_bytes}"]
        argv += ["--memory", str(cfg.memory_bytes), "--memory-swap", str(cfg.memory_bytes)]
        argv += ["--pids-limit", str(cfg.max_processes)]
        argv += ["--ulimit", f"cpu={cfg.cpu_time_s}:{cfg.cpu_time_s + 1}"]
        argv += ["--ulimit", f"fsize={cfg.max_file_bytes}"]
        argv += ["--ulimit", f"nofile={cfg.max_open_files}"]
        argv += ["--user", f"{uid}:{uid}", "--label", f"{_LABEL}={self.id}"]
        argv += ["-v", f"{self.workdir}:{self.INSIDE}", "-w", self.INSIDE]
        argv += [cfg.docker_image, "sleep", "infinity"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SandboxError(f"docker run failed: {done.stderr.strip()[:500]}")
        self._container = done.stdout.strip()

    def _stop(self) -> None:
        if self._container is not None:
            subprocess.run(
                ["docker", "rm", "--force", self._container], capture_output=True, timeout=60
            )
            self._container = None

    async def _spawn(
        self, argv: list[str], env: dict[str, str], timeout_s: float
    ) -> asyncio.subprocess.Process:
        if self._container is None:
            raise SandboxError("the docker sandbox is not open")
        flags = [f"--env={k}={v}" for k, v in env.items()]
        limit_s = str(math.ceil(timeout_s))
        return await asyncio.create_subprocess_exec(
            "docker",
            "exec",
            "--interactive",
            *flags,
            self._container,
            "timeout",
            "--signal=KILL",
            limit_s,
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
