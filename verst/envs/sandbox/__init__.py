"""Sandboxes for environments: one per episode, with a fresh work directory, limits that the
kernel enforces, and nothing left running afterwards (see `base` for the contract).

    from verst.envs.sandbox import SandboxConfig, make_sandbox
    with make_sandbox(SandboxConfig(provider="bubblewrap")) as box:
        print(box.run_sync("echo hi").stdout)
"""

from __future__ import annotations

from verst.envs.sandbox.base import RunResult, Sandbox, SandboxError
from verst.envs.sandbox.bubblewrap import BubblewrapSandbox, bubblewrap_problem
from verst.envs.sandbox.config import SandboxConfig
from verst.envs.sandbox.docker import DockerSandbox, docker_problem
from verst.envs.sandbox.process import ProcessSandbox

PROVIDERS: dict[str, type[Sandbox]] = {
    "bubblewrap": BubblewrapSandbox,
    "process": ProcessSandbox,
    "docker": DockerSandbox,
}


def make_sandbox(cfg: SandboxConfig) -> Sandbox:
    """A sandbox of `cfg.provider`, not yet open (open it with `with` / `async with`)."""
    return PROVIDERS[cfg.provider](cfg)


__all__ = [
    "PROVIDERS",
    "RunResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "bubblewrap_problem",
    "docker_problem",
    "make_sandbox",
]
