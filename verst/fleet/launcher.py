"""Start engine servers as local subprocesses: `verst serve` fleets, or one real SGLang server.

`launch_local_engines` returns only once every server answers `GET /health` with 200; a server
that exits or times out raises a RuntimeError with the tail of its log, and the servers already
started are stopped. Each `LocalEngine` is a context manager that stops its process.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOG_TAIL_LINES = 40


@dataclass
class LocalEngine:
    """One engine server process on 127.0.0.1 (or `host`); its output goes to `log_path`."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    host: str = "127.0.0.1"
    _log: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    def kill(self) -> None:
        """SIGKILL, for a process that may be hung: no grace period."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.stop()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# the lowest port `free_port` picks outside the ephemeral range: above Ray's default worker
# ports (10002-19999), which a Ray node refuses to share with its GCS port and which its
# workers may take at any time
LISTEN_PORTS_FROM = 20000
# the OS's randomness, not `random`'s: runs seed `random` alike, and two processes seeded the
# same would draw the same ports
_PORT_DRAWS = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server that binds it soon after. On Linux it is taken
    below the kernel's ephemeral range: a port `bind(0)` hands out there can be taken by any
    outgoing connection before the server binds it (seen as EADDRINUSE in a trainer group's
    rendezvous while Ray held many connections); only an explicit bind can take one below."""
    low = _ephemeral_low()
    if low is not None and low > LISTEN_PORTS_FROM:
        for port in _PORT_DRAWS.sample(range(LISTEN_PORTS_FROM, low), 64):
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int | None:
    try:
        return int(PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # not Linux: bind(0)'s port


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _start(
    cmd: list[str], port: int, host: str, name: str, env: dict[str, str] | None = None
) -> LocalEngine:
    fd, log_name = tempfile.mkstemp(prefix=f"{name}-{port}-", suffix=".log")
    log = os.fdopen(fd, "wb")
    # The child gets its own session so stop() never signals the caller's process group.
    process = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    return LocalEngine(process=process, port=port, log_path=Path(log_name), host=host, _log=log)


def niced(nice: int) -> list[str]:
    """The command prefix that starts a process `nice` steps below normal CPU priority."""
    if nice == 0:
        return []
    program = shutil.which("nice")
    if program is None:
        raise RuntimeError(
            f"engine niceness {nice} (placement.engine_nice or eval.nice) needs the `nice` "
            "command, which is not on PATH; set it to 0"
        )
    return [program, "-n", str(nice)]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(engine: LocalEngine, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        code = engine.process.poll()
        if code is not None:
            raise RuntimeError(
                f"{what} on port {engine.port} exited with code {code} before it was healthy; "
                f"last lines of {engine.log_path}:\n{engine.log_tail()}"
            )
        if _healthy(engine.url):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{what} on port {engine.port} was not healthy after {timeout_s:.0f} s; "
                f"last lines of {engine.log_path}:\n{engine.log_tail()}"
            )
        time.sleep(0.1)


def launch_local_engines(
    model_dir: str | Path,
    n: int,
    *,
    base_port: int | None = None,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    engine_args: Sequence[Sequence[str]] = (),
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    nice: int = 0,
) -> list[LocalEngine]:
    """Start `n` `verst serve` processes (ports base_port + i, or free ones); wait for health.

    Every process gets `extra_args`; process i also gets `engine_args[i]` when given (its
    device, its seed). `env` is added to this process's environment: secrets such as
    `VERST_API_KEY` go there, not on the command line, where `ps` would show them. `nice` > 0
    starts them under `nice -n` (every thread they start inherits it).
    """
    child_env = {**os.environ, **env} if env else None
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if engine_args and len(engine_args) != n:
        raise ValueError(f"engine_args has {len(engine_args)} entries for {n} engines")
    engines: list[LocalEngine] = []
    try:
        for i in range(n):
            port = base_port + i if base_port is not None else free_port(host)
            cmd = [*niced(nice), sys.executable, "-m", "verst", "serve", "--model", str(model_dir)]
            cmd += ["--port", str(port), "--host", host, "--parent-pid", str(os.getpid())]
            cmd += list(extra_args)
            cmd += list(engine_args[i]) if engine_args else []
            engines.append(_start(cmd, port, host, "verst-serve", env=child_env))
        for engine in engines:  # started together, so their start-up times overlap
            wait_healthy(engine, timeout_s, "verst serve")
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


def launch_sglang(
    model_dir: str | Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    timeout_s: float = 600.0,
) -> LocalEngine:
    """Start `python -m sglang.launch_server` for `model_dir` and wait until it is healthy."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError(
            "SGLang is not installed in this environment; install it with "
            '`pip install "sglang[all]"` (GPU machines), or use launch_local_engines for the '
            "embedded verst engine"
        )
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir)]
    cmd += ["--port", str(port), "--host", host, *extra_args]
    engine = _start(cmd, port, host, "sglang")
    try:
        wait_healthy(engine, timeout_s, "sglang.launch_server")
    except BaseException:
        engine.stop()
        raise
    return engine
