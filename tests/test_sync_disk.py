"""Disk weight sync: snapshots and deltas arrive bit-exact, and every failure is loud."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verst.models.tiny import TinyModelConfig, build_tiny_model
from verst.sync import disk
from verst.sync.disk import (
    ChecksumMismatch,
    DiskPublisher,
    IncompletePublish,
    LayoutMismatch,
    StaleBase,
    apply_published,
    latest_full_snapshot,
    load_full,
    published_versions,
    read_manifest,
)

Weights = dict[str, torch.Tensor]


def _random_weights(dtype: torch.dtype, seed: int = 0) -> Weights:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed": (32, 16), "w1": (16, 48), "w2": (48, 16), "norm": (16,), "scale": ()}
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}


def _engine_copy(source: Weights) -> Weights:
    """Zeroed tensors of the same layout; `w1` is a non-contiguous view, as after a transpose."""
    target = {n: torch.zeros_like(t) for n, t in source.items()}
    rows, cols = source["w1"].shape
    target["w1"] = torch.zeros(cols, rows, dtype=source["w1"].dtype).t()
    assert not target["w1"].is_contiguous()
    return target


def _assert_bit_equal(target: Weights, source: Weights) -> None:
    assert target.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(target[name], tensor), name


def _payload_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _tiny_params(seed: int) -> Weights:
    cfg = TinyModelConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = build_tiny_model(cfg, vocab_size=100, seed=seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_snapshot_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    source = _random_weights(dtype)
    path = DiskPublisher(tmp_path).publish(source.items(), version=1)
    manifest = read_manifest(path)
    assert (manifest.mode, manifest.base_version, manifest.version) == ("full", None, 1)
    assert manifest.checksum_algorithm == disk.CHECKSUM_ALGORITHM
    assert all(t.in_delta for t in manifest.tensors)
    # A full snapshot is an ordinary safetensors checkpoint under the real names and dtypes.
    on_disk = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    _assert_bit_equal(on_disk, source)

    target = _engine_copy(source)
    result = apply_published(target, path, current_version=None)
    _assert_bit_equal(target, source)
    assert (result.version, result.mode, result.tensors_changed) == (1, "full", len(source))
    assert result.bytes_read == sum(t.numel() * t.element_size() for t in source.values())


@pytest.mark.parametrize("mode", ["xor", "overwrite"])
def test_deltas_keep_an_engine_copy_bit_exact(tmp_path: Path, mode: str) -> None:
    trainer = _tiny_params(seed=0)
    engine = _tiny_params(seed=1)  # starts different: only the publishes make them equal
    engine["model.norm.weight"] = engine["model.norm.weight"].to(torch.bfloat16)
    trainer["model.norm.weight"] = trainer["model.norm.weight"].to(torch.bfloat16)
    publisher = DiskPublisher(tmp_path, mode=mode, keep=10)  # type: ignore[arg-type]
    first = publisher.publish(trainer.items(), version=1)
    apply_published(engine, first, current_version=None)
    _assert_bit_equal(engine, trainer)
    full_bytes = _payload_bytes(first)

    names = sorted(trainer)
    current = 1
    gen = torch.Generator().manual_seed(0)
    for step in range(2, 6):
        changed = set(names[step % 3 :: 3])
        for name in changed:
            noise = torch.randn(trainer[name].shape, generator=gen).to(trainer[name].dtype)
            trainer[name].add_(noise, alpha=1e-2)
        path = publisher.publish(trainer.items(), version=step)
        manifest = read_manifest(path)
        assert (manifest.mode, manifest.base_version) == (mode, step - 1)
        assert {t.name for t in manifest.tensors} == set(names)
        assert {t.name for t in manifest.tensors if t.in_delta} == changed
        assert _payload_bytes(path) < full_bytes
        result = apply_published(engine, path, current_version=current)
        current = result.version
        assert (current, result.tensors_changed) == (step, len(changed))
        _assert_bit_equal(engine, trainer)


def test_delta_with_no_change_carries_nothing(tmp_path: Path) -> None:
    source = _random_weights(torch.float32)
    publisher = DiskPublisher(tmp_path)
    target = _engine_copy(source)
    apply_published(target, publisher.publish(source.items(), 1), current_version=None)
    path = publisher.publish(source.items(), 2)
    result = apply_published(target, path, current_version=1)
    assert (result.tensors_changed, result.bytes_read) == (0, 0)
    _assert_bit_equal(target, source)


def test_xor_delta_applied_twice_reverts_and_is_detected(tmp_path: Path) -> None:
    source = _random_weights(torch.bfloat16)
    publisher = DiskPublisher(tmp_path)
    target = _engine_copy(source)
    apply_published(target, publisher.publish(source.items(), 1), current_version=None)
    v1 = {n: t.clone() for n, t in source.items()}
    source["w2"].mul_(1.5)
    source["embed"][3].fill_(0.25)
    delta = publisher.publish(source.items(), 2)
    apply_published(target, delta, current_version=1)
    _assert_bit_equal(target, source)

    # A caller that lies about its version gets the XOR applied again: the bytes go back to v1.
    with pytest.raises(ChecksumMismatch) as info:
        apply_published(target, delta, current_version=1)
    assert sorted(info.value.names) == ["embed", "w2"]
    assert info.value.target_modified
    _assert_bit_equal(target, v1)
    # The honest caller is refused before anything is written.
    with pytest.raises(StaleBase):
        apply_published(target, delta, current_version=2)

    result = load_full(target, tmp_path)
    assert (result.version, result.chain) == (2, [1, 2])
    _assert_bit_equal(target, source)


def _flip_payload_byte(path: Path) -> bytes:
    """Flip one bit in the last tensor's data (after the safetensors header); returns the
    original file bytes."""
    payload = next(path.glob("*.safetensors"))
    original = payload.read_bytes()
    data = bytearray(original)
    data[-3] ^= 0x40
    payload.write_bytes(bytes(data))
    return original


def test_corrupted_delta_is_detected_and_load_full_recovers(tmp_path: Path) -> None:
    source = _random_weights(torch.float32)
    publisher = DiskPublisher(tmp_path)
    target = _engine_copy(source)
    apply_published(target, publisher.publish(source.items(), 1), current_version=None)
    source["w1"].add_(1.0)
    apply_published(target, publisher.publish(source.items(), 2), current_version=1)
    v2 = {n: t.clone() for n, t in source.items()}
    source["w2"].add_(1.0)
    source["norm"].add_(1.0)
    delta = publisher.publish(source.items(), 3)

    # A torn or flipped payload file fails its file checksum before anything is written.
    original = _flip_payload_byte(delta)
    with pytest.raises(ChecksumMismatch) as info:
        apply_published(target, delta, current_version=2)
    assert not info.value.target_modified
    _assert_bit_equal(target, v2)
    next(delta.glob("*.safetensors")).write_bytes(original)

    # A payload re-saved with wrong bytes but a consistent file checksum passes the file check;
    # the per-tensor final checksums catch it after the write.
    payload_file = next(delta.glob("*.safetensors"))
    payload = load_file(payload_file)
    payload["w2"][0] ^= 1
    save_file(payload, payload_file)
    manifest = json.loads((delta / "manifest.json").read_text())
    manifest["files"] = [
        {
            "name": f["name"],
            "checksum": disk.file_digest(delta / f["name"], disk.CHECKSUM_ALGORITHM),
        }
        for f in manifest["files"]
    ]
    (delta / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ChecksumMismatch) as info:
        apply_published(target, delta, current_version=2)
    assert info.value.names == ["w2"] and info.value.target_modified
    assert not torch.equal(target["w2"], source["w2"])

    # load_full stops at the newest version it can verify: v2, exactly.
    result = load_full(target, tmp_path)
    assert (result.version, result.chain) == (2, [1, 2])
    _assert_bit_equal(target, v2)

    # The trainer answers with a full push; the engine is exact at the newest version again.
    path = publisher.publish(source.items(), 4, force_full=True)
    assert read_manifest(path).mode == "full"
    assert latest_full_snapshot(tmp_path) == path
    apply_published(target, path, current_version=result.version)
    _assert_bit_equal(target, source)


def test_refusals_leave_the_target_untouched(tmp_path: Path) -> None:
    source = _random_weights(torch.float32)
    publisher = DiskPublisher(tmp_path)
    target = _engine_copy(source)
    apply_published(target, publisher.publish(source.items(), 1), current_version=None)
    before = {n: t.clone() for n, t in target.items()}
    source["w1"].add_(1.0)
    delta = publisher.publish(source.items(), 2)

    with pytest.raises(StaleBase, match="version 1.*version 0"):
        apply_published(target, delta, current_version=0)
    with pytest.raises(StaleBase):
        apply_published(target, delta, current_version=None)
    with pytest.raises(LayoutMismatch):
        apply_published({**target, "extra": torch.zeros(2)}, delta, current_version=1)
    with pytest.raises(LayoutMismatch):
        apply_published({**target, "w2": torch.zeros(16, 48)}, delta, current_version=1)
    _assert_bit_equal(target, before)

    (delta / ".complete").unlink()
    with pytest.raises(IncompletePublish, match="complete"):
        apply_published(target, delta, current_version=1)
    assert [v for v, _ in published_versions(tmp_path)] == [1]
    _assert_bit_equal(target, before)


def test_publish_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _random_weights(torch.float32)
    publisher = DiskPublisher(tmp_path)
    publisher.publish(source.items(), 1)

    real_write = disk.write_durable

    def crash_before_marker(path: Path, data: bytes) -> None:
        if path.name == ".complete":
            # What a reader would see at this instant: only the temporary dir, never weight_v2.
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith("weight_v")] == [
                "weight_v000001"
            ]
            assert [v for v, _ in published_versions(tmp_path)] == [1]
            raise OSError("disk full")
        real_write(path, data)

    monkeypatch.setattr(disk, "write_durable", crash_before_marker)
    with pytest.raises(OSError, match="disk full"):
        publisher.publish(source.items(), 2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weight_v000001"]
    assert publisher.last_version == 1

    # A crashed run's temporary dir, even a complete-looking one, is invisible and is swept.
    stale = tmp_path / ".tmp-weight_v000002-123-abcd"
    stale.mkdir()
    (stale / ".complete").touch()
    assert [v for v, _ in published_versions(tmp_path)] == [1]
    DiskPublisher(tmp_path)
    assert not stale.exists()

    with pytest.raises(ValueError, match="exceed"):
        publisher.publish(source.items(), 1)


def test_layout_change_and_full_mode_publish_full_snapshots(tmp_path: Path) -> None:
    source = _random_weights(torch.float32)
    publisher = DiskPublisher(tmp_path / "delta")
    publisher.publish(source.items(), 1)
    assert read_manifest(publisher.publish(source.items(), 2)).mode == "xor"
    source["norm"] = torch.ones(17)
    assert read_manifest(publisher.publish(source.items(), 3)).mode == "full"
    source["scale"] = source["scale"].double()
    assert read_manifest(publisher.publish(source.items(), 4)).mode == "full"

    always_full = DiskPublisher(tmp_path / "full", mode="full")
    for version in (1, 2):
        assert read_manifest(always_full.publish(source.items(), version)).mode == "full"


def test_gc_keeps_recent_versions_and_the_chain_from_the_newest_full(tmp_path: Path) -> None:
    source = _random_weights(torch.float32)
    publisher = DiskPublisher(tmp_path, keep=2, full_every=4)
    expected_kept = {
        1: [1],
        2: [1, 2],
        3: [1, 2, 3],
        4: [1, 2, 3, 4],
        5: [4, 5],
        6: [5, 6],
        7: [5, 6, 7],
        8: [5, 6, 7, 8],
        9: [8, 9],
    }
    target = _engine_copy(source)
    for version, kept in expected_kept.items():
        source["w2"].add_(0.5)
        publisher.publish(source.items(), version)
        assert [v for v, _ in published_versions(tmp_path)] == kept, version
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
        result = load_full(target, tmp_path)
        assert result.version == version
        _assert_bit_equal(target, source)
    modes = {v: read_manifest(p).mode for v, p in published_versions(tmp_path)}
    assert modes == {8: "xor", 9: "full"}


def test_every_dtype_and_shard_round_trips_through_safetensors(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    source = {
        "f16": torch.randn(7, 3, generator=gen).half(),
        "f64": torch.randn(5, generator=gen).double(),
        "i64": torch.randint(-(2**40), 2**40, (9,), generator=gen),
        "i8": torch.randint(-128, 127, (4, 4), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 255, (11,), generator=gen, dtype=torch.uint8),
        "mask": torch.rand(6, generator=gen) > 0.5,
        "empty": torch.zeros(0, 4),
    }
    publisher = DiskPublisher(tmp_path, shard_bytes=64)
    path = publisher.publish(source.items(), 1)
    assert len(list(path.glob("model-*.safetensors"))) > 1
    on_disk = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    _assert_bit_equal(on_disk, source)
    target = {n: torch.zeros_like(t) for n, t in source.items()}
    apply_published(target, path, current_version=None)
    _assert_bit_equal(target, source)

    source["i64"].add_(1)
    source["mask"].logical_not_()
    delta = publisher.publish(source.items(), 2)
    assert {t.name for t in read_manifest(delta).tensors if t.in_delta} == {"i64", "mask"}
    apply_published(target, delta, current_version=1)
    _assert_bit_equal(target, source)


def test_payload_contradicting_its_manifest_is_refused_before_writing(tmp_path: Path) -> None:
    source = _random_weights(torch.float32)
    publisher = DiskPublisher(tmp_path, mode="overwrite")
    target = _engine_copy(source)
    apply_published(target, publisher.publish(source.items(), 1), current_version=None)
    before = {n: t.clone() for n, t in target.items()}
    source["w2"].add_(1.0)
    delta = publisher.publish(source.items(), 2)
    payload_file = next(delta.glob("*.safetensors"))
    save_file({"w2": load_file(payload_file)["w2"].reshape(-1)}, payload_file)  # wrong shape
    manifest = json.loads((delta / "manifest.json").read_text())
    manifest["files"][0]["checksum"] = disk.file_digest(payload_file, disk.CHECKSUM_ALGORITHM)
    (delta / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ChecksumMismatch) as info:
        apply_published(target, delta, current_version=1)
    assert info.value.names == ["w2"] and not info.value.target_modified
    _assert_bit_equal(target, before)
