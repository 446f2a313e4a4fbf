"""The broadcast transport over NCCL between two GPUs (trainer on cuda:0, engine on cuda:1)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from verst.sync.broadcast import TensorSpec, create_group, receive_bucket, send_bucket
from verst.sync.buckets import bucketed

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_nccl_buckets_arrive_bit_exact_and_fast() -> None:
    port = free_port()
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    weights = {
        f"w{i}": torch.randn((64 << 20) // 2, generator=gen, device="cuda:0", dtype=torch.bfloat16)
        for i in range(16)
    }  # 1 GiB
    buckets = [[TensorSpec.of(n, t) for n, t in b] for b in bucketed(weights.items(), 512 << 20)]
    received: dict[str, torch.Tensor] = {}
    seconds: list[float] = []

    def engine() -> None:
        torch.cuda.set_device(1)
        group = create_group(
            master_address="127.0.0.1", master_port=port, rank=1, world_size=2, backend="nccl"
        )
        for _ in range(2):  # the first round warms NCCL up
            received.clear()
            for bucket in buckets:
                received.update(
                    receive_bucket(group, bucket, torch.device("cuda:1"), flattened=True)
                )
            torch.cuda.synchronize(1)

    thread = threading.Thread(target=engine)
    thread.start()
    torch.cuda.set_device(0)
    group = create_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, backend="nccl"
    )
    for _ in range(2):
        torch.cuda.synchronize(0)
        start = time.perf_counter()
        for bucket in buckets:
            send_bucket(group, [weights[s.name] for s in bucket], flattened=True)
        torch.cuda.synchronize(0)
        seconds.append(time.perf_counter() - start)
    thread.join()
    for name, tensor in weights.items():
        assert torch.equal(received[name].cpu(), tensor.cpu()), name
    gb = sum(s.nbytes for bucket in buckets for s in bucket) / 1e9
    print(
        f"NCCL broadcast of {gb:.2f} GB in {seconds[-1] * 1e3:.1f} ms: {gb / seconds[-1]:.1f} GB/s"
    )
