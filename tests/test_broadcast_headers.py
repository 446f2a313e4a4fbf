"""A whole broadcast update's headers and tagged buckets over a real gloo group: specs, the last
flag, the tag, the abort, JSON longer than one header broadcast, and a bucket whose bytes are
not the bucket's; and the trainer's side sending nothing more once a collective failed."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from verst.sync.broadcast import (
    HEADER_BYTES,
    BroadcastTransport,
    BucketOutOfStep,
    FlatBuffer,
    Header,
    TensorSpec,
    TrainerAborted,
    create_group,
    receive_bucket,
    receive_header,
    send_bucket,
    send_header,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CPU = torch.device("cpu")


def group_of(port: int, rank: int) -> Any:
    return create_group(master_address="127.0.0.1", master_port=port, rank=rank, world_size=2)


def engine_side(port: int, receives: list[Callable[[Any], object]]) -> Callable[[], list]:
    """Rank 1 on a thread of its own runs each of `receives` on the group in turn; the call
    returned waits for it and gives what each returned, or the exception it raised."""
    got: list[object] = []

    def engine() -> None:
        group = group_of(port, 1)
        for receive in receives:
            try:
                got.append(receive(group))
            except (TrainerAborted, BucketOutOfStep) as error:
                got.append(error)

    thread = threading.Thread(target=engine)
    thread.start()

    def results() -> list:
        thread.join(timeout=60)
        return got

    return results


def header(group: Any) -> object:
    return receive_header(group, CPU)


def exchange(sends: list[dict], receives: int) -> list[object]:
    """Rank 0 sends each header of `sends` (send_header's arguments); rank 1 receives
    `receives` of them: what it got, or the exception it raised."""
    port = free_port()
    results = engine_side(port, [header] * receives)
    group = group_of(port, 0)
    for kwargs in sends:
        send_header(group, device=CPU, **kwargs)
    return results()


def test_headers_carry_specs_the_last_flag_and_the_tag() -> None:
    specs = [TensorSpec("a.weight", "bfloat16", (4, 8)), TensorSpec("b", "float32", ())]
    sends = [{"specs": specs, "tag": 7}, {"specs": specs[:1], "last": True}, {"specs": []}]
    got = exchange(sends, 3)
    assert got == [Header(specs, False, 7), Header(specs[:1], True, 0), Header([], False, 0)]


def test_a_header_longer_than_one_broadcast_arrives_whole() -> None:
    specs = [TensorSpec(f"model.layers.{i}.mlp.weight", "bfloat16", (i, 7)) for i in range(3000)]
    (got,) = exchange([{"specs": specs, "last": True}], 1)
    assert got == Header(specs, True, 0)
    assert len(str([s.name for s in specs])) > HEADER_BYTES  # it did need the second one


def test_an_aborted_header_raises_on_the_engine() -> None:
    (got,) = exchange([{"specs": [], "aborted": True}], 1)
    assert isinstance(got, TrainerAborted)
    with pytest.raises(TrainerAborted, match="trainer's side"):
        raise got


def test_a_tagged_bucket_arrives_and_a_short_message_in_its_place_is_refused() -> None:
    """gloo takes a shorter message into a larger buffer without a word: an engine that got a
    bucket's header and then another header (an abort sent to a group out of step) in the
    bucket's place must not install those bytes, whatever its reused buffer held before."""
    port, into = free_port(), FlatBuffer()
    weight = torch.arange(40_000, dtype=torch.float32)  # 160 kB: longer than a header
    specs = [TensorSpec.of("w", weight)]

    def bucket(group: Any) -> torch.Tensor:
        specs, _, tag = receive_header(group, CPU)
        received = receive_bucket(group, specs, CPU, flattened=True, into=into, tag=tag)
        return received[0][1].clone()

    results = engine_side(port, [bucket, bucket])
    group = group_of(port, 0)
    send_header(group, specs, CPU, tag=11)
    send_bucket(group, [weight], flattened=True, staging=FlatBuffer(), tag=11)
    send_header(group, specs, CPU, tag=12)
    send_header(group, [], CPU, aborted=True)  # in the bucket's place
    got = results()
    assert torch.equal(got[0], weight)
    assert isinstance(got[1], BucketOutOfStep)


def test_a_bucket_in_a_headers_place_is_refused() -> None:
    port = free_port()
    results = engine_side(port, [header])
    send_bucket(group_of(port, 0), [torch.ones(64)], flattened=True)  # where a header belongs
    (got,) = results()
    assert isinstance(got, BucketOutOfStep) and "magic number" in str(got)


class BrokenGroup:
    """A gloo group whose every collective fails (a member died): counts what was sent."""

    def __init__(self) -> None:
        self.broadcasts = 0

    def name(self) -> str:
        return "gloo"

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self.broadcasts += 1
        raise RuntimeError("Connection reset by peer")


def test_the_trainer_sends_nothing_more_once_a_collective_failed() -> None:
    transport = BroadcastTransport(master_port=free_port())
    transport.group = broken = BrokenGroup()
    with pytest.raises(RuntimeError, match="reset by peer"):
        transport._send_whole(lambda: iter([("w", torch.ones(4))]))
    assert broken.broadcasts == 1  # the failed header, and no abort behind it


def test_a_failed_walk_is_announced_with_an_abort() -> None:
    def tensors():
        yield "a", torch.ones(4)
        raise ValueError("gather failed")

    port = free_port()
    results = engine_side(port, [header])
    transport = BroadcastTransport(master_port=port, bucket_bytes=1)  # a bucket a tensor
    transport.group = group_of(port, 0)
    with pytest.raises(ValueError, match="gather failed"):
        transport._send_whole(tensors)
    # the walk failed before the first header: the engine got the abort
    (got,) = results()
    assert isinstance(got, TrainerAborted)


def test_each_group_stages_in_a_buffer_of_its_own() -> None:
    """A send left behind on a dropped group (its thread still in a collective) must not write
    into the buffer the next group's update broadcasts from."""
    transport = BroadcastTransport(master_port=free_port())
    asyncio.run(transport.connect([]))
    first = transport.staging
    asyncio.run(transport.connect([]))
    assert transport.staging is not first
