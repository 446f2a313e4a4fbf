"""Overlapped decode steps: the host launches decode step N+1 while the device still runs step N,
and reads step N's sampled tokens one step late.

In the steady state of a rollout every running request feeds one token a step. Run in turn,
each step's host work (planning, the meta tensor, the tokens' host sync and the per-request
bookkeeping) leaves the device idle. Overlapped, a decode step's sampled tokens stay on the
device (`PendingStep`); the next step is planned and launched at once, its token column
gathered on the device from those tokens (`ModelRunner.forward(rows, sampled_B)`), and only
then does the host read step N's tokens and do its bookkeeping while the device runs N+1.

`OverlapSteps` is a part of `Scheduler` (it reads its running and waiting requests, pool,
cache and runner). Its boundary, checked on every step:

- a step stays pending only when it was decode-only: every running request fed one output
  token and sampled, none has a grammar (its mask needs the previous token on the host) and
  none asks for top-k or chosen-id log-probs (read on the host as they are sampled);
- the next step launches on a pending one only when no request would be admitted, every
  running request is in the pending step, and every row's next page can be had without
  retracting anyone. Rows whose pending token is their last (`max_new_tokens`) are not fed.
- anything else (prefill, an arrival, retraction, pause, abort, weight, version or adapter
  changes) first completes the pending step (`drain`) and then runs synchronously.

Penalties (their counts are updated on the device), stop tokens and strings (checked on the
host when the tokens are read), per-request seeds (each row draws from its own generator once
a step, as it would synchronously), adapters and routed-expert capture run overlapped.

Why the lag is safe: a request that finished at step N (EOS, a stop string) was already fed
into N+1. Its extra token is dropped when N+1 is read; its KV of that token went to a page
reserved for it, and on finishing its length is cut back to its own tokens
(`Running.computed`), so the prefix cache takes only pages of tokens it really has. Pages it
gives back are reused only by later steps, which the device runs after N+1 (one stream).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verst.engine.model_runner import ModelRunner, Row
from verst.engine.requests import GenerateOutput
from verst.engine.running import Running
from verst.engine.stats import SchedulerStats

if TYPE_CHECKING:
    from verst.engine.kv_pool import KVPool
    from verst.engine.radix_cache import RadixCache


@dataclass
class PendingStep:
    """A launched step whose sampled tokens the host has not read: row i of `tokens_B` and
    `logprobs_B` (on the device) is `rows[i]`'s. `pending_step` starts their copy to the host
    as the step is launched."""

    rows: list[Running]
    tokens_B: torch.Tensor
    logprobs_B: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor]  # the same, on their way to the host
    copied: torch.cuda.Event | None  # recorded after that copy, on CUDA
    gone: set[int] = field(default_factory=set)  # id() of rows that finished before it is read

    def live(self) -> list[tuple[int, Running]]:
        return [(i, r) for i, r in enumerate(self.rows) if id(r) not in self.gone]

    def read(self) -> tuple[list[int], list[float]]:
        """The sampled tokens and their log-probs, waiting for this step alone: a `tolist()` of
        the device tensors would wait behind the step launched after it on the stream."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host[0].tolist(), self.host[1].tolist()


def pending_step(
    rows: list[Running], tokens_B: torch.Tensor, logprobs_B: torch.Tensor
) -> PendingStep:
    """A step left pending, its tokens' copy to (pinned) host memory queued right behind it."""
    if not tokens_B.is_cuda:
        return PendingStep(rows, tokens_B, logprobs_B, (tokens_B, logprobs_B), None)
    host = (tokens_B.to("cpu", non_blocking=True), logprobs_B.to("cpu", non_blocking=True))
    copied = torch.cuda.Event()
    copied.record()
    return PendingStep(rows, tokens_B, logprobs_B, host, copied)


@dataclass
class StepWork:
    """What one `Scheduler.step` call did, for its stats and trace span."""

    requests: int = 0  # requests fed
    tokens: int = 0  # tokens fed
    taken: int = 0  # sampled tokens read and appended

    @property
    def ran(self) -> bool:
        return bool(self.requests or self.taken)


def may_overlap(r: Running) -> bool:
    """Whether r's decode steps may run overlapped: it needs no host token before sampling."""
    return r.grammar is None and r.extras is None


class OverlapSteps:
    running: list[Running]
    waiting: deque[Running]
    max_running: int
    pool: KVPool
    cache: RadixCache | None
    runner: ModelRunner
    overlap: bool
    stats: SchedulerStats
    _pending: PendingStep | None
    _finished_early: list[GenerateOutput]

    if TYPE_CHECKING:  # the scheduler's

        def _sample(
            self, rows: list[Running], logits_B_V: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]: ...

        def _take_tokens(
            self, rows: list[Running], tokens: list[int], logprobs: list[float]
        ) -> list[GenerateOutput]: ...

        def _remaining(self, r: Running) -> int: ...

    def _may_stay_pending(self, batch: list[tuple[Running, int]], rows: list[Running]) -> bool:
        """Whether a step just sampled may leave its tokens on the device: it was decode-only
        (every request fed one output token, all sampled) and no row needs host tokens."""
        if not self.overlap or len(rows) != len(batch):
            return False
        # computed > prompt_length: the token fed was an output token, not a prompt's last
        decode = all(n == 1 and r.computed > r.prompt_length for r, n in batch)
        return decode and all(may_overlap(r) for r in rows)

    def _advance(self, work: StepWork) -> tuple[list[GenerateOutput], bool]:
        """With a pending step: launch the next one on its tokens where the boundary allows,
        then read it. (finished requests, whether a step was launched)."""
        pending = self._pending
        if pending is None:
            return [], False
        following = self._launch_on(pending)
        if following is not None:
            work.requests = work.tokens = len(following.rows)
        self._pending = following
        work.taken += len(pending.live())
        finished = self._complete(pending, following)
        if following is not None and not following.live():
            self._pending = None  # it fed only requests that have finished since
        return finished, following is not None

    def _launch_on(self, pending: PendingStep) -> PendingStep | None:
        """Decode step N+1 launched on the tokens of step N (`pending`), still on the device;
        None, having launched nothing, where N+1 falls outside the boundary."""
        live = pending.live()
        if self.waiting and len(self.running) < self.max_running:
            return None  # a request is admitted: a synchronous step
        if len(live) != len(self.running):
            return None
        fed = [(i, r) for i, r in live if self._remaining(r) > 1]  # the pending token not its last
        if not fed or not all(self._reserve_in_place(r, r.computed + 1) for _, r in fed):
            return None
        rows = [
            Row(tokens=[0], past=r.computed, pages=r.pages, adapter=r.adapter, source=i)
            for i, r in fed
        ]
        logits_B_V, _ = self.runner.forward(rows, sampled_B=pending.tokens_B)
        requests = [r for _, r in fed]
        tokens_B, logprobs_B = self._sample(requests, logits_B_V)
        for r in requests:  # last: a launch that raised left the requests as they were
            r.computed += 1
        return pending_step(requests, tokens_B, logprobs_B)

    def _reserve_in_place(self, r: Running, length: int) -> bool:
        """Make r's pages cover `length` tokens, evicting cached pages but retracting no one
        (retraction would drop a pending token); False when the pool is too short."""
        missing = -(-length // self.pool.page_size) - len(r.pages)
        if missing <= 0:
            return True
        short = missing - self.pool.num_free()
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        if missing > self.pool.num_free():
            return False
        r.pages += self.pool.alloc(missing)
        return True

    def _complete(
        self, pending: PendingStep, following: PendingStep | None
    ) -> list[GenerateOutput]:
        """Read the pending step's tokens (its host sync) and append them; a request that
        finishes is marked gone in `following`, which fed it already."""
        tokens, logprobs = pending.read()
        live = pending.live()
        finished = self._take_tokens(
            [r for _, r in live], [tokens[i] for i, _ in live], [logprobs[i] for i, _ in live]
        )
        if following is not None and finished:
            running = {id(r) for r in self.running}
            following.gone |= {id(r) for r in following.rows if id(r) not in running}
        return finished

    def drain(self) -> list[GenerateOutput]:
        """Read the pending step now and return every request that ended since the last step
        returned (a caller about to change the version resolves them under the old one)."""
        self._settle()
        finished, self._finished_early = self._finished_early, []
        return finished

    def _settle(self) -> None:
        """Read the pending step, if there is one, before anything changes the running
        requests, the weights or the version; the requests it finished are returned by the
        next step (or by `pause`)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        start_s = time.perf_counter()
        taken = len(pending.live())
        self._finished_early += self._complete(pending, None)
        self.stats.record_step(time.perf_counter() - start_s, taken)
