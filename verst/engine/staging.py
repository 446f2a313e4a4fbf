"""Host staging buffers for a step's inputs on their way to the device.

Owns `StagingRing`: a few host buffers used in turn. On CUDA they are pinned, so the copy to
the device is truly asynchronous, and a buffer is written again only once the copy that last
read it has run (an event per buffer): with overlapped steps (`verst.engine.overlap`) the host
builds step N+1's inputs while step N's copy may still wait behind step N-1 on the stream, and
rewriting that very buffer would race the copy. Two buffers suffice, since the host never runs
more than one step ahead. On the CPU the buffers are plain tensors and the copy is immediate.
"""

from __future__ import annotations

import torch


class StagingRing:
    def __init__(
        self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, depth: int = 2
    ) -> None:
        self.pinned = device.type == "cuda"
        # flat: each copy stages into a contiguous prefix (a strided pinned source would be
        # copied through a pageable temporary, losing the asynchronous copy)
        numel = shape[0] * shape[1]
        self._buffers = [
            torch.empty(numel, dtype=dtype, pin_memory=self.pinned) for _ in range(depth)
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0

    def copy_to(self, target_B_M: torch.Tensor, values_B_M: torch.Tensor) -> None:
        """Copy host `values_B_M` (at most `shape`'s elements) into `target_B_M` (its shape, on
        the device) through the next buffer, asynchronously on CUDA."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        copied = self._copied[i]
        if copied is not None:
            copied.synchronize()  # the copy that last read this buffer has run
        staged_B_M = self._buffers[i][: values_B_M.numel()].view(values_B_M.shape)
        staged_B_M.copy_(values_B_M)
        target_B_M.copy_(staged_B_M, non_blocking=self.pinned)
        if self.pinned:
            copied = copied or torch.cuda.Event()
            copied.record()  # on the current stream, after the copy
            self._copied[i] = copied
