"""The weight-update half of `ServingEngine`: new weights from disk, from tensors, from shared
memory or CUDA IPC handles, and over a torch.distributed group, each installed between two
scheduler steps with a new version stamped; plus reading a weight back and the version alone.
Each path can carry a LoRA adapter instead (`lora_name`, for the engine's adapter registry),
and adapters load from and unload to peft directories (`load_lora_adapter`).

`WeightUpdates` is a base class of `ServingEngine` and uses its state (the scheduler, the
serving loop's lock and condition, the queue); it exists so each file reads as one job: the
request path in `serving.py`, the weight path here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from verst.engine.adapters import AdapterError, read_adapter_dir
from verst.engine.weight_loading import checkpoint_files, checkpoint_tensors, load_published
from verst.engine.weight_paths import allowed_weight_path, load_quietly
from verst.engine.weight_paths import refusal as weight_path_refusal
from verst.sync.broadcast import (
    BucketOutOfStep,
    FlatBuffer,
    TrainerAborted,
    create_group,
    header_device,
    receive_bucket,
    receive_header,
)
from verst.sync.buffer_layouts import BufferEntry, LayoutRegistry, UnknownLayouts
from verst.sync.shared_tensors import SharedTensorError

logger = logging.getLogger("verst.engine.serving")

GROUP_JOIN_TIMEOUT_S = 30.0


class BoundedJoins:
    """A one-thread executor for blocking rendezvous calls, busy while one runs (a call that
    timed out keeps it busy until its own store timeout ends the thread)."""

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "verst-group-join")
        self._running: concurrent.futures.Future | None = None

    @property
    def busy(self) -> bool:
        return self._running is not None and not self._running.done()

    async def run(self, call: Callable[[], Any], timeout_s: float) -> Any:
        self._running = self._executor.submit(call)
        return await asyncio.wait_for(asyncio.wrap_future(self._running), timeout_s)


class WeightUpdates:
    # Roots `update_weights_from_disk` may read under (`verst.engine.weight_paths`); None: any.
    allowed_weight_dirs: tuple[Path, ...] | None = None
    group_join_timeout_s: float = GROUP_JOIN_TIMEOUT_S  # `init_weights_update_group`'s limit
    _joins: BoundedJoins | None = None
    _layouts: LayoutRegistry | None = None  # the trainer's staging-buffer layouts, by id
    _received: FlatBuffer | None = None  # every broadcast bucket of model weights lands here

    def _group_joins(self) -> BoundedJoins:
        if self._joins is None:
            self._joins = BoundedJoins()
        return self._joins

    async def update_weight_version(self, new_version: str, *, abort_all: bool = True) -> None:
        if abort_all:
            await self.abort(None, abort_all=True, message="Abort by update_weight_version.")
        lock = self._engine_lock
        assert lock is not None
        async with lock:  # a running batch keeps the version it started with
            self._set_version(str(new_version))

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        """Load every `*.safetensors` tensor of an HF directory (or one file) into the model.

        Names and shapes are all checked before the first copy, so a bad checkpoint leaves the
        weights and the version untouched.
        """
        path = allowed_weight_path(model_path, self.allowed_weight_dirs)
        if path is None:
            return False, weight_path_refusal(model_path)
        if abort_all_requests:
            await self.abort(None, abort_all=True, message="Abort by update_weights_from_disk.")
        ok, message = await self._update_weights(
            lambda: load_quietly(lambda: self._load_from_disk(str(path)), model_path),
            weight_version,
        )
        if ok:
            self.model_path = model_path
        return ok, message

    async def update_weights_from_tensors(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        *,
        lora_name: str | None = None,
        lora_config: dict[str, Any] | None = None,
    ) -> tuple[bool, str]:
        """Copy in-process tensors into the model (the in-process transport of weight sync);
        with `lora_name`, they are that LoRA adapter's, for the adapter registry."""

        def copy() -> tuple[bool, str]:
            if lora_name is not None:
                return self._load_adapter(lora_name, lora_config, dict(named_tensors), "tensors")
            self.scheduler.update_weights_from_tensors(named_tensors, self.scheduler.weight_version)
            return True, "Succeeded to update model weights."

        return await self._update_weights(copy, weight_version)

    async def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """SGLang's `/load_lora_adapter`: hold the peft adapter directory `path` as `name` (or
        replace the weights of the adapter held as `name`), between two steps."""
        allowed = allowed_weight_path(path, self.allowed_weight_dirs)
        if allowed is None:
            return False, weight_path_refusal(path)

        def load() -> tuple[bool, str]:
            try:
                config, tensors = read_adapter_dir(allowed)
            except AdapterError as error:
                return False, str(error)
            return self._load_adapter(name, config, tensors, path)

        return await self._update_weights(load, None)

    async def unload_lora_adapter(self, name: str) -> tuple[bool, str]:
        def unload() -> tuple[bool, str]:
            try:
                self.scheduler.unload_adapter(name)
            except AdapterError as error:
                return False, str(error)
            return True, f"Unloaded LoRA adapter {name!r}."

        return await self._update_weights(unload, None)

    def loaded_adapters(self) -> dict[str, str]:
        """The adapters held, by name: where each came from (a path, or "tensors")."""
        registry = self.scheduler.runner.adapters
        return registry.loaded() if registry is not None else {}

    def _load_adapter(
        self, name: str, config: Any, tensors: dict[str, torch.Tensor], source: str
    ) -> tuple[bool, str]:
        try:
            self.scheduler.load_adapter(name, config, tensors, source)
        except AdapterError as error:
            return False, str(error)
        return True, f"Loaded LoRA adapter {name!r}."

    async def update_weights_from_shared(
        self,
        payload: str | bytes,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        lora_name: str | None = None,
        lora_config: dict[str, Any] | None = None,
    ) -> tuple[bool, str]:
        """Copy tensors another process shares (CUDA IPC handles or /dev/shm files, pickled as
        SGLang's `/update_weights_from_tensor` carries them) into the model in place, or with
        `lora_name` into that LoRA adapter.

        Names, shapes and devices are all checked before the first copy; the copy is complete
        (CUDA synchronised) when this returns, so the trainer may reuse its buffers."""
        from verst.sync import shared_tensors

        params = self.scheduler.parameters()

        def load() -> tuple[bool, str]:
            try:
                named = shared_tensors.named_tensors_from_payload(payload, load_format)
                if lora_name is None:
                    shared_tensors.check_targets(named, params)
            except shared_tensors.SharedTensorError as error:
                return False, str(error)
            if lora_name is not None:
                ok, message = self._load_adapter(lora_name, lora_config, dict(named), "tensors")
                shared_tensors.finish_receive(named)
                return ok, message
            with torch.no_grad():  # one multi-tensor copy for the bucket
                torch._foreach_copy_([params[n] for n, _ in named], [t for _, t in named])
            self.scheduler.weights_changed()
            shared_tensors.finish_receive(named)
            return True, "Succeeded to update model weights."

        return await self._update_weights(load, weight_version)

    async def update_weights_from_buffers(
        self,
        entries: list[BufferEntry],
        *,
        pause_mode: str | None,
        flush_cache: bool,
        weight_version: str | None,
        continue_generation: bool,
        release_layouts: list[str] | None = None,
    ) -> tuple[bool, str]:
        """verst's whole-update request (`verst.sync.buffer_layouts`): copy the trainer's staging
        buffers in, named by layout ids; pause in `pause_mode` first, flush the prefix cache,
        stamp `weight_version` and continue generation, as the protocol's separate calls do.

        Why one request is as safe as the six calls: everything from the pause taking effect to
        the version stamp runs under the engine lock, i.e. between two scheduler steps, so no
        step sees part of the new weights, and each token is stamped with the version of the
        weights that produced it (`Scheduler.step`). The pause mode still acts on the running
        requests (retract: their KV, computed with the old weights, is dropped by the flush and
        recomputed; abort: they end; in_place: they keep it), exactly as `/pause_generation`.
        Layouts are resolved before anything changes: an unknown one (raises `UnknownLayouts`)
        or a bad payload (answers False) leaves the engine as it was."""
        params = self.scheduler.parameters()
        resolve = functools.partial(
            self._layout_registry().resolve, entries, params, release_layouts or ()
        )
        try:  # a new payload opens a mapping, on a thread; held layouts are a lookup
            opens = any(e.payload is not None for e in entries)
            layouts = await asyncio.to_thread(resolve) if opens else resolve()
        except UnknownLayouts:
            raise
        except SharedTensorError as error:
            return False, str(error)
        if pause_mode is not None:
            await self.pause(pause_mode)

        def load() -> tuple[bool, str]:
            if flush_cache and not self.scheduler.flush_cache():
                return False, "flush_cache refused: paused in place, requests hold KV pages"
            targets = [t for layout in layouts for t in layout.targets]
            with torch.no_grad():  # one multi-tensor copy for every buffer
                torch._foreach_copy_(targets, [v for layout in layouts for v in layout.views])
            self.scheduler.weights_changed()
            for device in {t.device for t in targets if t.is_cuda}:
                torch.cuda.synchronize(device)  # the trainer refills the buffers once answered
            return True, "Succeeded to update model weights."

        ok, message = await self._update_weights(load, weight_version)
        if ok and continue_generation:
            await self.resume()
        return ok, message

    def _receive_buffer(self) -> FlatBuffer:
        if self._received is None:
            self._received = FlatBuffer()
        return self._received

    def _layout_registry(self) -> LayoutRegistry:
        if self._layouts is None:
            self._layouts = LayoutRegistry()
        return self._layouts

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list | None:
        """SGLang's test helper: the parameter as float32 nested lists, its first
        `truncate_size` rows (None for an unknown name). Read between two steps."""
        param = self.scheduler.parameters().get(name)
        if param is None:
            return None
        lock = self._engine_lock
        assert lock is not None
        async with lock:
            return await asyncio.to_thread(
                lambda: param.detach().to("cpu", torch.float32).tolist()[:truncate_size]
            )

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> tuple[bool, str]:
        """Join the trainer's weight-update group as rank `rank_offset` (blocks until all join)."""
        # One join at a time, on a thread of its own: joins that hang on a dead address must
        # never take the threads the serving loop steps the scheduler on.
        joins = self._group_joins()
        if joins.busy:
            return False, "another weights update group join is in progress"
        join = functools.partial(
            create_group,
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            backend=backend,
            group_name=group_name,
            connect_timeout_s=self.group_join_timeout_s,
        )
        try:
            self._groups[group_name] = await joins.run(join, self.group_join_timeout_s)
        except TimeoutError:
            return False, (
                f"Failed to init weights update group {group_name!r}: no rendezvous within "
                f"{self.group_join_timeout_s:g} s"
            )
        except (RuntimeError, ValueError) as error:
            return False, f"Failed to init weights update group {group_name!r}: {error}"
        return True, f"Joined weights update group {group_name!r} as rank {rank_offset}."

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        if self._groups.pop(group_name, None) is None:
            return False, f"no weights update group {group_name!r}"
        return True, f"Destroyed weights update group {group_name!r}."

    async def update_weights_from_distributed(
        self,
        specs: list,
        *,
        group_name: str,
        flattened: bool,
        weight_version: str | None = None,
        lora_name: str | None = None,
        lora_config: dict[str, Any] | None = None,
    ) -> tuple[bool, str]:
        """Receive one bucket (`specs`: `TensorSpec`s) broadcast by the trainer (rank 0): model
        weights, or with `lora_name` the whole of that LoRA adapter."""
        group = self._groups.get(group_name)
        if group is None:
            return False, f"no weights update group {group_name!r}: call init first"
        params = self.scheduler.parameters()
        unknown = [s.name for s in specs if s.name not in params]
        if unknown and lora_name is None:
            return False, f"unknown parameter names {unknown}"
        device = next(iter(params.values())).device

        def load() -> tuple[bool, str]:
            # received whatever its names: the trainer's side of the broadcast is under way
            # an adapter's tensors are kept as they arrive: a buffer of their own
            into = self._receive_buffer() if lora_name is None else None
            received = receive_bucket(group, specs, device, flattened=flattened, into=into)
            if lora_name is not None:
                return self._load_adapter(lora_name, lora_config, dict(received), "tensors")
            self.scheduler.update_weights_from_tensors(received, self.scheduler.weight_version)
            return True, "Succeeded to update model weights."

        return await self._update_weights(load, weight_version)

    async def update_weights_whole_from_distributed(
        self,
        *,
        group_name: str,
        pause_mode: str | None,
        flush_cache: bool,
        weight_version: str | None,
        continue_generation: bool,
    ) -> tuple[bool, str]:
        """verst's whole update over the broadcast group (`verst.sync.broadcast`): pause in
        `pause_mode`, flush the prefix cache, receive and install every bucket the trainer
        broadcasts (each behind its header) until its end, stamp `weight_version` and continue,
        all between two scheduler steps as in `update_weights_from_buffers`.

        Every bucket is received whatever happens, so the trainer's broadcasts always complete:
        a bucket with unknown names or other shapes (or a refused flush) is received and
        dropped, the rest of the update too, and the answer is False with the engine still
        paused and its version unchanged (the buckets before it are installed). A bucket that
        does not end with its header's tag (`BucketOutOfStep`: this engine and the trainer fell
        out of step) ends the update there, answered the same way, none of it installed."""
        group = self._groups.get(group_name)
        if group is None:
            return False, f"no weights update group {group_name!r}: call init first"
        device = next(iter(self.scheduler.parameters().values())).device
        if pause_mode is not None:
            await self.pause(pause_mode)

        headers = header_device(group, device)

        def load() -> tuple[bool, str]:
            refusal = None
            if flush_cache and not self.scheduler.flush_cache():
                refusal = "flush_cache refused: paused in place, requests hold KV pages"
            last = False
            while not last:
                specs, last, tag = receive_header(group, headers)
                if not specs:
                    continue
                received = receive_bucket(
                    group, specs, device, flattened=True, into=self._receive_buffer(), tag=tag
                )
                if refusal is None:
                    try:
                        self.scheduler.update_weights_from_tensors(
                            received, self.scheduler.weight_version
                        )
                    except (KeyError, ValueError) as error:
                        refusal = str(error)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # answered = installed
            return (False, refusal) if refusal else (True, "Succeeded to update model weights.")

        try:
            ok, message = await self._update_weights(load, weight_version)
        except (TrainerAborted, BucketOutOfStep) as error:
            return False, str(error)
        if ok and continue_generation:
            await self.resume()
        return ok, message

    async def _update_weights(
        self, load: Callable[[], tuple[bool, str]], weight_version: str | None
    ) -> tuple[bool, str]:
        """Run `load` between two steps: at once when paused, else after the requests already
        submitted have finished (new ones wait); then stamp `weight_version`."""
        cond, lock = self._started(), self._engine_lock
        assert lock is not None
        async with cond:
            self._updating += 1
            cond.notify_all()
            await cond.wait_for(lambda: self._paused or (not self._queue and not self._running))
        try:
            async with lock:
                self._apply_control()
                ok, message = await asyncio.to_thread(load)
                if ok and weight_version is not None:
                    self._set_version(str(weight_version))
                return ok, message
        finally:
            async with cond:
                self._updating -= 1
                cond.notify_all()

    def _set_version(self, version: str) -> None:
        # requests an overlapped step finished, not yet returned, ended under the old version
        self._resolve(self.scheduler.drain(), self.weight_version)
        self.weight_version = version
        # The engine's own counter is an int; keep it in step when the version is one.
        self.scheduler.set_weight_version(
            int(version) if version.lstrip("-").isdigit() else version
        )

    def _load_from_disk(self, model_path: str) -> tuple[bool, str]:
        path = Path(model_path).expanduser()
        if (path / "manifest.json").is_file():  # a directory of the disk transport
            target = dict(self.scheduler.model.named_parameters())
            ok, message, version = load_published(target, path, self._published_version)
            if ok:
                self._published_version = version
                self.scheduler.weights_changed()
            return ok, message
        files, problem = checkpoint_files(path, self.scheduler.parameters())
        if problem:
            return False, problem
        self.scheduler.update_weights_from_tensors(
            checkpoint_tensors(files), self.scheduler.weight_version
        )
        self._published_version = None  # a plain checkpoint is no base for the next delta
        return True, "Succeeded to update model weights."
