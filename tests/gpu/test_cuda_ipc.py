"""Colocated sync on a GPU: CUDA IPC handles (`IpcBucketSender`, the `colocated` transport's way
to engine processes) into a `verst serve` process on the trainer's GPU (and into an engine in the
trainer's own process), bit-exact, under the protocol: SGLang's calls, and verst's one request
with each buffer's layout sent once (`verst.sync.buffer_layouts`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("aiohttp")

from tests.servers import call, tiny_model  # noqa: E402
from verst.engine.serving import ServingEngine  # noqa: E402
from verst.fleet import HttpEngineClient, InProcessEngineClient, launch_local_engines  # noqa: E402
from verst.sync.colocated import ColocatedTransport  # noqa: E402
from verst.sync.ipc import IpcBucketSender, SharedTensorError  # noqa: E402
from verst.sync.protocol import WeightSync  # noqa: E402

BUCKET = 16 << 10
GREEDY = {
    "input_ids": [5, 6, 7, 8],
    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    "return_logprob": True,
}


async def _engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        status, values = await call(
            url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20}
        )
        assert status == 200, values
        out[name] = torch.tensor(values, dtype=torch.float32)
    return out


def _logprobs(result: dict) -> torch.Tensor:
    return torch.tensor([t[0] for t in result["meta_info"]["output_token_logprobs"]])


def test_cuda_ipc_into_a_serve_process_on_the_same_gpu(tmp_path: Path) -> None:
    model_a, model_b = tiny_model(tmp_path, "a", seed=0), tiny_model(tmp_path, "b", seed=5)
    trainer = {n: t.cuda() for n, t in load_file(str(model_b / "model.safetensors")).items()}
    (engine,) = launch_local_engines(
        model_a, 1, extra_args=["--device", "cuda", "--dtype", "float32"], timeout_s=180
    )

    async def reference() -> dict:
        client = await InProcessEngineClient.from_model_dir(
            str(model_b), seed=0, device="cuda", kv_cache_bytes=64 << 20
        )
        try:
            return await client.generate(GREEDY)
        finally:
            await client.close()

    async def scenario() -> None:
        client = HttpEngineClient(engine.url)
        before = await client.generate(GREEDY)
        for version, load_format in ((1, "flattened_bucket"), (2, None)):  # SGLang's calls
            weights = {n: t * version for n, t in trainer.items()}
            sender = IpcBucketSender(
                bucket_bytes=BUCKET, load_format=load_format, whole_updates=False
            )
            report = await WeightSync([client], sender).push(
                lambda w=weights: w.items(), version=version
            )
            assert report.calls == ["pause", "flush", "send", "set_version", "continue"]
            assert await client.get_weight_version() == str(version)
            assert len(sender.buckets_sent) > 1
            assert all(size <= BUCKET for size in sender.buckets_sent)
            got = await _engine_weights(engine.url, list(weights))
            for name, tensor in weights.items():
                assert torch.equal(got[name], tensor.cpu()), (load_format, name)
            sender.close()
        # Back to the trainer's weights: outputs are those of model b.
        transport = ColocatedTransport(bucket_bytes=BUCKET)  # what sync.transport=colocated runs
        await WeightSync([client], transport).push(lambda: trainer.items(), version=3)
        after, expected = await client.generate(GREEDY), await reference()
        assert after["output_ids"] == expected["output_ids"]
        assert torch.allclose(_logprobs(after), _logprobs(expected), atol=1e-4)
        assert not torch.allclose(_logprobs(after), _logprobs(before), atol=1e-3)
        transport.close()
        await client.close()

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_cuda_ipc_into_an_engine_in_this_process(tmp_path: Path) -> None:
    """A process cannot open its own IPC handle: the engine finds the storage it shared."""
    model_a, model_b = tiny_model(tmp_path, "a", seed=0), tiny_model(tmp_path, "b", seed=5)
    trainer = {n: t.cuda() for n, t in load_file(str(model_b / "model.safetensors")).items()}

    async def scenario() -> None:
        gpu = ServingEngine.from_model_dir(str(model_a), device="cuda", kv_cache_bytes=64 << 20)
        cpu = ServingEngine.from_model_dir(str(model_a), kv_cache_bytes=8 << 20)
        for serving in (gpu, cpu):
            await serving.start()
        on_gpu, on_cpu = InProcessEngineClient(gpu, owns_serving=True), InProcessEngineClient(cpu)
        for load_format in ("flattened_bucket", None):
            sender = IpcBucketSender(
                bucket_bytes=BUCKET, load_format=load_format, whole_updates=False
            )
            await WeightSync([on_gpu], sender).push(lambda: trainer.items(), version=1)
            params = dict(gpu.scheduler.model.named_parameters(remove_duplicate=False))
            assert all(torch.equal(params[n].detach(), t) for n, t in trainer.items())
            # An engine off the trainer's GPU is refused, by name, before anything is copied.
            with pytest.raises(SharedTensorError, match="engine on the trainer's GPU"):
                await sender.send([on_cpu], lambda: trainer.items(), 2)
            sender.close()
        # verst's one request: the layout opened once, later pushes name it.
        sender = IpcBucketSender(bucket_bytes=1 << 20)
        for version in (3, 4):
            weights = {n: t * version for n, t in trainer.items()}
            report = await WeightSync([on_gpu], sender).push(lambda w=weights: w.items(), version)
            assert report.calls == ["update"] and gpu.weight_version == str(version)
            params = gpu.scheduler.parameters()
            assert all(torch.equal(params[n].detach(), t) for n, t in weights.items())
        with pytest.raises(SharedTensorError, match="engine on the trainer's GPU"):
            await WeightSync([on_cpu], sender).push(lambda: trainer.items(), 5)
        assert cpu.weight_version == "0" and not cpu.is_paused
        sender.close()
        await on_gpu.close()
        await cpu.stop()

    asyncio.run(scenario())


class _Logged:
    """A real client whose whole-update request bodies are kept."""

    def __init__(self, inner: object) -> None:
        self.inner, self.bodies = inner, []

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)

        async def logged(*args, **kwargs):
            if name == "update_weights_from_buffers":
                self.bodies.append(args[0])
            return await attr(*args, **kwargs)

        return logged


def _payloads(bodies: list[dict]) -> list[bool]:
    return ["payload" in b for body in bodies for b in body["buffers"]]


def test_one_request_updates_into_a_serve_process(tmp_path: Path) -> None:
    """verst's whole update over CUDA IPC: one request a push when the buckets fit the buffers
    (the layouts sent with the first alone), a request per bucket past them; bit-exact."""
    model_a, model_b = tiny_model(tmp_path, "a", seed=0), tiny_model(tmp_path, "b", seed=5)
    trainer = {n: t.cuda() for n, t in load_file(str(model_b / "model.safetensors")).items()}
    (engine,) = launch_local_engines(
        model_a, 1, extra_args=["--device", "cuda", "--dtype", "float32"], timeout_s=180
    )

    async def scenario() -> None:
        client = _Logged(HttpEngineClient(engine.url))
        for bucket_bytes, versions in ((1 << 20, range(1, 5)), (BUCKET, range(5, 8))):
            transport = ColocatedTransport(bucket_bytes=bucket_bytes)
            sync = WeightSync([client], transport)
            for version in versions:
                client.bodies.clear()
                weights = {n: t * version for n, t in trainer.items()}
                report = await sync.push(lambda w=weights: w.items(), version=version)
                assert report.calls == ["update"]
                buckets = len(transport.ipc.buckets_sent)
                assert len(client.bodies) == (1 if buckets <= 2 else buckets)
                assert client.bodies[-1]["weight_version"] == str(version)
                if version in (1, 5):
                    assert all(_payloads(client.bodies))
                elif version not in (2, 6):  # the buffers may grow during the first push
                    assert not any(_payloads(client.bodies))
                got = await _engine_weights(engine.url, list(weights))
                for name, tensor in weights.items():
                    assert torch.equal(got[name], tensor.cpu()), (version, name)
                assert await client.get_weight_version() == str(version)
            transport.close()
        await client.inner.close()

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_in_flight_requests_see_one_version_per_token_on_cuda(tmp_path: Path) -> None:
    """`tests/test_sync_whole_update.py`'s check on the GPU, where decode steps overlap (a
    pending step is read before the weights change)."""
    from tests.test_sync_whole_update import versions_per_token_hold

    models = (tiny_model(tmp_path, "a", seed=0), tiny_model(tmp_path, "b", seed=5))
    asyncio.run(versions_per_token_hold(models, "cuda"))
