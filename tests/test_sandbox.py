"""The sandbox's promises, checked against the kernel: the process cap stops a fork bomb,
memory over the cap fails, the wall clock and the CPU limit kill, nothing outlives a command,
and under bubblewrap nothing outside the work directory can be read or written and no
network (not even the host's loopback) can be reached.

Bubblewrap tests skip only when `bwrap` itself fails its probe, with the probe's reason; the
docker tests skip when no daemon answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from verst.envs.sandbox import (
    SandboxConfig,
    SandboxError,
    bubblewrap_problem,
    docker_problem,
    make_sandbox,
)
from verst.envs.sandbox.limits import marked_pids, sandbox_uid

REPO = Path(__file__).resolve().parents[1]
LIMITS = dict(timeout_s=5.0, cpu_time_s=5, memory_bytes=256 << 20, max_processes=16)


def _config(provider: str, **overrides: object) -> SandboxConfig:
    if provider == "bubblewrap" and (problem := bubblewrap_problem()) is not None:
        pytest.skip(f"bwrap fails its probe here: {problem}")
    if provider == "docker" and (problem := docker_problem()) is not None:
        pytest.skip(f"docker provider unavailable: {problem}")
    return SandboxConfig(provider=provider, **{**LIMITS, **overrides})


@pytest.fixture(params=["bubblewrap", "process", "docker"])
def box(request: pytest.FixtureRequest) -> Iterator:
    with make_sandbox(_config(request.param)) as sandbox:
        yield sandbox


@pytest.fixture
def bwrap_box() -> Iterator:
    with make_sandbox(_config("bubblewrap")) as sandbox:
        yield sandbox


FORK_COUNTER = """
import os, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        print(n, flush=True)
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
"""


def test_runs_a_command_with_files_in_and_out(box) -> None:
    box.put("in/data.txt", "6 7")
    result = box.run_sync(
        [
            "python3",
            "-c",
            "a, b = open('in/data.txt').read().split(); "
            "open('out.txt', 'w').write(str(int(a) * int(b))); print('done')",
        ]
    )
    assert result.ok, result
    assert result.stdout == "done\n"
    assert box.get("out.txt") == b"42"
    assert box.run_sync("cat", stdin="echo me").stdout == "echo me"
    assert box.run_sync("exit 3").exit_code == 3


def test_process_cap_stops_forks_and_a_fork_bomb(box) -> None:
    counted = box.run_sync(["python3", "-c", FORK_COUNTER])
    assert counted.ok, counted  # done (and its sleeping children killed) before the clock
    forks = int(counted.stdout.split()[0])
    # the cap counts the sandbox's own processes: itself and the (bubblewrap) init
    assert 0 < forks < LIMITS["max_processes"], counted
    bomb = box.run_sync("bomb() { bomb | bomb & }; bomb; sleep 2", timeout_s=3)
    assert not bomb.timed_out or bomb.killed_reason == "timeout"
    assert marked_pids(box.id) == []
    assert box.run_sync("echo alive").stdout == "alive\n"  # the host still forks


def test_memory_over_the_cap_fails(box) -> None:
    small = box.run_sync(["python3", "-c", "b = bytearray(64 << 20); print(len(b))"])
    assert small.ok and small.stdout.strip() == str(64 << 20), small
    big = box.run_sync(["python3", "-c", "b = bytearray(512 << 20); print('allocated')"])
    assert big.exit_code != 0 and "allocated" not in big.stdout
    assert "MemoryError" in big.stderr


def test_infinite_loop_is_killed_at_the_wall_clock(box) -> None:
    started = time.monotonic()
    result = box.run_sync(["python3", "-c", "while True: pass"], timeout_s=1.0)
    assert result.timed_out and result.killed_reason == "timeout"
    assert time.monotonic() - started < 4.0
    assert marked_pids(box.id) == []


def test_cpu_time_limit_kills(box) -> None:
    with make_sandbox(_config(box.provider, cpu_time_s=1, timeout_s=20)) as tight:
        result = tight.run_sync(["python3", "-c", "while True: pass"])
    assert not result.timed_out
    assert result.killed_reason in ("cpu_time", "killed"), result


def test_nothing_outlives_a_command_or_the_episode(box) -> None:
    result = box.run_sync("sleep 100 & (setsid sleep 100 &) ; echo started")
    assert result.ok and result.stdout == "started\n" and result.duration_s < 2.0, result
    assert marked_pids(box.id) == []
    workdir = box.workdir
    box.close()
    assert not workdir.exists()


def test_a_cancelled_command_leaves_nothing_after_close(box) -> None:
    """An episode cancelled mid-command: the run's own kill, and close's search for leftovers
    (bubblewrap searches only after such an interrupted command)."""

    async def cancelled() -> None:
        task = asyncio.ensure_future(box.run("sleep 100 & (setsid sleep 100 &) ; sleep 100"))
        await asyncio.sleep(0.5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)  # the killed command reaped while the loop runs

    asyncio.run(cancelled())
    box.close()
    assert marked_pids(box.id) == []


def test_output_flood_is_cut_and_the_run_goes_on(box) -> None:
    with make_sandbox(_config(box.provider, max_output_bytes=10_000)) as small:
        result = small.run_sync("head -c 5000000 /dev/zero | tr '\\0' x; echo end >&2")
    assert result.ok and result.output_truncated
    assert len(result.stdout) == 10_000 and result.stderr == "end\n"


def test_paths_cannot_leave_the_work_directory(box) -> None:
    box.run_sync("ln -s /etc/passwd leak")
    for path in ("leak", "../tmp", "/etc/passwd", ""):
        with pytest.raises(SandboxError):
            box.get(path)
    with pytest.raises(SandboxError):
        box.put("../escape.txt", "x")


# ---- bubblewrap only ---------------------------------------------------------------------------


def test_bwrap_sees_no_host_files(bwrap_box) -> None:
    secrets = ["/etc/shadow", "/etc/passwd", str(REPO / "pyproject.toml"), str(Path.home())]
    for path in secrets:
        result = bwrap_box.run_sync(["ls", "-la", path])
        assert result.exit_code != 0, f"{path} is visible: {result.stdout}"
    # the host really has them (the assertions above are not vacuous)
    assert (REPO / "pyproject.toml").exists() and Path.home().exists()


def test_bwrap_writes_only_in_the_work_directory(bwrap_box) -> None:
    for path in ("/usr/verst-probe", "/etc/verst-probe", "/verst-probe", "/proc/verst-probe"):
        result = bwrap_box.run_sync(["touch", path])
        assert result.exit_code != 0, f"wrote {path}"
    assert bwrap_box.run_sync(["touch", "/sandbox/ok", "/tmp/ok"]).ok
    assert bwrap_box.get("ok") == b""
    assert not Path("/usr/verst-probe").exists()


def test_bwrap_commands_run_as_the_sandbox_uid_without_groups_or_capabilities(bwrap_box) -> None:
    status = bwrap_box.run_sync(["cat", "/proc/self/status"]).stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uid = sandbox_uid(bwrap_box.cfg)
    assert fields["Uid"].split() == [str(uid)] * 4
    assert int(fields["CapEff"], 16) == 0
    if os.getuid() == 0:  # root's commands run as run_as_uid, its group and no other
        assert fields["Gid"].split() == [str(uid)] * 4
        assert fields["Groups"].strip() == ""


def test_bwrap_has_no_network_not_even_the_hosts_loopback() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    connect = [
        "python3",
        "-c",
        f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('in')",
    ]
    try:
        with make_sandbox(_config("process")) as plain:
            assert plain.run_sync(connect).stdout == "in\n"  # the server is reachable
        with make_sandbox(_config("bubblewrap")) as box:
            result = box.run_sync(connect)
            assert result.exit_code != 0 and "in" not in result.stdout
            external = box.run_sync(
                ["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 53), 2)"]
            )
            assert external.exit_code != 0 and "unreachable" in external.stderr.lower()
    finally:
        server.close()


def test_bwrap_each_episode_gets_a_fresh_work_directory() -> None:
    cfg = _config("bubblewrap")
    with make_sandbox(cfg) as first:
        first.run_sync("echo secret > note")
        first_dir = first.workdir
    with make_sandbox(cfg) as second:
        assert second.workdir != first_dir
        assert second.run_sync("ls -A").stdout == ""
    with pytest.raises(SandboxError, match="not open"):
        second.run_sync("true")


def test_process_provider_warns(caplog: pytest.LogCaptureFixture) -> None:
    import verst.envs.sandbox.process as process

    process._warned = False
    with caplog.at_level("WARNING"), make_sandbox(_config("process")):
        pass
    assert "DOES NOT ISOLATE" in caplog.text


def test_bad_provider_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="provider"):
        SandboxConfig(provider="chroot")
    assert os.getuid() == 0 or SandboxConfig().run_as_uid == 65534


def test_pool_keeps_sandboxes_ready_and_reuses_none() -> None:
    import asyncio

    from verst.envs.sandbox.pool import SandboxPool

    pool = SandboxPool(_config("bubblewrap", pool_size=2))

    async def episodes() -> list[tuple[str, Path, str]]:
        seen = []
        for _ in range(3):
            async with pool.episode() as box:
                out = (await box.run("ls -A; echo made > mine")).stdout
                seen.append((box.id, box.workdir, out))
            await asyncio.sleep(0.3)  # the refill opens replacements meanwhile
        return seen

    seen = asyncio.run(episodes())
    assert len({box_id for box_id, _, _ in seen}) == 3  # a new sandbox every episode
    assert all(out == "" and not workdir.exists() for _, workdir, out in seen)
    assert len(pool.opened) >= 4  # the two kept ready and the replacements
    pool.close()
    leftovers = [p for i in pool.opened for p in Path(tempfile.gettempdir()).glob(f"*{i}*")]
    assert leftovers == []


def test_cli_runs_one_command(capsys: pytest.CaptureFixture[str]) -> None:
    from verst.cli import main

    _config("bubblewrap")
    assert main(["sandbox", "run", "--", "sh", "-c", "echo hi; echo oops >&2; exit 3"]) == 3
    out, err = capsys.readouterr()
    assert out == "hi\n" and err.startswith("oops\n") and "(bubblewrap" in err and "exit 3" in err
    assert main(["sandbox", "run", "--timeout", "0.5", "--", "sleep", "5"]) == 124
    assert "timed out" in capsys.readouterr().err
    assert main(["sandbox", "run", "--set", "max_processes=1", "--", "true"]) == 2
    assert "env.sandbox.max_processes" in capsys.readouterr().err
