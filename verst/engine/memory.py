"""An idle engine's device memory, released while a colocated trainer trains and taken back
after (`placement.sleep_engines`; SGLang's `/release_memory_occupation` and
`/resume_memory_occupation`, with its tags).

Every tensor keeps its storage object: release shrinks the storage to nothing (`resize_(0)`,
as FSDP2 frees its gathered parameters) and resume grows it back. Views of a storage (the
pool's page views, parameters that view a packed buffer) stay valid, at a new address, so the
CUDA graphs, which hold addresses, are dropped and captured again at the next decode. The KV
cache comes back empty (the prefix cache is reset) and the weights with undefined values: a
weight update must follow their resume before the engine generates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from verst.engine.kv_pool import KVPool
from verst.engine.model_runner import ModelRunner
from verst.engine.radix_cache import RadixCache

TAGS = ("kv_cache", "weights", "cuda_graph")


class EngineMemory:
    """What of an engine's device memory is released, by tag. `requests` counts the requests
    the engine holds (running or waiting)."""

    def __init__(
        self,
        runner: ModelRunner,
        pool: KVPool,
        cache: RadixCache | None,
        requests: Callable[[], int],
    ) -> None:
        self.runner, self.pool, self.cache, self.requests = runner, pool, cache, requests
        self.released: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}

    def release(self, tags: Iterable[str] = TAGS) -> int:
        """Free the memory of `tags` (kv_cache, weights, cuda_graph); the bytes freed. The
        engine must be idle: its requests' KV would go with the cache."""
        tags = _checked(tags)
        busy = self.requests()
        if busy:
            raise RuntimeError(
                f"release_memory_occupation needs an idle engine; {busy} requests are in it"
            )
        if self.cache is not None:
            self.cache.reset()
        self.runner.drop_graphs()  # they read the KV pool and weights by address
        freed = 0
        for tag in tags:
            if tag in self.released or tag == "cuda_graph":
                continue
            storages = [(s, s.nbytes()) for s in _unique(self._tensors(tag)) if s.nbytes()]
            for storage, _ in storages:
                storage.resize_(0)
            self.released[tag] = storages
            freed += sum(nbytes for _, nbytes in storages)
        if self.pool.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def resume(self, tags: Iterable[str] = TAGS) -> None:
        """Take back the memory of `tags`; released weights hold no values until updated."""
        for tag in _checked(tags):
            for storage, nbytes in self.released.pop(tag, []):
                storage.resize_(nbytes)

    def _tensors(self, tag: str) -> Iterator[torch.Tensor]:
        if tag == "weights":
            yield from self.runner.model.parameters()
            yield from self.runner.quantized_tensors()
            return
        pool = self.pool
        yield from pool.k
        yield from pool.v
        if pool.routed is not None:
            yield pool.routed


def _checked(tags: Iterable[str]) -> list[str]:
    tags = list(tags)
    unknown = set(tags) - set(TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; known: {', '.join(TAGS)}")
    return tags


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(storage._cdata, storage)  # the storage itself; wrappers are made anew
    return list(seen.values())
