"""SGLang's `/update_weights_from_tensor` payload: tensors as handles to shared storage.

The wire format is SGLang's: `serialized_named_tensors` holds, per TP rank, the base64 of a
`multiprocessing.reduction.ForkingPickler` pickle, in which torch's own reductions
(`torch.multiprocessing.reductions`) turn a tensor into a handle to its storage:
- CUDA: a CUDA IPC handle (`cudaIpcGetMemHandle` of the allocation, plus offsets). As SGLang's
  `monkey_patch_torch_reductions` does, the GPU is named by its UUID rather than its index (the
  engine may number GPUs differently) and the rebuild function is `_rebuild_cuda_tensor_modified`
  (SGLang maps that name to its own copy);
- CPU: torch's `file_system` sharing strategy: a named shared-memory file and the address of the
  trainer's `torch_shm_manager`. (torch's default `file_descriptor` strategy passes a descriptor
  through a socket that only a `multiprocessing` child can authenticate to, so it cannot reach
  an unrelated server process.) The pickler chooses this per call; the process-wide sharing
  strategy is left alone.

The payload is a list of `(name, tensor)` (`load_format` null, SGLang's default) or, with
`load_format: "flattened_bucket"`, `{"flattened_tensor": uint8 buffer, "metadata":
[FlattenedTensorMetadata]}` (SGLang's bucket layout: each tensor is `flat[start_idx:end_idx]`
viewed as its dtype and shape).

Unpickling runs in the engine through an allow-list (`loads`): only torch's rebuild functions,
torch classes and dtypes and the two metadata classes may appear, so a request cannot run
arbitrary code. Errors say what to do: an engine that cannot see the trainer's GPU or shared
memory answers 400 with "same host / same GPU" in its message, and the transport raises
`SharedTensorError` with it.
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

LOAD_FORMATS: tuple[str | None, ...] = (None, "direct", "flattened_bucket")
HELD_STORAGES = 4  # mapped trainer buffers an engine keeps open between updates
_CUDA_DEVICE_ARG = 6  # index of the device in torch's rebuild_cuda_tensor arguments


class SharedTensorError(RuntimeError):
    """A shared-tensor payload could not be made, opened or applied."""


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket (the fields of SGLang's class of the same name)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int  # byte offsets into the flattened uint8 buffer
    end_idx: int
    numel: int  # bytes


@dataclass
class LocalSerializedTensor:
    """SGLang's per-TP-rank wrapper: `values[rank]` is a pickled tensor (no base64)."""

    values: list[Any]


# ---- producer: pickling tensors as handles ----------------------------------------------------

# Storages this process shared over CUDA IPC, by (handle, offset): a process cannot open its own
# IPC handle, so an in-process engine finds the storage here instead.
_PRODUCED_CUDA: dict[tuple[bytes, int], Any] = {}  # values: torch StorageWeakRef
_PRODUCED_LOCK = threading.Lock()


@cache
def _cuda_uuids() -> tuple[str, ...]:
    if not torch.cuda.is_available():
        return ()
    return tuple(
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    )


def device_uuid(index: int) -> str:
    return _cuda_uuids()[index]


def _reduce_storage_file_system(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    """torch's `file_system` branch of `reduce_storage`, whatever the process-wide strategy."""
    if storage.device.type != "cpu":
        raise SharedTensorError(f"cannot share a {storage.device.type} storage as CPU memory")
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild decrements it
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if getattr(rebuild, "__name__", "") not in (
        "rebuild_cuda_tensor",
        "_rebuild_cuda_tensor_modified",
    ):
        return rebuild, args
    args = list(args)
    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, int):
        args[_CUDA_DEVICE_ARG] = device_uuid(device)
    with _PRODUCED_LOCK:
        for key in [k for k, ref in _PRODUCED_CUDA.items() if ref.expired()]:
            del _PRODUCED_CUDA[key]
        _PRODUCED_CUDA[(args[7], args[9])] = reductions.StorageWeakRef(tensor.untyped_storage())
    return _rebuild_cuda_tensor_modified, tuple(args)


def dumps(obj: Any) -> str:
    """Pickle `obj` with its tensors as handles (CUDA IPC, or /dev/shm files); base64 text."""
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage_file_system
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor
    pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# ---- consumer: opening handles ----------------------------------------------------------------


def _local_cuda_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    uuids = _cuda_uuids()
    if device in uuids:
        return uuids.index(device)
    sees = ", ".join(uuids) if uuids else "no GPU"
    raise SharedTensorError(
        f"the trainer's tensors are on GPU {device}, which this engine process does not see "
        f"(it sees {sees}): CUDA IPC needs the engine on the trainer's GPU, on the same host; "
        "use the broadcast or disk transport otherwise"
    )


def _rebuild_cuda_tensor_modified(*args: Any) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor` with the GPU named by UUID (SGLang's convention)."""
    args_list = list(args)
    index = _local_cuda_index(args_list[_CUDA_DEVICE_ARG])
    args_list[_CUDA_DEVICE_ARG] = index
    size, stride, offset, storage_cls, dtype = args_list[1:6]
    handle, offset_bytes = args_list[7], args_list[9]
    with _PRODUCED_LOCK:
        ref = _PRODUCED_CUDA.get((handle, offset_bytes))
    local = torch.UntypedStorage._new_with_weak_ptr(ref.cdata) if ref is not None else None
    if local is not None:  # shared by this very process: use the storage, release the counter
        storage_cls._release_ipc_counter(args_list[11], args_list[12], device=index)
        typed = torch.storage.TypedStorage(wrap_storage=local, dtype=dtype, _internal=True)
        return torch._utils._rebuild_tensor(typed, offset, size, stride)
    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    try:
        return rebuild(*args_list)
    except RuntimeError as error:
        raise SharedTensorError(
            f"could not open the trainer's CUDA IPC handle on GPU {index}: {error}. CUDA IPC "
            "needs the trainer and the engine on one host and GPU, in one IPC namespace"
        ) from error


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: int, dtype: Any = None):
    try:
        return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)
    except RuntimeError as error:
        raise SharedTensorError(
            f"could not open the trainer's shared memory {handle!r}: {error}. The shared-memory "
            "transport needs the trainer and the engine on one host, sharing /dev/shm; use the "
            "broadcast or disk transport otherwise"
        ) from error


_REDUCTIONS = {
    "rebuild_tensor": reductions.rebuild_tensor,
    "rebuild_typed_storage": reductions.rebuild_typed_storage,
    "rebuild_storage_empty": reductions.rebuild_storage_empty,
    "rebuild_storage_filename": _rebuild_storage_filename,
    "rebuild_cuda_tensor": _rebuild_cuda_tensor_modified,
}
_TORCH_CLASSES = {
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "TypedStorage"): torch.TypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
}


class _Unpickler(pickle.Unpickler):
    """Only what a shared-tensor payload needs; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "_rebuild_cuda_tensor_modified":  # ours or SGLang's: same arguments
            return _rebuild_cuda_tensor_modified
        if module == "torch.multiprocessing.reductions":
            if name in _REDUCTIONS:
                return _REDUCTIONS[name]
            if name == "rebuild_storage_fd":
                raise SharedTensorError(
                    "the payload shares CPU memory by file descriptor (torch's default sharing "
                    "strategy), which only a multiprocessing child of the trainer can receive; "
                    "pickle it with verst.sync.shared_tensors.dumps (the file_system strategy)"
                )
        if (module, name) in _TORCH_CLASSES:
            return _TORCH_CLASSES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name == "FlattenedTensorMetadata" and (
            module == __name__ or module.startswith("sglang.")
        ):
            return FlattenedTensorMetadata
        if name == "LocalSerializedTensor" and (module == __name__ or module.startswith("sglang.")):
            return LocalSerializedTensor
        raise SharedTensorError(
            f"refused to unpickle {module}.{name}: not part of a tensor payload"
        )


def loads(data: str | bytes) -> Any:
    """Unpickle one payload (base64 text or raw bytes) through the allow-list."""
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    except ValueError as error:
        raise SharedTensorError(f"the payload is not valid base64: {error}") from error
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except SharedTensorError:
        raise
    except Exception as error:
        raise SharedTensorError(
            f"could not unpickle the payload: {type(error).__name__}: {error}"
        ) from error


def named_tensors_from_payload(
    data: str | bytes, load_format: str | None
) -> list[tuple[str, torch.Tensor]]:
    """One `serialized_named_tensors` entry → `(name, tensor)` views of the trainer's buffers."""
    if load_format not in LOAD_FORMATS:
        raise SharedTensorError(
            f"load_format {load_format!r} is not supported (null, 'direct' or 'flattened_bucket')"
        )
    obj = loads(data)
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= obj.keys():
            raise SharedTensorError("a flattened_bucket payload is {flattened_tensor, metadata}")
        flat, metadata = obj["flattened_tensor"], obj["metadata"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
            raise SharedTensorError("flattened_tensor must be a 1-D uint8 tensor")
        layout = []
        for meta in metadata:
            if not isinstance(meta, FlattenedTensorMetadata):
                raise SharedTensorError("metadata must be a list of FlattenedTensorMetadata")
            shape = tuple(int(x) for x in meta.shape)
            nbytes = meta.dtype.itemsize * _numel(shape)
            if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
                raise SharedTensorError(f"{meta.name}: bytes out of the bucket's range")
            if meta.end_idx - meta.start_idx != nbytes:
                raise SharedTensorError(f"{meta.name}: {nbytes} bytes expected for its shape")
            layout.append((meta.start_idx, meta.dtype, shape))
        views = bucket_views(flat, layout)
        return [(str(m.name), v) for m, v in zip(metadata, views, strict=True)]
    if not isinstance(obj, (list, tuple)):
        raise SharedTensorError("a payload is a list of (name, tensor) pairs")
    named = []
    for item in obj:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise SharedTensorError("a payload is a list of (name, tensor) pairs")
        name, value = item
        if isinstance(value, LocalSerializedTensor):
            value = loads(value.values[0])
        if not isinstance(value, torch.Tensor):
            raise SharedTensorError(f"{name}: expected a tensor, got {type(value).__name__}")
        named.append((name, value))
    return named


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def bucket_views(
    flat: torch.Tensor, layout: Iterable[tuple[int, torch.dtype, tuple[int, ...]]]
) -> list[torch.Tensor]:
    """Contiguous tensors inside the 1-D uint8 `flat`, each `(byte offset, dtype, shape)`: one
    `as_strided` each over a dtype view of the whole storage (bounds are checked by torch)."""
    storage, base = flat.untyped_storage(), flat.storage_offset()
    whole: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for start, dtype, shape in layout:
        offset, size = base + start, dtype.itemsize
        if offset % size:
            raise SharedTensorError(f"byte offset {start} is not aligned for {dtype}")
        typed = whole.get(dtype)
        if typed is None:
            typed = whole[dtype] = torch.empty(0, dtype=dtype, device=flat.device).set_(storage)
        try:
            views.append(typed.as_strided(shape, _strides(shape), offset // size))
        except RuntimeError as error:
            raise SharedTensorError(f"a tensor at byte {start}: {error}") from error
    return views


def check_targets(named: list[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor]) -> None:
    """Every name known, every shape equal, CUDA tensors on the parameter's own GPU."""
    for name, tensor in named:
        target = params.get(name)
        if target is None:
            raise SharedTensorError(f"unknown parameter name {name!r}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise SharedTensorError(
                f"shape mismatch for {name!r}: engine {tuple(target.shape)}, "
                f"trainer {tuple(tensor.shape)}"
            )
        if tensor.is_cuda and tensor.device != target.device:
            raise SharedTensorError(
                f"the trainer's {name!r} is on {tensor.device} (GPU "
                f"{device_uuid(tensor.device.index)}) but this engine's weights are on "
                f"{target.device}: CUDA IPC needs the engine on the trainer's GPU; use the "
                "broadcast or disk transport otherwise"
            )


class _HeldStorages:
    """The trainer buffers this engine mapped most recently, kept open (a strong reference), so
    the next update through the same buffers finds them in torch's cache instead of opening
    the handle again. At most `HELD_STORAGES`; older ones are let go."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._storages: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._lock = threading.Lock()

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        with self._lock:
            for tensor in tensors:
                storage = tensor.untyped_storage()
                key = (str(storage.device), storage.data_ptr())
                self._storages[key] = storage
                self._storages.move_to_end(key)
            while len(self._storages) > self.limit:
                self._storages.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._storages.clear()

    def __len__(self) -> int:
        return len(self._storages)


held = _HeldStorages(HELD_STORAGES)


def finish_receive(named: list[tuple[str, torch.Tensor]]) -> None:
    """After the copy: wait for it on every GPU involved (the trainer reuses the buffer once the
    engine answers), then keep the mapped buffers open for the next update."""
    for device in {t.device for _, t in named if t.is_cuda}:
        torch.cuda.synchronize(device)
    held.hold(t for _, t in named)
