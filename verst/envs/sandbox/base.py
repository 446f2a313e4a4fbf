"""The sandbox contract: one episode's work directory and the commands run in it.

    with open_sandbox(cfg) as box:                 # or `async with`
        box.put("main.py", "print(6 * 7)")
        result = box.run_sync(["python3", "main.py"])
        result.stdout, result.exit_code, result.timed_out, result.killed_reason

A sandbox owns a fresh work directory, made when it opens and deleted when it closes. Commands
start in it (the path they see is `workdir_inside`), see it as their only writable place, and
run under the config's limits. `run` never raises for what the command does: a timeout, a kill
or a flood of output is in the result. On return, nothing the command started is left running,
and closing the sandbox kills whatever might still be. Providers (`bubblewrap`, `process`,
`docker`) differ in how they isolate, not in this contract.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from verst.envs.sandbox.config import SandboxConfig
from verst.envs.sandbox.limits import MARKER, kill_pids, killed_reason, marked_pids, sandbox_uid

Command = str | list[str]
_CHUNK = 1 << 16
_DRAIN_S = 2.0


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, bad path); never what a command did."""


@dataclass
class RunResult:
    """What one command did. `exit_code` follows the shell: 128 + N when signal N killed it."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    killed_reason: str | None = None  # "timeout", "cpu_time", "file_size", "killed", ...
    output_truncated: bool = False  # stdout or stderr passed max_output_bytes
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox(ABC):
    """Base of the providers: work directory, file transfer, running with a wall clock."""

    provider: str
    # True where nothing a command started can outlive the command once it has exited
    # (bubblewrap: the command's PID namespace dies with it), so `close` need not look for
    # leftovers unless a command was interrupted before it was seen to exit
    namespaced: bool = False

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.id = uuid.uuid4().hex[:16]
        self._root: Path | None = None  # the episode's directory: work/ and tmp/
        self._unconfirmed = 0  # commands spawned (or spawning) not yet seen to exit

    # -- lifecycle ------------------------------------------------------------------------

    def open(self) -> Sandbox:
        """Make the work directory (owned by the uid commands run as) and start the provider."""
        if self._root is not None:
            raise SandboxError("this sandbox is already open; a sandbox serves one episode")
        parent = self.cfg.work_root
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        self._root = Path(tempfile.mkdtemp(prefix=f"verst-sbx-{self.id}-", dir=parent))
        uid = sandbox_uid(self.cfg)
        if uid != os.getuid():
            _check_searchable(self._root.parent, uid)
        self._root.chmod(0o711)  # the uid commands run as passes through to its own dirs
        for sub in ("work", "tmp"):
            (self._root / sub).mkdir(mode=0o700)
            if uid != os.getuid():
                os.chown(self._root / sub, uid, uid)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill anything left of the episode and delete its work directory."""
        if self._root is None:
            return
        try:
            self._stop()
            if self._unconfirmed or not self.namespaced:
                # a scan of every process's environment: ~2 ms on an idle machine
                kill_pids(marked_pids(self.id))
        finally:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> Sandbox:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Sandbox:
        return await asyncio.to_thread(self.open)

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType
    ) -> None:
        await asyncio.to_thread(self.close)

    @property
    def workdir(self) -> Path:
        """The work directory on the host."""
        if self._root is None:
            raise SandboxError("the sandbox is not open (use it as a context manager)")
        return self._root / "work"

    @property
    def workdir_inside(self) -> str:
        """The work directory's path as commands see it."""
        return str(self.workdir)

    @property
    def tmpdir_inside(self) -> str:
        return str(self.tmpdir)

    @property
    def tmpdir(self) -> Path:
        """The episode's temporary directory on the host (`/tmp` inside where it can be)."""
        return self.workdir.parent / "tmp"

    # -- files ----------------------------------------------------------------------------

    def _host_path(self, path: str) -> Path:
        """`path` (relative to the work directory) on the host, refusing any way out of it:
        absolute paths, `..`, and symlinks a command planted to point elsewhere."""
        if not path or Path(path).is_absolute():
            raise SandboxError(f"sandbox paths are relative to the work directory, got {path!r}")
        root = self.workdir.resolve()
        target = (root / path).resolve()
        if target != root and root not in target.parents:
            raise SandboxError(f"{path!r} leads out of the sandbox's work directory")
        return target

    def put(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        """Write a file into the work directory (parents made as needed)."""
        target = self._host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        fd = os.open(target, flags, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        uid = sandbox_uid(self.cfg)
        if uid != os.getuid():  # the command may rewrite what we put there
            root, parts = self.workdir.resolve(), target.relative_to(self.workdir.resolve()).parts
            for depth in range(1, len(parts) + 1):
                os.chown(root.joinpath(*parts[:depth]), uid, uid)

    def get(self, path: str, max_bytes: int | None = None) -> bytes:
        """Read a file from the work directory; `SandboxError` if it is missing or larger than
        `max_bytes` (default: the config's max_file_bytes)."""
        limit = self.cfg.max_file_bytes if max_bytes is None else max_bytes
        target = self._host_path(path)
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as error:
            raise SandboxError(f"cannot read {path!r} from the sandbox: {error.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise SandboxError(f"{path!r} is larger than {limit} bytes")
        return data

    # -- running --------------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The whole environment a command gets: nothing of the host's, the marker, `extra`."""
        base = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.workdir_inside,
            "TMPDIR": self.tmpdir_inside,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            MARKER: self.id,
        }
        return {**base, **(extra or {})}

    async def run(
        self,
        cmd: Command,
        stdin: str | bytes | None = None,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
    ) -> RunResult:
        """Run `cmd` (argv, or a string for `/bin/sh -c`) in the work directory."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise SandboxError("empty command")
        timeout = self.cfg.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._unconfirmed += 1  # from before the spawn: a cancel inside it may leave a process
        proc = await self._spawn(argv, self.env(env), timeout)
        out, err = _Capture(self.cfg.max_output_bytes), _Capture(self.cfg.max_output_bytes)
        reads = [
            asyncio.ensure_future(out.drain(proc.stdout)),
            asyncio.ensure_future(err.drain(proc.stderr)),
        ]
        feed = asyncio.ensure_future(_feed(proc.stdin, stdin))
        timed_out = False
        try:
            timed_out = not await _exited(proc, timeout)
        finally:
            # the group (and for bubblewrap the whole PID namespace) goes, whatever happened;
            # not awaited first, so that a cancelled episode still kills it
            self._kill(proc.pid)
        await _exited(proc, _DRAIN_S)
        # a process that escaped the kill may hold the pipes open: stop reading after a while
        await asyncio.wait(reads, timeout=_DRAIN_S)
        for task in (*reads, feed):
            task.cancel()
        if proc.returncode is None:
            raise SandboxError(f"{self.provider} sandbox: the command survived SIGKILL")
        self._unconfirmed -= 1
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return RunResult(
            stdout=out.text,
            stderr=err.text,
            exit_code=code,
            timed_out=timed_out,
            killed_reason="timeout" if timed_out else killed_reason(code),
            output_truncated=out.cut or err.cut,
            duration_s=loop.time() - started,
        )

    def run_sync(self, cmd: Command, **kwargs: Any) -> RunResult:
        """`run` from code that has no event loop (scripts, the CLI, tests)."""
        return asyncio.run(self.run(cmd, **kwargs))

    def _kill(self, pid: int) -> None:
        """Kill the command's process group (`pid` leads it)."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    # -- what a provider supplies ---------------------------------------------------------

    def _start(self) -> None:  # noqa: B027 (an optional hook)
        """Provider set-up once the work directory exists (e.g. start a container)."""

    def _stop(self) -> None:  # noqa: B027 (an optional hook)
        """Provider tear-down before the work directory goes."""

    @abstractmethod
    async def _spawn(
        self, argv: list[str], env: dict[str, str], timeout_s: float
    ) -> asyncio.subprocess.Process:
        """Start `argv` in the sandbox with pipes for stdin, stdout and stderr, as the leader
        of a new session (so that killing the group kills what it started)."""


def _check_searchable(path: Path, uid: int) -> None:
    """`SandboxError` unless `uid` may pass through every directory down to `path`."""
    for directory in [path, *path.parents]:
        st = directory.stat()
        if not (st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100)):
            raise SandboxError(
                f"env.sandbox.work_root: {directory} is not searchable by uid {uid}, which "
                "commands run as when verst runs as root (env.sandbox.run_as_uid); choose a "
                "work_root every user can pass through (chmod o+x)"
            )


async def _exited(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Whether `proc` exits within `timeout_s`. Not `proc.wait()`: that also waits for the
    pipes to close, which a background child holding them can put off indefinitely."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + timeout_s, 0.001
    while proc.returncode is None:
        left = deadline - loop.time()
        if left <= 0:
            return False
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)
    return True


class _Capture:
    """Up to `limit` bytes of a stream, draining the rest so the writer never blocks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.cut = False

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        while chunk := await stream.read(_CHUNK):
            room = self.limit - len(self.data)
            self.cut = self.cut or len(chunk) > room
            self.data += chunk[: max(room, 0)]

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")


async def _feed(pipe: asyncio.StreamWriter | None, data: str | bytes | None) -> None:
    if pipe is None:
        return
    try:
        if data:
            pipe.write(data.encode() if isinstance(data, str) else data)
            await pipe.drain()
        pipe.close()
    except (BrokenPipeError, ConnectionResetError):  # the command did not read it all
        pass
