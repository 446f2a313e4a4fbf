"""The sandbox section of the config (`env.sandbox`): which provider, and the limits every
command run in a sandbox is held to."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from verst.configbase import ConfigBase

Provider = Literal["bubblewrap", "process", "docker"]

# What a command needs to run programs from the system: the dynamic loader's files. The rest
# of /etc (passwd, shadow, ssh keys, ...) stays out of the sandbox.
DEFAULT_RO_PATHS = (
    "/usr",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
)


class SandboxConfig(ConfigBase):
    """One sandbox per episode; every field has a default that is safe for untrusted code."""

    provider: Provider = Field(
        "bubblewrap",
        description="bubblewrap = namespaces, read-only system, no network (untrusted code); "
        "process = a plain subprocess with the same limits (trusted code only); docker = a "
        "container per episode (needs a Docker daemon)",
    )
    timeout_s: float = Field(
        10.0, gt=0, description="wall clock per command; past it everything it started is killed"
    )
    cpu_time_s: int = Field(10, ge=1, description="CPU seconds per process (RLIMIT_CPU)")
    memory_bytes: int = Field(
        1 << 30, ge=1 << 24, description="address space per process (RLIMIT_AS)"
    )
    max_processes: int = Field(
        64, ge=2, description="processes and threads a command may have at once"
    )
    max_file_bytes: int = Field(
        64 << 20, ge=1, description="largest file a command may write (RLIMIT_FSIZE)"
    )
    max_open_files: int = Field(256, ge=16, description="open file descriptors per process")
    max_output_bytes: int = Field(
        1 << 20, ge=1, description="stdout and stderr kept per command; the rest is dropped"
    )
    ro_paths: list[str] = Field(
        list(DEFAULT_RO_PATHS),
        description="host paths visible read-only inside (bubblewrap); missing ones are skipped",
    )
    run_as_uid: int = Field(
        65534,
        ge=1,
        description="when verst runs as root, commands run as this uid (root is exempt from "
        "the process cap); bubblewrap and process providers",
    )
    work_root: str | None = Field(
        None, description="where episodes' work directories are made; unset = the system temp"
    )
    docker_image: str = Field(
        "python:3.11-slim", description="the image of the docker provider's containers"
    )
    pool_size: int = Field(
        4, ge=0, description="sandboxes kept ready ahead of episodes (never reused)"
    )
