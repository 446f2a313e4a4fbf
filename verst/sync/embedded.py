"""Weight sync for the embedded engine: a `Scheduler` the trainer calls directly, in its own
process and on its own device, whatever `sync.transport` says.

When a rank holds whole parameters (a world of one) in the engine's dtype, the engine's
parameters are re-pointed at the trainer's storage once (`verst.sync.colocated.share_storage`),
and every later update is only a version bump: the optimiser writes the very tensors the engine
reads. Otherwise each push gathers full tensors bucket by bucket and copies them into the
engine: with LoRA only the adapters, since the engine holds the same frozen base and applies
the adapters in its own forward; with multi-LoRA the engine holds the frozen base and takes the
adapters the last step trained into its adapter registry. `sync/bytes` is what a push copied
(0 when zero-copy), `perf/sync_send_time_s` how long it took.
Either way the prefix cache, which holds KV of the old weights, is dropped. The loop is
synchronous, so the engine is idle during a push: there is nothing to pause, and the version
protocol of serving engines (`verst.sync.protocol`) is not needed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from verst.engine import Scheduler
from verst.models.lora import LoraConfig, is_adapter
from verst.sync.buckets import AdapterTensors, bucketed
from verst.sync.colocated import share_storage
from verst.train.trainer import Trainer


class EmbeddedSync:
    def __init__(
        self,
        trainer: Trainer,
        engine: Scheduler,
        *,
        bucket_bytes: int = 512 << 20,
        lora: LoraConfig | None = None,
    ) -> None:
        self.trainer = trainer
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.multi_lora = lora is not None and bool(lora.adapters)
        self.lora = lora
        self.zero_copy = False if self.multi_lora else share_storage(trainer, engine.model)
        self._adapters: dict[str, AdapterTensors] = {}

    def push(self, version: int) -> dict[str, float]:
        """Make the engine generate with the trainer's current weights, stamped `version`."""
        sent_bytes = 0
        started = time.perf_counter()
        if self.multi_lora:
            sent_bytes = self._push_adapters()
        elif not self.zero_copy:
            dtype = next(self.engine.model.parameters()).dtype
            # with LoRA only the adapters are taken: each tensor taken is a gather under FSDP
            keep = is_adapter if self.trainer.lora else None
            named = self.trainer.full_parameters(dtype, keep=keep)
            for bucket in bucketed(named, self.bucket_bytes):
                sent_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                self.engine.update_weights_from_tensors(bucket, version)
        self.engine.set_weight_version(version)
        self.engine.weights_changed()
        return {
            "sync/bytes": float(sent_bytes),
            "perf/sync_send_time_s": time.perf_counter() - started,
        }

    @contextmanager
    def sleeping(self) -> Iterator[dict[str, float]]:
        """`placement.sleep_engines`: the engine's KV cache, CUDA graphs and (unless they are
        the trainer's own tensors) weights give their device memory back inside, for the
        trainer; after, the memory returns and a `push` must follow before the engine
        generates. The dict it yields gets `perf/engine_released_bytes`."""
        tags = ["kv_cache", "cuda_graph"] + ([] if self.zero_copy else ["weights"])
        metrics = {"perf/engine_released_bytes": float(self.engine.memory.release(tags))}
        try:
            yield metrics
        finally:
            self.engine.memory.resume(tags)

    def _push_adapters(self) -> int:
        """Multi-LoRA: the adapters the last step trained (all of them before the first) into
        the engine's adapter registry, beside the frozen base it holds; the bytes copied."""
        assert self.lora is not None
        dtype = next(self.engine.model.parameters()).dtype
        sent = 0
        for name in self.trainer.stepped_adapters or self.lora.names:
            if name not in self._adapters:
                trainable = self.trainer.trainable_parameters
                self._adapters[name] = AdapterTensors(trainable, dtype, name)
            tensors = dict(self._adapters[name]())
            sent += sum(t.numel() * t.element_size() for t in tensors.values())
            self.engine.load_adapter(name, self.lora.wire_config(), tensors, "trainer")
        return sent
