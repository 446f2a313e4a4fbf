"""Disk weight sync: versioned snapshots and XOR / overwrite deltas, published atomically.

The trainer's `DiskPublisher` writes `root/weight_v{version:06d}/`; engines (on any host that
sees `root`) call `apply_published` to patch their weights in place. What this module promises:

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

A full snapshot stores each tensor under its own name, dtype and shape, so the directory is also
an ordinary safetensors checkpoint (`ServingEngine.update_weights_from_disk` loads it). An
`xor` delta stores the XOR of old and new raw bytes as flat uint8 tensors, an `overwrite` delta
the new tensors; both carry only tensors whose bytes changed.

Garbage collection keeps the newest `keep` versions (how far behind an engine may be and still
catch up by deltas) plus the newest full snapshot and every version after it (what `load_full`
needs). `full_every` bounds that chain by publishing a full snapshot every so many versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

try:
    import xxhash
except ImportError:  # pragma: no cover - exercised only where xxhash is absent
    xxhash = None

__all__ = [
    "CHECKSUM_ALGORITHM",
    "ApplyResult",
    "ChecksumMismatch",
    "DiskPublisher",
    "DiskSyncError",
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

PublishMode = Literal["full", "xor", "overwrite"]

CHECKSUM_ALGORITHM = "xxh3_128" if xxhash is not None else "blake2b_128"
MANIFEST = "manifest.json"
COMPLETE = ".complete"
FORMAT_VERSION = 1
_VERSION_DIR = re.compile(r"^weight_v(\d{6,})$")
_TMP_PREFIX = ".tmp-"
_READ_CHUNK_BYTES = 16 << 20
_WRITE_CHUNK_BYTES = 16 << 20  # one huge write() measured ~5x slower than 16 MiB ones


class DiskSyncError(RuntimeError):
    """Base of every error this transport raises on the reading side."""


class IncompletePublish(DiskSyncError):
    """The directory has no `.complete` marker (or no manifest): it must not be read."""


class LayoutMismatch(DiskSyncError):
    """Manifest and target disagree on names, dtypes or shapes; nothing was written."""


class StaleBase(DiskSyncError):
    """A delta's base is not the target's current version; the caller must `load_full`."""

    def __init__(self, path: Path, base_version: int | None, current_version: int | None):
        self.path = path
        self.base_version = base_version
        self.current_version = current_version
        super().__init__(
            f"{path.name} is a delta against version {base_version}, but the target is at "
            f"version {current_version}; load the latest full snapshot instead (load_full)"
        )


class ChecksumMismatch(DiskSyncError):
    """Bytes on disk or in the target differ from the manifest.

    `target_modified` says whether the target was written before the mismatch was found: when
    True its weights are undefined and the caller must `load_full` before generating again.
    """

    def __init__(self, path: Path, names: list[str], *, target_modified: bool):
        self.path = path
        self.names = names
        self.target_modified = target_modified
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        state = (
            "the target was modified: load_full before generating"
            if target_modified
            else "the target was not modified"
        )
        super().__init__(f"{path.name}: checksum mismatch for {shown} ({state})")


# --------------------------------------------------------------------------- checksums


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        if xxhash is None:
            raise DiskSyncError("manifest uses xxh3_128 but the xxhash package is not installed")
        return xxhash.xxh3_128()
    if algorithm == "blake2b_128":
        return hashlib.blake2b(digest_size=16)
    raise DiskSyncError(f"unknown checksum algorithm {algorithm!r}")


def _digest(data: torch.Tensor | bytes | memoryview, algorithm: str) -> str:
    hasher = _hasher(algorithm)
    hasher.update(data.numpy() if isinstance(data, torch.Tensor) else data)
    return hasher.hexdigest()


def _file_digest(path: Path, algorithm: str) -> str:
    hasher = _hasher(algorithm)
    chunk = bytearray(_READ_CHUNK_BYTES)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            hasher.update(view[:n])
    return hasher.hexdigest()


# --------------------------------------------------------------------------- bytes of tensors


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DiskSyncError(f"unknown dtype {name!r} in manifest")
    return dtype


def _cpu_byte_copy(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A private contiguous CPU copy of `tensor`'s bytes, flat uint8 (never aliases the input);
    written into `out` (flat uint8) when it has the right size."""
    nbytes = tensor.numel() * tensor.element_size()
    if out is None or out.numel() != nbytes:
        out = torch.empty(nbytes, dtype=torch.uint8)
    out.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return out


def _as_tensor(bytes_u8: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return bytes_u8.view(dtype).reshape(shape)


class _ByteWindow:
    """The target's bytes as flat uint8 on the CPU: a view when that aliases the target's own
    storage (CPU, contiguous), else a contiguous copy that `write_back` returns to the tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.aliased = self.tensor.device.type == "cpu" and self.tensor.is_contiguous()
        if self.aliased:
            self.bytes_u8 = self.tensor.reshape(-1).view(torch.uint8)
        else:
            self.bytes_u8 = _cpu_byte_copy(self.tensor)

    def write_back(self) -> None:
        if not self.aliased:
            self.tensor.copy_(_as_tensor(self.bytes_u8, self.tensor.dtype, self.tensor.shape))


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    checksum: str  # of the tensor's final bytes at this version
    in_delta: bool  # whether the payload carries it (always True in a full snapshot)
    file: str | None  # payload file holding it, None when not carried

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Manifest:
    version: int
    base_version: int | None  # None for a full snapshot
    mode: PublishMode
    checksum_algorithm: str
    files: dict[str, str]  # payload file name -> checksum of its bytes
    tensors: list[TensorEntry]
    format: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "version": self.version,
            "base_version": self.base_version,
            "mode": self.mode,
            "checksum_algorithm": self.checksum_algorithm,
            "files": [{"name": n, "checksum": c} for n, c in self.files.items()],
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "checksum": t.checksum,
                    "in_delta": t.in_delta,
                    "file": t.file,
                }
                for t in self.tensors
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format") != FORMAT_VERSION:
            raise DiskSyncError(f"unsupported manifest format {data.get('format')!r}")
        return cls(
            version=int(data["version"]),
            base_version=data["base_version"],
            mode=data["mode"],
            checksum_algorithm=data["checksum_algorithm"],
            files={f["name"]: f["checksum"] for f in data["files"]},
            tensors=[
                TensorEntry(
                    name=t["name"],
                    dtype=t["dtype"],
                    shape=tuple(t["shape"]),
                    checksum=t["checksum"],
                    in_delta=t["in_delta"],
                    file=t["file"],
                )
                for t in data["tensors"]
            ],
        )


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"weight_v{version:06d}"


def published_versions(root: Path) -> list[tuple[int, Path]]:
    """Complete published versions under `root`, oldest first; temporary dirs are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _VERSION_DIR.match(entry.name)
        if match and (entry / COMPLETE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def read_manifest(path: Path) -> Manifest:
    """The manifest of a published version; `IncompletePublish` if it is not complete."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise IncompletePublish(
            f"{path} has no {COMPLETE} marker: it is not a completely published version"
        )
    try:
        data = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError as e:
        raise IncompletePublish(f"{path} has no {MANIFEST}") from e
    return Manifest.from_json(data)


def latest_full_snapshot(root: Path) -> Path | None:
    """The newest complete full snapshot under `root`, or None."""
    for _, path in reversed(published_versions(root)):
        if read_manifest(path).mode == "full":
            return path
    return None


# --------------------------------------------------------------------------- publishing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _write_safetensors(
    path: Path,
    tensors: list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor]],
    algorithm: str,
) -> str:
    """Write (name, dtype, shape, flat uint8 bytes) as one safetensors file, fsynced; returns
    the checksum of the file's bytes.

    Written by hand rather than with `safetensors.torch.save`: that builds the whole file as
    one `bytes` first (measured 3.7x slower than the disk for 500 MB), and one huge `write`
    is itself several times slower here than chunked writes from the tensors' own memory.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, bytes_u8 in tensors:
        if dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name!r}: dtype {dtype} has no safetensors encoding")
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + bytes_u8.numel()],
        }
        offset += bytes_u8.numel()
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data to 8 bytes
    hasher = _hasher(algorithm)
    with open(path, "wb", buffering=0) as f:
        for chunk in (len(header_bytes).to_bytes(8, "little"), header_bytes):
            hasher.update(chunk)
            f.write(chunk)
        for _, _, _, bytes_u8 in tensors:
            data = memoryview(bytes_u8.numpy())
            for start in range(0, len(data), _WRITE_CHUNK_BYTES):
                chunk = data[start : start + _WRITE_CHUNK_BYTES]
                hasher.update(chunk)
                written = 0
                while written < len(chunk):
                    written += f.write(chunk[written:])
        os.fsync(f.fileno())
    return hasher.hexdigest()


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
            if entry.name.startswith(_TMP_PREFIX):
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
            bytes_u8 = _cpu_byte_copy(tensor, out=self._spare.pop(name, None))
            current[name] = _Published(
                tensor.dtype, tuple(tensor.shape), bytes_u8, _digest(bytes_u8, CHECKSUM_ALGORITHM)
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

        tmp = self.root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            manifest = self._write_payload(tmp, current, previous, mode, version)
            _write_durable(tmp / MANIFEST, json.dumps(manifest.to_json(), indent=1).encode())
            # The marker goes last: a dir with it has every other file durable on disk.
            _write_durable(tmp / COMPLETE, b"")
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
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
                    dtype=_dtype_name(new.dtype),
                    shape=new.shape,
                    checksum=new.checksum,
                    in_delta=payload is not None,
                    file=None if payload is None else f"{prefix}-{len(shards) - 1:05d}.safetensors",
                )
            )
        files = {
            f"{prefix}-{i:05d}.safetensors": _write_safetensors(
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
            doomed = self.root / f"{_TMP_PREFIX}gc-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(path)
        return deleted


# --------------------------------------------------------------------------- applying


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
        f"{_dtype_name(target[t.name].dtype)}{list(target[t.name].shape)}"
        for t in manifest.tensors
        if t.name in target
        and (t.dtype != _dtype_name(target[t.name].dtype) or t.shape != tuple(target[t.name].shape))
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
        else (_SAFETENSORS_DTYPES.get(_dtype(entry.dtype)), list(entry.shape))
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
        if _file_digest(path / name, algorithm) != checksum
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
                final_bytes = _ByteWindow(tensor).bytes_u8
            else:
                assert entry.file is not None
                payload = readers[entry.file].get_tensor(entry.name)
                bytes_read += payload.numel() * payload.element_size()
                changed += 1
                if manifest.mode == "xor":
                    window = _ByteWindow(tensor)
                    window.bytes_u8.bitwise_xor_(payload)
                    window.write_back()
                    final_bytes = window.bytes_u8
                else:
                    tensor.detach().copy_(payload)
                    # The payload bytes are exactly what copy_ wrote: no read-back from a device.
                    final_bytes = payload.reshape(-1).view(torch.uint8)
            if _digest(final_bytes, algorithm) != entry.checksum:
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
