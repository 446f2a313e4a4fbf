"""The weight-update protocol over real in-process engines: order, exactness, versions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from verst.engine.serving import ServingEngine
from verst.fleet.client import InProcessEngineClient
from verst.models.tiny import TinyModelConfig, build_tiny_model, create_tiny
from verst.sync.colocated import ColocatedTransport
from verst.sync.protocol import WeightSync, WeightSyncError

TINY = TinyModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    create_tiny(path, TINY, seed=0)
    return path


def trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    return build_tiny_model(TINY, vocab_size=100, seed=seed).state_dict()


async def engines(model_dir: Path, n: int) -> list[InProcessEngineClient]:
    clients = []
    for _ in range(n):
        serving = ServingEngine.from_model_dir(str(model_dir), kv_cache_bytes=8 << 20)
        await serving.start()
        clients.append(InProcessEngineClient(serving, owns_serving=True))
    return clients


def assert_engine_has(client: InProcessEngineClient, weights: dict[str, torch.Tensor]) -> None:
    params = dict(client.serving.scheduler.model.named_parameters(remove_duplicate=False))
    for name, tensor in weights.items():
        assert torch.equal(params[name].detach(), tensor), name


class Recording:
    """A real client whose calls are logged (and whose first version stamp can be lost)."""

    def __init__(self, inner: InProcessEngineClient, log: list[str], *, lose_first=False):
        self.inner, self.log, self.lose = inner, log, lose_first

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)

        async def call(*args, **kwargs):
            self.log.append(name)
            if name == "update_weight_version" and self.lose:
                self.lose = False
                return None
            return await attr(*args, **kwargs)

        return call


def test_push_follows_the_protocol_and_is_exact(model_dir: Path) -> None:
    async def scenario() -> None:
        clients = await engines(model_dir, 2)
        log: list[str] = []
        sync = WeightSync([Recording(clients[0], log), clients[1]], ColocatedTransport())
        weights = trainer_weights(seed=5)
        report = await sync.push(lambda: weights.items(), version=1)
        assert report.calls == ["pause", "flush", "send", "set_version", "continue"]
        assert log == [
            "pause_generation",
            "flush_cache",
            "update_weights_from_tensors",
            "update_weight_version",
            "continue_generation",
            "get_weight_version",
        ]
        for client in clients:
            assert_engine_has(client, weights)
            assert await client.get_weight_version() == "1"
            await client.close()

    asyncio.run(scenario())


def test_in_place_keeps_requests_running_across_the_update(model_dir: Path) -> None:
    async def scenario() -> dict:
        (client,) = await engines(model_dir, 1)
        sync = WeightSync([client], ColocatedTransport(), pause_mode="in_place")
        request = asyncio.ensure_future(
            client.generate(
                {
                    "input_ids": [5, 6, 7],
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                }
            )
        )
        serving = client.serving
        while serving.num_batches < 5:
            await asyncio.sleep(0.001)
        report = await sync.push(lambda: trainer_weights(seed=6).items(), version=7)
        assert "flush" not in report.calls
        result = await request
        await client.close()
        return result

    result = asyncio.run(scenario())
    spans = result["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "7"]
    assert spans[-1]["end"] == 200 and result["meta_info"]["weight_version"] == "7"


def test_an_engine_that_missed_the_version_is_sent_again(model_dir: Path) -> None:
    async def scenario() -> None:
        clients = await engines(model_dir, 2)
        log: list[str] = []
        flaky = Recording(clients[1], log, lose_first=True)
        sync = WeightSync([clients[0], flaky], ColocatedTransport())
        report = await sync.push(lambda: trainer_weights(seed=8).items(), version=2)
        assert report.resent == [1]
        assert await clients[1].get_weight_version() == "2"
        hopeless = Recording(clients[0], [], lose_first=True)
        hopeless.lose = True
        never = WeightSync([hopeless], ColocatedTransport(), max_resends=0)
        with pytest.raises(WeightSyncError, match="report versions"):
            await never.push(lambda: trainer_weights(seed=8).items(), version=3)
        for client in clients:
            await client.close()

    asyncio.run(scenario())


def test_colocated_sends_nothing_to_an_engine_that_shares_the_trainers_storage(
    model_dir: Path,
) -> None:
    async def scenario() -> None:
        shared, copied = await engines(model_dir, 2)
        log: list[str] = []
        recorded = Recording(shared, log)
        sync = WeightSync([recorded, copied], ColocatedTransport(shared=[recorded]))
        weights = trainer_weights(seed=4)
        await sync.push(lambda: weights.items(), version=1)
        assert "flush_cache" in log and "update_weights_from_tensors" not in log
        assert_engine_has(copied, weights)
        assert await shared.get_weight_version() == "1"
        for client in (shared, copied):
            await client.close()

    asyncio.run(scenario())


def test_a_joining_engine_gets_a_full_push(model_dir: Path) -> None:
    async def scenario() -> None:
        first, late = await engines(model_dir, 2)
        sync = WeightSync([first], ColocatedTransport())
        weights = trainer_weights(seed=9)
        await sync.push(lambda: weights.items(), version=4)
        await sync.add_engine(late, lambda: weights.items(), version=4)
        assert_engine_has(late, weights)
        assert await late.get_weight_version() == "4" and len(sync.engines) == 2
        await first.close()
        await late.close()

    asyncio.run(scenario())


def test_disk_transport_full_then_deltas_stays_exact(model_dir: Path, tmp_path: Path) -> None:
    from verst.sync.disk import DiskPublisher, DiskTransport

    source = build_tiny_model(TINY, vocab_size=100, seed=11)

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in source.named_parameters()}

    async def scenario() -> None:
        clients = await engines(model_dir, 2)
        sync = WeightSync(clients, DiskTransport(DiskPublisher(tmp_path / "pub", mode="xor")))
        for version in (1, 2, 3):
            with torch.no_grad():  # a training step touches some tensors
                for i, p in enumerate(source.parameters()):
                    if i % 3 == version % 3:
                        p.add_(0.01 * version)
            snapshot = weights()
            await sync.push(lambda snapshot=snapshot: snapshot.items(), version=version)
            for client in clients:
                assert_engine_has(client, snapshot)
                assert await client.get_weight_version() == str(version)
        # an engine that missed a delta cannot apply the next one: it reloads in full
        late = (await engines(model_dir, 1))[0]
        snapshot = weights()
        await sync.add_engine(late, lambda: snapshot.items(), version=4)
        assert_engine_has(late, snapshot)
        for client in [*clients, late]:
            await client.close()

    asyncio.run(scenario())


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("whole", [True, False], ids=["one-request", "sglang-calls"])
def test_broadcast_transport_in_buckets_is_exact(model_dir: Path, whole: bool) -> None:
    from verst.sync.broadcast import BroadcastTransport, TensorSpec
    from verst.sync.buckets import bucketed

    source = build_tiny_model(TINY, vocab_size=100, seed=12)
    weights = {n: p.detach() for n, p in source.named_parameters()}
    bucket_bytes = 40_000  # several buckets for this model

    async def scenario() -> list[int]:
        clients = await engines(model_dir, 2)
        transport = BroadcastTransport(
            master_port=free_port(), bucket_bytes=bucket_bytes, whole_updates=whole
        )
        await transport.connect(clients)
        sync = WeightSync(clients, transport)
        report = await sync.push(lambda: weights.items(), version=5)
        steps = ["pause", "flush", "send", "set_version", "continue"]
        assert report.calls == (["update"] if whole else steps)
        for client in clients:
            assert_engine_has(client, weights)
            assert await client.get_weight_version() == "5"
            await client.close()
        return transport.buckets_sent

    buckets = asyncio.run(scenario())
    specs = [TensorSpec.of(n, t) for n, t in weights.items()]
    largest = max(s.nbytes for s in specs)
    assert len(buckets) == len(list(bucketed(weights.items(), bucket_bytes))) > 1
    assert all(size <= max(bucket_bytes, largest) for size in buckets)
    assert sum(buckets) == sum(s.nbytes for s in specs)


def test_broadcast_over_http(model_dir: Path) -> None:
    from aiohttp import web

    from verst.engine.server.app import make_app
    from verst.fleet.client import HttpEngineClient
    from verst.sync.broadcast import BroadcastTransport

    source = build_tiny_model(TINY, vocab_size=100, seed=13)
    weights = {n: p.detach() for n, p in source.named_parameters()}

    async def scenario() -> None:
        serving = ServingEngine.from_model_dir(str(model_dir), kv_cache_bytes=8 << 20)
        runner = web.AppRunner(make_app(serving, serving.tokenizer, served_model_name="t"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        client = HttpEngineClient(f"http://127.0.0.1:{runner.addresses[0][1]}")
        transport = BroadcastTransport(master_port=free_port(), bucket_bytes=1 << 20)
        await transport.connect([client])
        report = await WeightSync([client], transport).push(lambda: weights.items(), version=9)
        assert report.calls == ["update"]  # verst's own route, one request
        params = dict(serving.scheduler.model.named_parameters())
        assert all(torch.equal(params[n].detach(), t) for n, t in weights.items())
        assert await client.get_weight_version() == "9"
        await client.close()
        await runner.cleanup()

    asyncio.run(scenario())


def test_broadcast_whole_update_that_the_trainer_abandons(model_dir: Path) -> None:
    """Walking the tensors fails after a bucket: the engine is told, answers the failure
    without stamping the version, and the next push forms a new group and lands."""
    from verst.fleet.client import EngineError
    from verst.sync.broadcast import BroadcastTransport

    source = build_tiny_model(TINY, vocab_size=100, seed=14)
    weights = {n: p.detach() for n, p in source.named_parameters()}

    def failing():
        for index, item in enumerate(weights.items()):
            if index == 3:
                raise RuntimeError("gather failed")
            yield item

    async def scenario() -> None:
        (client,) = await engines(model_dir, 1)
        transport = BroadcastTransport(master_port=free_port(), bucket_bytes=20_000)
        sync = WeightSync([client], transport)
        with pytest.raises((EngineError, WeightSyncError), match="trainer's side"):
            await sync.push(failing, version=2)
        assert transport.group is None
        assert await client.get_weight_version() != "2"
        report = await sync.push(lambda: weights.items(), version=3)
        assert report.calls == ["update"] and transport.connects == 2
        assert_engine_has(client, weights)
        assert await client.get_weight_version() == "3"
        await client.close()

    asyncio.run(scenario())


def test_broadcast_whole_update_with_an_unknown_name_is_refused(model_dir: Path) -> None:
    """A bucket the engine cannot install is still received (the trainer never hangs); the
    engine answers which name, keeps its version and stays paused."""
    from verst.fleet.client import EngineError
    from verst.sync.broadcast import BroadcastTransport

    source = build_tiny_model(TINY, vocab_size=100, seed=15)
    weights = {n: p.detach() for n, p in source.named_parameters()}
    weights["model.bogus.weight"] = torch.ones(3)

    async def scenario() -> None:
        (client,) = await engines(model_dir, 1)
        transport = BroadcastTransport(master_port=free_port(), bucket_bytes=1 << 20)
        with pytest.raises(EngineError, match="model.bogus.weight"):
            await WeightSync([client], transport).push(lambda: weights.items(), version=4)
        assert await client.get_weight_version() != "4"
        assert client.serving.is_paused
        await client.close()

    asyncio.run(scenario())
