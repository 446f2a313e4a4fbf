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


def test_whole_update_over_nccl_into_an_engine_on_the_other_gpu(tmp_path) -> None:
    """verst's one-request update: headers and buckets through NCCL into a serving engine on
    cuda:1, bit-exact, version stamped, and the engine generates afterwards."""
    import asyncio

    from verst.engine.serving import ServingEngine
    from verst.fleet.client import InProcessEngineClient
    from verst.models.tiny import TinyModelConfig, build_tiny_model, create_tiny
    from verst.sync.broadcast import BroadcastTransport
    from verst.sync.protocol import WeightSync

    tiny = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    create_tiny(tmp_path / "m", tiny, seed=0)
    source = build_tiny_model(tiny, vocab_size=100, seed=3).to("cuda:0", torch.bfloat16)
    weights = {n: p.detach() for n, p in source.named_parameters()}

    async def scenario() -> None:
        serving = ServingEngine.from_model_dir(
            str(tmp_path / "m"), device="cuda:1", dtype=torch.bfloat16, kv_cache_bytes=64 << 20
        )
        await serving.start()
        client = InProcessEngineClient(serving, owns_serving=True)
        transport = BroadcastTransport(
            master_port=free_port(), bucket_bytes=100_000, backend="nccl"
        )
        sync = WeightSync([client], transport)
        for version in (1, 2):
            report = await sync.push(lambda: weights.items(), version=version)
            assert report.calls == ["update"]
        assert len(transport.buckets_sent) > 1
        params = dict(serving.scheduler.model.named_parameters())
        for name, tensor in weights.items():
            assert torch.equal(params[name].detach().cpu(), tensor.cpu()), name
        assert await client.get_weight_version() == "2"
        reply = await client.generate(
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        )
        assert len(reply["output_ids"]) == 4
        await client.close()

    torch.cuda.set_device(0)
    asyncio.run(scenario())
