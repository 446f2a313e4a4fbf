"""`free_port`: a port a server can bind, outside the range outgoing connections draw from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from verst.fleet import launcher


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    return True


@pytest.mark.skipif(not launcher.PORT_RANGE_FILE.exists(), reason="needs Linux's port range")
def test_ports_come_from_below_the_ephemeral_range() -> None:
    low = int(launcher.PORT_RANGE_FILE.read_text().split()[0])
    ports = {launcher.free_port() for _ in range(20)}
    assert all(launcher.LISTEN_PORTS_FROM <= p < low for p in ports)
    assert len(ports) > 1  # drawn at random: concurrent launchers rarely collide
    assert all(_binds(p) for p in ports)


def test_a_taken_port_is_never_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if not launcher.LISTEN_PORTS_FROM <= port:
            pytest.skip("the kernel gave a port below the range free_port draws from")
        # a range of two ports, one taken: 64 draws from it must all pick the other
        monkeypatch.setattr(launcher, "LISTEN_PORTS_FROM", port - 1)
        ranges = tmp_path / "ip_local_port_range"
        ranges.write_text(f"{port + 1}\t60999\n")
        monkeypatch.setattr(launcher, "PORT_RANGE_FILE", ranges)
        monkeypatch.setattr(launcher._PORT_DRAWS, "sample", lambda pool, k: [port, port - 1])
        assert launcher.free_port() == port - 1


def test_processes_seeded_alike_draw_different_ports() -> None:
    """Runs seed `random` (a trainer, every test worker): the draws must not follow it."""
    import random

    random.seed(0)
    first = [launcher.free_port() for _ in range(5)]
    random.seed(0)
    assert [launcher.free_port() for _ in range(5)] != first


def test_without_a_port_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "PORT_RANGE_FILE", Path("/nonexistent/ip_local_port_range"))
    assert _binds(launcher.free_port())
