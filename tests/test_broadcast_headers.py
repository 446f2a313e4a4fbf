"""A whole broadcast update's headers over a real gloo group: specs, the last flag, the abort,
and JSON longer than one header broadcast."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from verst.sync.broadcast import (
    HEADER_BYTES,
    TensorSpec,
    TrainerAborted,
    create_group,
    receive_header,
    send_header,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def exchange(sends: list[dict], receives: int) -> list[object]:
    """Rank 0 sends each header of `sends` (send_header's arguments); rank 1 receives
    `receives` of them: what it got, or the exception it raised."""
    port, got = free_port(), []
    cpu = torch.device("cpu")

    def engine() -> None:
        group = create_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2)
        for _ in range(receives):
            try:
                got.append(receive_header(group, cpu))
            except TrainerAborted as error:
                got.append(error)

    thread = threading.Thread(target=engine)
    thread.start()
    group = create_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2)
    for kwargs in sends:
        send_header(group, device=cpu, **kwargs)
    thread.join(timeout=60)
    return got


def test_headers_carry_specs_and_the_last_flag() -> None:
    specs = [TensorSpec("a.weight", "bfloat16", (4, 8)), TensorSpec("b", "float32", ())]
    got = exchange([{"specs": specs}, {"specs": specs[:1], "last": True}, {"specs": []}], 3)
    assert got == [(specs, False), (specs[:1], True), ([], False)]


def test_a_header_longer_than_one_broadcast_arrives_whole() -> None:
    specs = [TensorSpec(f"model.layers.{i}.mlp.weight", "bfloat16", (i, 7)) for i in range(3000)]
    (got,) = exchange([{"specs": specs, "last": True}], 1)
    assert got == (specs, True)
    assert len(str([s.name for s in specs])) > HEADER_BYTES  # it did need the second one


def test_an_aborted_header_raises_on_the_engine() -> None:
    (got,) = exchange([{"specs": [], "aborted": True}], 1)
    assert isinstance(got, TrainerAborted)
    with pytest.raises(TrainerAborted, match="trainer's side"):
        raise got
