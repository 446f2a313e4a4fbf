"""Disk weight sync: versioned snapshots and XOR / overwrite deltas, published atomically.

The trainer's `DiskPublisher` writes `root/weight_v{version:06d}/`; engines (on any host that
sees `root`) call `apply_published` to patch their weights in place. `DiskTransport` is the
`disk` value of `sync.transport`: one publish per version, loaded by every engine under the
version protocol (`verst.sync.protocol`). What this module promises:

- A `weight_v*` directory is visible only once complete: it is written under a dot-prefixed
  temporary name in the same root, every file is fsynced, `.complete` is written last, and one
  `os.rename` publishes it. Readers ignore every other name in `root`.
- Every tensor's final bytes carry a checksum (xxh3-128, or blake2b-128 without `xxhash`), and
  every payload file carries one too. An engine checks the files before it writes anything and
  every tensor after, so a torn or corrupted payload, or a delta applied to the wrong bytes,
  raises `ChecksumMismatch` and never passes silently.
- A delta applies only on top of its base version (`StaleBase` otherwise), and `load_full`
  rebuilds the newest version it can verify from the newest full snapshot and the deltas after
  it: the recovery path after any failure.

Layout of one version:

    weight_v000007/
      manifest.json            version, base_version, mode, checksum algorithm, files, tensors
      delta-00000.safetensors  payload (full snapshots: model-00000.safetensors)
      .complete                written last

The format itself (manifest, checksums, payload files, errors) lives in `disk_format`.

A full snapshot stores each tensor under its own name, dtype and shape, so the directory is also
an ordinary safetensors checkpoint (`ServingEngine.update_weights_from_disk` loads it). An
`xor` delta stores the XOR of old and new raw bytes as flat uint8 tensors, an `overwrite` delta
the new tensors; both carry only tensors whose bytes changed.

Garbage collection keeps the newest `keep` versions (how far behind an engine may be and still
catch up by deltas) plus the newest full snapshot and every version after it (what `load_full`
needs). `full_every` bounds that chain by publishing a full snapshot every so many versions.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from verst.plugins import AdapterUpdate, EngineClient, NamedTensors
from verst.sync.disk_adapters import AdapterPublisher
from verst.sync.disk_format import (
    CHECKSUM_ALGORITHM,
    COMPLETE,
    MANIFEST,
    SAFETENSORS_DTYPES,
    TMP_PREFIX,
    ByteWindow,
    ChecksumMismatch,
    DiskSyncError,
    IncompletePublish,
    LayoutMismatch,
    Manifest,
    PublishMode,
    StaleBase,
    TensorEntry,
    cpu_byte_copy,
    digest,
    dtype,
    dtype_name,
    file_digest,
    fsync_dir,
    latest_full_snapshot,
    published_versions,
    read_manifest,
    version_dir,
    write_durable,
    write_safetensors,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "ApplyResult",
    "ChecksumMismatch",
    "DiskPublisher",
    "DiskSyncError",
    "DiskTransport",
    "IncompletePublish",
    "LayoutMismatch",
    "Manifest",
    "StaleBase",
    "TensorEntry",
    "apply_published",
    "latest_full_snapshot",
    "load_full",
    "published_versions",
    "read_manifest",
    "version_dir",
]


@dataclass
class _Published:
    """One tensor of the last published version, as the publisher remembers it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    bytes_u8: torch.Tensor  # flat CPU copy, owned by the publisher
    checksum: str


class DiskPublisher:
    """Trainer side: publish each version as a full snapshot or a delta against the last one.

    The last published bytes are kept as a CPU snapshot (one copy of the model in host memory);
    with `reuse_buffers` the copy from the version before is kept too and refilled, because
    faulting in fresh pages costs several times a memcpy. One publisher owns a `root`: on start
    it removes temporary dirs a crashed run left behind.
    """

    def __init__(
        self,
        root: Path,
        *,
        mode: PublishMode = "xor",
        keep: int = 2,
        full_every: int = 10,
        shard_bytes: int = 1 << 30,
        reuse_buffers: bool = True,
    ) -> None:
        if mode not in ("full", "xor", "overwrite"):
            raise ValueError(f"mode must be 'full', 'xor' or 'overwrite', got {mode!r}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if full_every < 0:
            raise ValueError(f"full_every must be >= 0 (0: never forced), got {full_every}")
        self.root = Path(root)
        self.mode: PublishMode = mode
        self.keep = keep
        self.full_every = full_every
        self.shard_bytes = shard_bytes
        self.reuse_buffers = reuse_buffers
        self.last_version: int | None = None
        self._versions_since_full = 0
        self._snapshot: dict[str, _Published] | None = None
        self._spare: dict[str, torch.Tensor] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        force_full: bool = False,
    ) -> Path:
        """Write `root/weight_v{version:06d}/` atomically and return its path.

        A full snapshot when forced, first, in mode "full", after a change of names, dtypes or
        shapes, or when `full_every` versions have passed; otherwise a delta against the last
        published version carrying only tensors whose checksum changed (a 128-bit checksum, so
        equal checksums are taken as equal bytes).
        """
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"version {version} must exceed the last published {self.last_version}"
            )
        final = version_dir(self.root, version)
        if final.exists():
            raise FileExistsError(f"{final} already exists")

        current: dict[str, _Published] = {}
        for name, tensor in named_tensors:
            bytes_u8 = cpu_byte_copy(tensor, out=self._spare.pop(name, None))
            current[name] = _Published(
                tensor.dtype, tuple(tensor.shape), bytes_u8, digest(bytes_u8, CHECKSUM_ALGORITHM)
            )
        previous = self._snapshot
        same_layout = previous is not None and {
            n: (p.dtype, p.shape) for n, p in current.items()
        } == {n: (p.dtype, p.shape) for n, p in previous.items()}
        full = (
            force_full
            or self.mode == "full"
            or not same_layout
            or (self.full_every > 0 and self._versions_since_full >= self.full_every)
        )
        mode: PublishMode = "full" if full else self.mode

        tmp = self.root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            manifest = self._write_payload(tmp, current, previous, mode, version)
            write_durable(tmp / MANIFEST, json.dumps(manifest.to_json(), indent=1).encode())
            # The marker goes last: a dir with it has every other file durable on disk.
            write_durable(tmp / COMPLETE, b"")
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

        if self.reuse_buffers and previous is not None:
            self._spare = {n: p.bytes_u8 for n, p in previous.items()}
        self._snapshot = current
        self.last_version = version
        self._versions_since_full = 1 if mode == "full" else self._versions_since_full + 1
        self.collect_garbage()
        return final

    def _write_payload(
        self,
        tmp: Path,
        current: dict[str, _Published],
        previous: dict[str, _Published] | None,
        mode: PublishMode,
        version: int,
    ) -> Manifest:
        prefix = "model" if mode == "full" else "delta"
        shards: list[list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor]]] = [[]]
        shard_bytes = 0
        entries: list[TensorEntry] = []
        for name, new in current.items():
            payload: tuple[torch.dtype, tuple[int, ...], torch.Tensor] | None
            if mode == "full":
                payload = (new.dtype, new.shape, new.bytes_u8)
            else:
                assert previous is not None
                old = previous[name]
                if new.checksum == old.checksum:
                    payload = None
                elif mode == "xor":
                    xor_u8 = torch.bitwise_xor(new.bytes_u8, old.bytes_u8)
                    payload = (torch.uint8, (xor_u8.numel(),), xor_u8)
                else:
                    payload = (new.dtype, new.shape, new.bytes_u8)
            if payload is not None:
                if shards[-1] and shard_bytes + new.bytes_u8.numel() > self.shard_bytes:
                    shards.append([])
                    shard_bytes = 0
                shards[-1].append((name, *payload))
                shard_bytes += new.bytes_u8.numel()
            entries.append(
                TensorEntry(
                    name=name,
                    dtype=dtype_name(new.dtype),
                    shape=new.shape,
                    checksum=new.checksum,
                    in_delta=payload is not None,
                    file=None if payload is None else f"{prefix}-{len(shards) - 1:05d}.safetensors",
                )
            )
        files = {
            f"{prefix}-{i:05d}.safetensors": write_safetensors(
                tmp / f"{prefix}-{i:05d}.safetensors", shard, CHECKSUM_ALGORITHM
            )
            for i, shard in enumerate(shards)
        }
        return Manifest(
            version=version,
            base_version=None if mode == "full" else self.last_version,
            mode=mode,
            checksum_algorithm=CHECKSUM_ALGORITHM,
            files=files,
            tensors=entries,
        )

    def collect_garbage(self) -> list[Path]:
        """Delete versions no reader needs; returns the deleted paths.

        Kept: the newest `keep` versions, and the newest full snapshot with every version after
        it (so `load_full` can always rebuild the newest version).
        """
        versions = published_versions(self.root)
        newest_full = latest_full_snapshot(self.root)
        newest_full_version = read_manifest(newest_full).version if newest_full else None
        keep_from = len(versions) - self.keep
        deleted = []
        for index, (version, path) in enumerate(versions):
            if index >= keep_from or (
                newest_full_version is not None and version >= newest_full_version
            ):
                continue
            # Rename first so a half-deleted dir is never visible under a weight_v* name.
            doomed = self.root / f"{TMP_PREFIX}gc-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(path)
        return deleted


# --------------------------------------------------------------------------- applying


class DiskTransport:
    """Publish a snapshot or delta once (`DiskPublisher`); every engine loads it from disk."""

    def __init__(self, publisher: DiskPublisher) -> None:
        self.publisher = publisher
        self.adapters = AdapterPublisher(publisher.root)

    async def send(
        self,
        engines: list[EngineClient],
        tensors: NamedTensors,
        version: int,
        adapter: AdapterUpdate | None = None,
    ) -> None:
        """Publish `version` (once: a resend, or a restarted engine's first push, loads what is
        published; an engine that holds no base of a delta rebuilds it by `load_full`). An
        adapter is published as a peft directory and loaded by name."""
        if adapter is not None:
            path = await asyncio.to_thread(self.adapters.publish, adapter, version)
            await asyncio.gather(*(e.load_lora_adapter(adapter.name, str(path)) for e in engines))
            return
        if self.publisher.last_version == version:
            path = version_dir(self.publisher.root, version)
        else:
            path = await asyncio.to_thread(self.publisher.publish, tensors(), version)
        await asyncio.gather(*(e.update_weights_from_disk(str(path)) for e in engines))


@dataclass(frozen=True)
class ApplyResult:
    version: int  # the version the target now holds
    mode: PublishMode  # "full" for a snapshot (and for load_full), else the delta's mode
    tensors_changed: int  # tensors written from a payload
    bytes_read: int  # payload bytes read from disk
    seconds: float
    chain: list[int] = field(default_factory=list)  # versions applied, oldest first


def _check_layout(manifest: Manifest, target: dict[str, torch.Tensor], path: Path) -> None:
    names = [t.name for t in manifest.tensors]
    missing = [n for n in names if n not in target]
    extra = sorted(set(target) - set(names))
    wrong = [
        f"{t.name}: manifest {t.dtype}{list(t.shape)}, target "
        f"{dtype_name(target[t.name].dtype)}{list(target[t.name].shape)}"
        for t in manifest.tensors
        if t.name in target
        and (t.dtype != dtype_name(target[t.name].dtype) or t.shape != tuple(target[t.name].shape))
    ]
    if missing or extra or wrong:
        raise LayoutMismatch(
            f"{path.name} does not fit the target: missing in target {missing[:5]}, "
            f"not in manifest {extra[:5]}, mismatched {wrong[:5]}"
        )


def _payload_fits(
    readers: dict[str, Any], keys: dict[str, set[str]], entry: TensorEntry, mode: PublishMode
) -> bool:
    """Whether the payload file holds `entry` with the dtype and shape its mode implies."""
    reader = readers.get(entry.file or "")
    if reader is None or entry.name not in keys[entry.file or ""]:
        return False
    header = reader.get_slice(entry.name)
    expected = (
        ("U8", [entry.nbytes])
        if mode == "xor"
        else (SAFETENSORS_DTYPES.get(dtype(entry.dtype)), list(entry.shape))
    )
    return (header.get_dtype(), list(header.get_shape())) == expected


def apply_published(
    target: dict[str, torch.Tensor],
    path: Path,
    *,
    current_version: int | None,
) -> ApplyResult:
    """Update `target` (name -> tensor, on any device) in place to the version at `path`.

    Raises before writing anything for an incomplete dir, a layout mismatch, a delta whose base
    is not `current_version` (`StaleBase`), or a payload file whose checksum fails. After
    writing, every tensor's final bytes are checked; a failure raises `ChecksumMismatch` with
    `target_modified=True`, and the caller must then `load_full`.
    """
    start_s = time.perf_counter()
    path = Path(path)
    manifest = read_manifest(path)
    _check_layout(manifest, target, path)
    if manifest.mode != "full" and current_version != manifest.base_version:
        raise StaleBase(path, manifest.base_version, current_version)

    algorithm = manifest.checksum_algorithm
    corrupt_files = [
        name
        for name, checksum in manifest.files.items()
        if file_digest(path / name, algorithm) != checksum
    ]
    if corrupt_files:
        raise ChecksumMismatch(path, corrupt_files, target_modified=False)

    mismatched: list[str] = []
    changed = 0
    bytes_read = 0
    with ExitStack() as stack, torch.no_grad():
        readers = {
            name: stack.enter_context(safe_open(str(path / name), framework="pt", device="cpu"))
            for name in manifest.files
        }
        keys = {name: set(reader.keys()) for name, reader in readers.items()}
        malformed = [
            entry.name
            for entry in manifest.tensors
            if entry.in_delta and not _payload_fits(readers, keys, entry, manifest.mode)
        ]
        if malformed:
            # The files match their checksums, so the publisher wrote a payload that contradicts
            # its own manifest; treated as corruption, refused before any write.
            raise ChecksumMismatch(path, malformed, target_modified=False)
        for entry in manifest.tensors:
            tensor = target[entry.name]
            if not entry.in_delta:
                final_bytes = ByteWindow(tensor).bytes_u8
            else:
                assert entry.file is not None
                payload = readers[entry.file].get_tensor(entry.name)
                bytes_read += payload.numel() * payload.element_size()
                changed += 1
                if manifest.mode == "xor":
                    window = ByteWindow(tensor)
                    window.bytes_u8.bitwise_xor_(payload)
                    window.write_back()
                    final_bytes = window.bytes_u8
                else:
                    tensor.detach().copy_(payload)
                    # The payload bytes are exactly what copy_ wrote: no read-back from a device.
                    final_bytes = payload.reshape(-1).view(torch.uint8)
            if digest(final_bytes, algorithm) != entry.checksum:
                mismatched.append(entry.name)
    if mismatched:
        raise ChecksumMismatch(path, mismatched, target_modified=changed > 0)
    return ApplyResult(
        version=manifest.version,
        mode=manifest.mode,
        tensors_changed=changed,
        bytes_read=bytes_read,
        seconds=time.perf_counter() - start_s,
        chain=[manifest.version],
    )


def _chain_after(root: Path, full: Path) -> Iterator[Path]:
    """Deltas after the full snapshot `full`, each based on the one before, oldest first."""
    previous = read_manifest(full).version
    for version, path in published_versions(root):
        if version <= previous:
            continue
        manifest = read_manifest(path)
        if manifest.mode == "full" or manifest.base_version != previous:
            return
        yield path
        previous = version


def load_full(target: dict[str, torch.Tensor], root: Path) -> ApplyResult:
    """Rebuild `target` from the newest full snapshot and the chain of deltas after it.

    Returns the newest version it could verify: when a delta in the chain fails its checks the
    target is left exactly at the version before it (reloaded from scratch if the failed delta
    had already written), so `result.version` may be older than the newest published one.
    Raises `ChecksumMismatch` only if the full snapshot itself is bad.
    """
    start_s = time.perf_counter()
    full = latest_full_snapshot(root)
    if full is None:
        raise DiskSyncError(f"no complete full snapshot under {root}")
    deltas = list(_chain_after(Path(root), full))
    while True:
        first = apply_published(target, full, current_version=None)
        applied, bytes_read, restart = [first.version], first.bytes_read, False
        for delta in deltas:
            try:
                result = apply_published(target, delta, current_version=applied[-1])
            except ChecksumMismatch as e:
                deltas = deltas[: deltas.index(delta)]
                restart = e.target_modified
                break
            applied.append(result.version)
            bytes_read += result.bytes_read
        if not restart:
            return ApplyResult(
                version=applied[-1],
                mode="full",
                tensors_changed=len(target),
                bytes_read=bytes_read,
                seconds=time.perf_counter() - start_s,
                chain=applied,
            )
