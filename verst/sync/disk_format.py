"""The on-disk format of the disk weight transport: manifests, checksums, safetensors payloads.

What `verst.sync.disk` writes and reads: the per-version `manifest.json` (`Manifest`,
`TensorEntry`), the checksum algorithm (xxh3-128, or blake2b-128 without `xxhash`), durable
writes (fsync of files and directories), the hand-written safetensors payload, the layout of
`weight_vNNNNNN/` directories, and the errors the transport raises.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

try:
    import xxhash
except ImportError:  # pragma: no cover - exercised only where xxhash is absent
    xxhash = None

PublishMode = Literal["full", "xor", "overwrite"]

CHECKSUM_ALGORITHM = "xxh3_128" if xxhash is not None else "blake2b_128"
MANIFEST = "manifest.json"
COMPLETE = ".complete"
FORMAT_VERSION = 1
_VERSION_DIR = re.compile(r"^weight_v(\d{6,})$")
TMP_PREFIX = ".tmp-"
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


def digest(data: torch.Tensor | bytes | memoryview, algorithm: str) -> str:
    hasher = _hasher(algorithm)
    hasher.update(data.numpy() if isinstance(data, torch.Tensor) else data)
    return hasher.hexdigest()


def file_digest(path: Path, algorithm: str) -> str:
    hasher = _hasher(algorithm)
    chunk = bytearray(_READ_CHUNK_BYTES)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            hasher.update(view[:n])
    return hasher.hexdigest()


# --------------------------------------------------------------------------- bytes of tensors


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DiskSyncError(f"unknown dtype {name!r} in manifest")
    return dtype


def cpu_byte_copy(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A private contiguous CPU copy of `tensor`'s bytes, flat uint8 (never aliases the input);
    written into `out` (flat uint8) when it has the right size."""
    nbytes = tensor.numel() * tensor.element_size()
    if out is None or out.numel() != nbytes:
        out = torch.empty(nbytes, dtype=torch.uint8)
    out.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return out


def _as_tensor(bytes_u8: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return bytes_u8.view(dtype).reshape(shape)


class ByteWindow:
    """The target's bytes as flat uint8 on the CPU: a view when that aliases the target's own
    storage (CPU, contiguous), else a contiguous copy that `write_back` returns to the tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.aliased = self.tensor.device.type == "cpu" and self.tensor.is_contiguous()
        if self.aliased:
            self.bytes_u8 = self.tensor.reshape(-1).view(torch.uint8)
        else:
            self.bytes_u8 = cpu_byte_copy(self.tensor)

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
        return numel * dtype(self.dtype).itemsize


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


SAFETENSORS_DTYPES = {
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


def write_safetensors(
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
        if dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{name!r}: dtype {dtype} has no safetensors encoding")
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
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
