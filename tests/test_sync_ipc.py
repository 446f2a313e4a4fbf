"""Colocated sync across processes on the CPU: a `verst serve` process receives the trainer's
weights as /dev/shm handles through `/update_weights_from_tensor` (`IpcBucketSender`), under the
full version protocol with the `colocated` transport."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from verst.sync import ipc, shared_tensors
from verst.sync.ipc import IpcBucketSender, SharedTensorError, plan_shared_buckets

aiohttp = pytest.importorskip("aiohttp")

from tests.servers import TINY, LoopThread, call, tiny_model  # noqa: E402
from verst.engine.serving import ServingEngine  # noqa: E402
from verst.fleet import HttpEngineClient, InProcessEngineClient, launch_local_engines  # noqa: E402
from verst.sync.colocated import ColocatedTransport  # noqa: E402
from verst.sync.protocol import WeightSync  # noqa: E402

BUCKET = 16 << 10  # the tiny model takes several buckets; its largest tensor fits one


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


# ---- payloads ---------------------------------------------------------------------------------


def _mixed() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(10, 20, generator=gen)),
        ("b", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.zeros(0, 4)),
        ("transposed", torch.randn(40, 30, generator=gen).t()),
        ("ints", torch.arange(12, dtype=torch.int64).reshape(3, 4)),
    ]


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_a_payload_crosses_into_an_unrelated_process_bit_exact(
    load_format: str | None, tmp_path: Path
) -> None:
    named = _mixed()
    sender = IpcBucketSender(bucket_bytes=1 << 20, load_format=load_format)
    (bucket,) = plan_shared_buckets(named, sender.bucket_bytes)
    (body,) = sender._stage(0, bucket, 1)
    assert body["load_format"] == load_format
    out = tmp_path / "got.pt"
    # A fresh interpreter, not a multiprocessing child: only the file_system strategy reaches it.
    script = (
        "import sys, torch; from verst.sync import shared_tensors\n"
        f"got = shared_tensors.named_tensors_from_payload(sys.stdin.read(), {load_format!r})\n"
        f"torch.save({{n: t.clone() for n, t in got}}, {str(out)!r})\n"
    )
    subprocess.run(
        [sys.executable, "-c", script],
        input=body["serialized_named_tensors"][0],
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    got = torch.load(out)
    assert list(got) == [n for n, _ in named]
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    sender.close()


def test_buckets_respect_the_bound_and_align() -> None:
    named = [(f"w{i}", torch.zeros(100 + 37 * i)) for i in range(40)] + [
        ("huge", torch.zeros(5000))
    ]
    buckets = list(plan_shared_buckets(named, 4096))
    assert [i.name for b in buckets for i in b] == [n for n, _ in named]
    for bucket in buckets:
        end = bucket[-1].start + bucket[-1].nbytes
        assert end <= 4096 or len(bucket) == 1  # a larger tensor travels alone
        assert all(item.start % ipc.ALIGN_BYTES == 0 for item in bucket)
    assert [i.name for i in buckets[-1]] == ["huge"]
    cast = next(iter(plan_shared_buckets([("w", torch.zeros(4))], 4096, torch.bfloat16)))
    assert cast[0].dtype == torch.bfloat16 and cast[0].nbytes == 8


def test_only_tensor_payloads_unpickle() -> None:
    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    with pytest.raises(SharedTensorError, match="refused to unpickle"):
        shared_tensors.loads(evil)
    # torch's default CPU strategy hands over a file descriptor: refused with the reason.
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("w", torch.ones(3))])
    with pytest.raises(SharedTensorError, match="file descriptor"):
        payload = base64.b64encode(buffer.getvalue()).decode()
        shared_tensors.named_tensors_from_payload(payload, None)
    with pytest.raises(SharedTensorError, match="load_format"):
        shared_tensors.named_tensors_from_payload(shared_tensors.dumps([]), "safetensors")


# ---- a verst serve process under the protocol -------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return tiny_model(root, "a", seed=0), tiny_model(root, "b", seed=5)


@pytest.fixture(scope="module")
def served(models: tuple[Path, Path]) -> Iterator[tuple[LoopThread, str]]:
    (engine,) = launch_local_engines(models[0], 1, timeout_s=90)
    loop = LoopThread()
    try:
        yield loop, engine.url
    finally:
        loop.close()
        engine.stop()


async def _engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        body = {"name": name, "truncate_size": 1 << 20}
        status, values = await call(url, "/get_weights_by_name", body)
        assert status == 200, values
        out[name] = torch.tensor(values, dtype=torch.float32)
    return out


GREEDY = {
    "input_ids": [5, 6, 7, 8],
    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    "return_logprob": True,
}


@pytest.mark.parametrize("whole_updates", [True, False], ids=["one_request", "stepwise"])
def test_serve_process_receives_weights_through_shared_memory(
    whole_updates: bool, models: tuple[Path, Path], served: tuple[LoopThread, str]
) -> None:
    """Both ways to a `verst serve` engine: verst's whole-update request (a request per bucket
    here: more buckets than staging buffers) and SGLang's calls, a step each."""
    loop, url = served
    model_b = models[1]
    trainer = _weights(model_b)

    async def reference() -> dict:
        client = await InProcessEngineClient.from_model_dir(str(model_b), seed=0)
        try:
            return await client.generate(GREEDY)
        finally:
            await client.close()

    async def scenario() -> None:
        client = HttpEngineClient(url)
        transport = ColocatedTransport(bucket_bytes=BUCKET, whole_updates=whole_updates)
        sync = WeightSync([client], transport, pause_mode="retract")
        sender = transport.ipc  # an engine process gets handles
        before = await client.generate(GREEDY)
        report = await sync.push(lambda: trainer.items(), version=1)
        stepwise = ["pause", "flush", "send", "set_version", "continue"]
        assert report.calls == (["update"] if whole_updates else stepwise)
        assert await client.get_weight_version() == "1"
        assert len(sender.buckets_sent) > 1
        assert all(size <= BUCKET for size in sender.buckets_sent)
        got = await _engine_weights(url, list(trainer))
        for name, tensor in trainer.items():
            assert torch.equal(got[name], tensor), name  # fp32 round-trips JSON exactly
        after = await client.generate(GREEDY)
        expected = await reference()
        assert after["output_ids"] == expected["output_ids"]
        logprobs = [m["meta_info"]["output_token_logprobs"] for m in (before, after, expected)]
        assert logprobs[1] == logprobs[2] != logprobs[0]  # the new weights, exactly
        assert after["meta_info"]["weight_version"] == "1"

        # A second update goes through the same shared buffers (nothing new in /dev/shm).
        buffers = [b.untyped_storage().data_ptr() for b in sender._buffers if b is not None]
        doubled = {n: t * 2 for n, t in trainer.items()}
        await sync.push(lambda: doubled.items(), version=2)
        assert [b.untyped_storage().data_ptr() for b in sender._buffers if b is not None] == (
            buffers
        )
        got = await _engine_weights(url, list(doubled))
        assert all(torch.equal(got[n], t) for n, t in doubled.items())
        assert await client.get_weight_version() == "2"
        start = _weights(models[0])
        await sync.push(lambda: start.items(), version=3)  # back, for the tests after this
        transport.close()
        await client.close()

    loop.run(scenario())


def test_an_engine_that_cannot_open_the_memory_refuses_clearly(
    served: tuple[LoopThread, str],
) -> None:
    """As an engine on another host would: the shared-memory name does not exist there."""
    loop, url = served
    named = [("model.norm.weight", torch.full((TINY.hidden_size,), 7.0))]
    sender = IpcBucketSender(load_format=None)
    (bucket,) = plan_shared_buckets(named, sender.bucket_bytes)
    (body,) = sender._stage(0, bucket, 1)
    raw = base64.b64decode(body["serialized_named_tensors"][0])
    name = next(n for n in os.listdir("/dev/shm") if n.encode() in raw)
    forged = raw.replace(name.encode(), b"x" * len(name))
    body["serialized_named_tensors"] = [base64.b64encode(forged).decode()]

    async def scenario() -> None:
        client = HttpEngineClient(url)
        version = await client.get_weight_version()
        with pytest.raises(SharedTensorError, match="same host|one host") as info:
            await sender._post([client], [body])
        assert "engine 0 refused" in str(info.value) and "(400)" in str(info.value)
        assert await client.get_weight_version() == version
        (norm,) = (await _engine_weights(url, ["model.norm.weight"])).values()
        assert not torch.equal(norm, named[0][1])
        status, reply = await call(url, "/update_weights_from_tensor", {"load_format": None})
        assert status == 400 and "serialized_named_tensors" in reply["message"]
        await client.close()

    loop.run(scenario())
    sender.close()


def test_an_in_process_engine_takes_the_same_payload(models: tuple[Path, Path]) -> None:
    """The handles reach an engine in this process too (`ColocatedTransport` copies instead)."""
    trainer = _weights(models[1])

    async def scenario() -> None:
        serving = ServingEngine.from_model_dir(str(models[0]), kv_cache_bytes=8 << 20)
        await serving.start()
        client = InProcessEngineClient(serving, owns_serving=True)
        sender = IpcBucketSender(bucket_bytes=BUCKET, load_format=None, whole_updates=False)
        await WeightSync([client], sender).push(lambda: trainer.items(), version=4)
        params = dict(serving.scheduler.model.named_parameters(remove_duplicate=False))
        assert all(torch.equal(params[n].detach(), t) for n, t in trainer.items())
        assert await client.get_weight_version() == "4"
        with pytest.raises(SharedTensorError, match="unknown parameter name"):
            await sender.send([client], lambda: [("no.such", torch.zeros(2))], 5)
        sender.close()
        await client.close()

    asyncio.run(scenario())


def test_fsdp_shards_are_gathered_bucket_by_bucket(tmp_path: Path) -> None:
    """DTensor parameters (FSDP2's) are sent as full tensors, gathered one at a time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    own_group = not dist.is_initialized()  # an earlier test's run may have made the default one
    if own_group:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        gen = torch.Generator().manual_seed(3)
        full = {"w": torch.randn(64, 8, generator=gen), "b": torch.randn(8, generator=gen)}
        sharded = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
        sender = IpcBucketSender(bucket_bytes=1 << 20)
        (bucket,) = plan_shared_buckets(sharded.items(), sender.bucket_bytes)
        (body,) = sender._stage(0, bucket, 1)
        got = shared_tensors.named_tensors_from_payload(
            body["serialized_named_tensors"][0], body["load_format"]
        )
        assert [n for n, _ in got] == list(full)
        assert all(torch.equal(t, full[n]) for n, t in got)
        sender.close()
    finally:
        if own_group:
            dist.destroy_process_group()
