"""The async serving core: request queue, continuous batching, abort, pause, weight updates.

Owns `ServingEngine`, which puts a continuous-batching `Scheduler` (paged KV, radix prefix
cache) and its tokenizer behind an async interface that the HTTP server and the in-process
client share. One background task hands new requests to the scheduler and runs its steps in a
worker thread, so the event loop keeps serving; requests join and leave at every step. Results
come back shaped as SGLang's `/generate` items (`text`, `output_ids`, `meta_info`).

Promises (SGLang's semantics):
- while paused, new `generate` calls wait (they are not rejected); `abort` mode aborts every
  queued and running request, `retract` requeues running requests (their KV goes to the prefix
  cache and is recomputed on return), `in_place` freezes them with their KV;
- an aborted request returns at once with `finish_reason.type == "abort"` and the tokens it
  had so far, with their log-probs (a token a step is sampling meanwhile is left out);
- weights change only between steps; a request running across an update keeps its KV and
  finishes with the new version stamped;
- an un-paused disk update waits for the requests already submitted, and holds new ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from verst.engine import request_checks
from verst.engine.adapters import DEFAULT_MAX_ADAPTERS
from verst.engine.config import Quantization
from verst.engine.metrics import EngineMetrics
from verst.engine.requests import GenerateOutput, GenerateRequest
from verst.engine.results import DetokenizeParams, GenerateResult, ResultShaper
from verst.engine.sampling import SamplingParams
from verst.engine.scheduler import Scheduler
from verst.engine.streaming import StreamState
from verst.engine.weight_updates import WeightUpdates

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


@dataclass
class _Pending:
    request: GenerateRequest
    detokenize: DetokenizeParams
    submitted_s: float
    future: asyncio.Future[GenerateResult] = field(repr=False)
    handle: Any = None  # the scheduler's handle, once submitted (`Scheduler.output_so_far`)
    stream: StreamState | None = None  # a streamed request's output so far


def context_length(config: Any) -> int:
    """The longest sequence the engine serves: the model's positions (sliding windows are
    applied inside attention, so they do not bound it). 0 when the config does not say."""
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def vocab_size(model: Any) -> int:
    """Rows of the input embedding (the ids a prompt may use); 0 when the model does not say."""
    try:
        return int(model.get_input_embeddings().weight.shape[0])
    except (AttributeError, TypeError, IndexError):
        return int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)


# Serving engines of one process on one CUDA device step one at a time: two engines capturing
# CUDA graphs (or one stepping while the other captures) on one device invalidate the capture.
_CUDA_STEP_LOCKS: dict[torch.device, threading.Lock] = {}


def _step_lock(device: torch.device) -> threading.Lock | None:
    if device.type != "cuda":
        return None
    return _CUDA_STEP_LOCKS.setdefault(torch.device("cuda", device.index or 0), threading.Lock())


class ServingEngine(WeightUpdates):
    """A `Scheduler` behind an async queue; create and use it inside one event loop."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        *,
        batch_wait_s: float = 0.002,
        model_path: str = "",
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.results = ResultShaper(tokenizer)
        self.max_batch_size = scheduler.max_running
        self.batch_wait_s = batch_wait_s
        self.model_path = model_path
        self.weight_version = str(scheduler.weight_version)
        self.context_len = context_length(getattr(scheduler.model, "config", None))
        self.vocab_size = vocab_size(scheduler.model)
        self.num_batches = 0  # scheduler steps so far; batching is observable in tests/metrics
        self._queue: dict[str, _Pending] = {}  # by rid, in arrival order
        self._running: dict[str, _Pending] = {}  # handed to the scheduler, by rid
        self._streams: dict[str, _Pending] = {}  # streamed requests in flight, by rid
        self._paused = False
        self._updating = 0
        self._control: list[Callable[[], object]] = []  # run by the loop between two steps
        self._published_version: int | None = None  # the disk transport's base for deltas
        self._groups: dict[str, Any] = {}  # weight-update process groups, by name
        self._cond: asyncio.Condition | None = None
        self._engine_lock: asyncio.Lock | None = None
        self._task: asyncio.Task[None] | None = None
        self.metrics = EngineMetrics(
            scheduler,
            model_name=model_path,
            queued=lambda: len(self._queue),
            weight_version=lambda: self.weight_version,
        )

    @classmethod
    def from_model_dir(
        cls,
        model_path: str,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 256,
        batch_wait_s: float = 0.002,
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
        true_on_policy: bool = False,
        quantization: Quantization = "none",
        overlap: bool | None = None,
    ) -> ServingEngine:
        """Load a local HF directory behind a scheduler that stops on the model's EOS ids.

        The KV pool takes `kv_cache_bytes`; by default half the free GPU memory on CUDA and
        256 MiB on the CPU.
        """
        from verst.models.loading import ModelConfig, load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(
            ModelConfig(path=model_path), seed=seed, dtype=dtype, device=device
        )
        return cls.from_model(
            model,
            tokenizer,
            seed=seed,
            max_batch_size=max_batch_size,
            batch_wait_s=batch_wait_s,
            kv_cache_bytes=kv_cache_bytes,
            page_size=page_size,
            model_path=model_path,
            max_adapters=max_adapters,
            true_on_policy=true_on_policy,
            quantization=quantization,
            overlap=overlap,
        )

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        seed: int = 0,
        max_batch_size: int = 256,
        batch_wait_s: float = 0.002,
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        model_path: str = "",
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
        true_on_policy: bool = False,
        quantization: Quantization = "none",
        overlap: bool | None = None,
    ) -> ServingEngine:
        """Serve a loaded model (its device and dtype); the scheduler stops on its EOS ids.
        It can hold up to `max_adapters` LoRA adapters (`load_lora_adapter`); `true_on_policy`:
        the batch-invariant forward, `quantization`: fp8 projections, `overlap`: overlapped
        decode steps (`Scheduler`)."""
        from verst.models.loading import eos_token_ids

        eos = eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        scheduler = Scheduler.for_model(
            model,
            eos_token_ids=eos,
            pad_token_id=pad,
            kv_cache_bytes=kv_cache_bytes,
            page_size=page_size,
            max_running=max_batch_size,
            seed=seed,
            max_adapters=max_adapters,
            tokenizer=tokenizer,
            true_on_policy=true_on_policy,
            quantization=quantization,
            overlap=overlap,
        )
        return cls(scheduler, tokenizer, batch_wait_s=batch_wait_s, model_path=model_path)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._cond = asyncio.Condition()
        self._engine_lock = asyncio.Lock()
        self._task = asyncio.create_task(self._loop(), name="verst-serving-loop")

    async def stop(self) -> None:
        if self._task is None:
            return
        await self.abort(None, abort_all=True, message="The server is shutting down.")
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    def _step(self) -> list[GenerateOutput]:
        """One scheduler step (on a worker thread), alone on its CUDA device in this process."""
        lock = _step_lock(self.scheduler.device)
        if lock is None:
            return self.scheduler.step()
        with lock:
            return self.scheduler.step()

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, int]:
        """Running = handed to the scheduler (admitted, or waiting there for KV pages)."""
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._queue)}

    def cache_stats(self) -> dict[str, float]:
        return self.scheduler.cache_stats()

    # ---- generation ------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str,
        return_logprob: bool,
        detokenize: DetokenizeParams | None = None,
        logprob_start_len: int = -1,
        lora_path: str | None = None,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """Queue one request and wait for its result (SGLang's `/generate` item shape);
        `lora_path` names the LoRA adapter it runs with (None: the base model)."""
        pending = await self._enqueue(
            GenerateRequest(
                list(input_ids),
                params,
                rid=rid,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                lora_path=lora_path,
                top_logprobs_num=top_logprobs_num,
                token_ids_logprob=token_ids_logprob,
                return_routed_experts=return_routed_experts,
            ),
            detokenize or DetokenizeParams(),
            stream=False,
        )
        try:
            # shield: a cancelled caller must not cancel the future the batch loop resolves.
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            await self._forget(pending)  # the caller left (its client disconnected)
            raise

    async def generate_stream(
        self,
        request: GenerateRequest,
        detokenize: DetokenizeParams | None = None,
    ) -> AsyncIterator[GenerateResult]:
        """Queue one request and yield its output as it is decoded: cumulative results with
        `finish_reason` null (at the first token, then every `detokenize.stream_interval`
        tokens, coalesced while the consumer is busy), then the final result, as `generate`
        returns it. A consumer that stops early (a client that disconnects) aborts the
        request; close the iterator (`contextlib.aclosing`) so that happens at once."""
        pending = await self._enqueue(request, detokenize or DetokenizeParams(), stream=True)
        stream = pending.stream
        assert stream is not None
        try:
            while True:
                await stream.ready.wait()  # set when a chunk is due, and when the request ends
                if pending.future.done():
                    break
                # the tokens of the steps the loop has seen, read while the next step runs
                # (`Running.output_since`): a token that ends the request is not one of them
                handle, start, end = pending.handle, len(stream.ids), stream.generated
                stream.pull(handle.output_since(start, 0, end=end, with_input=stream.wants_input))
                yield stream.chunk(self.weight_version)
            yield pending.future.result()
        finally:
            self._streams.pop(request.rid, None)
            if not pending.future.done():
                await self._forget(pending)

    async def _enqueue(
        self, request: GenerateRequest, detokenize: DetokenizeParams, *, stream: bool
    ) -> _Pending:
        """Check a request, wait while the engine is paused or updating, and queue it."""
        cond = self._started()
        submitted_s = time.perf_counter()
        request_checks.check_request(
            self.scheduler,
            self.vocab_size,
            request.input_ids,
            request.sampling_params,
            request.lora_path,
            top_logprobs_num=request.top_logprobs_num,
            token_ids_logprob=request.token_ids_logprob,
            return_routed_experts=request.return_routed_experts,
        )
        async with cond:
            await cond.wait_for(lambda: not self._paused and not self._updating)
            rid = request.rid
            if not self.rid_is_free(rid):
                raise ValueError(f"Duplicate request ID detected: {rid}")
            matcher = self.results.stop_matcher(detokenize)
            request.stop_check = None if matcher is None else matcher.check
            pending = _Pending(
                request, detokenize, submitted_s, asyncio.get_running_loop().create_future()
            )
            if stream:
                pending.stream = state = StreamState(request, detokenize, self.results)
                pending.future.add_done_callback(lambda _: state.ready.set())
                self._streams[rid] = pending
            self._queue[rid] = pending
            cond.notify_all()
        return pending

    async def _forget(self, pending: _Pending) -> None:
        """A caller left before its request ended: the request stops generating (its KV freed
        before the next step)."""
        cond, rid = self._started(), pending.request.rid
        async with cond:
            if self._queue.get(rid) is pending:
                del self._queue[rid]
            elif self._running.get(rid) is pending:
                del self._running[rid]
                self._control.append(lambda: self.scheduler.abort(rid, exact=True))
            cond.notify_all()

    def rid_is_free(self, rid: str) -> bool:
        """No request with this rid is in flight (SGLang answers a second one with a 400)."""
        return rid not in self._running and rid not in self._queue

    async def _loop(self) -> None:
        """Run steps until cancelled; no exception ends the loop (a dead loop would leave every
        caller waiting and /health failing)."""
        while True:
            try:
                await self._iteration()
            except Exception:
                logger.exception("serving loop: an iteration failed; serving goes on")
                await asyncio.sleep(self.batch_wait_s)

    async def _iteration(self) -> None:
        cond, lock = self._started(), self._engine_lock
        assert lock is not None
        async with cond:
            await cond.wait_for(
                lambda: (
                    bool(self._control)
                    or ((bool(self._queue) or self.scheduler.has_work()) and not self._paused)
                )
            )
            idle = not self._running and not self._control
        if idle:  # an idle engine waits a moment so a burst of requests starts together
            await asyncio.sleep(self.batch_wait_s)
        try:
            async with lock:
                async with cond:
                    # Aborts and pauses asked for so far reach the scheduler before the new
                    # arrivals do: an abort must only touch the requests it has answered.
                    self._apply_control()
                    self._submit_queue()
                if self._paused:
                    return
                version = self.weight_version
                self.num_batches += 1
                finished = await asyncio.to_thread(self._step)
        except Exception as error:  # the engine failed: every request in it fails
            logger.exception("serving loop: a step failed; failing the requests running in it")
            async with cond:
                for p in self._running.values():
                    if not p.future.done():
                        p.future.set_exception(error)
                self._running.clear()
                self.scheduler.abort(abort_all=True)
                cond.notify_all()
            return
        async with cond:
            self._resolve(finished, version)
            for p in self._streams.values():
                if p.handle is not None and p.stream is not None:
                    p.stream.poke(len(p.handle.tokens) - p.handle.prompt_length)
            cond.notify_all()

    def _submit_queue(self) -> None:
        """Hand the queued requests to the scheduler; one it refuses fails alone."""
        for p in self._queue.values():
            try:
                p.handle = self.scheduler.submit(p.request)
            except Exception as error:
                logger.warning("request %s refused by the scheduler: %r", p.request.rid, error)
                if not p.future.done():
                    p.future.set_exception(error)
                continue
            self._running[p.request.rid] = p
        self._queue.clear()

    def _apply_control(self) -> None:
        """Aborts and pauses reach the scheduler between two steps (call with the lock). A
        request the scheduler drops that a caller still waits for is answered here, so every
        request ends exactly once."""
        while self._control:
            dropped = self._control.pop(0)()
            if isinstance(dropped, list):
                self._resolve(dropped, self.weight_version)

    def _resolve(self, outputs: list[GenerateOutput], version: str) -> None:
        done_s = time.perf_counter()
        for out in outputs:
            p = self._running.pop(out.rid, None)
            if p is None or p.future.done():
                continue
            try:
                result = self.results.finished(p.request, p.detokenize, p.submitted_s, out, version)
            except Exception as error:  # shaping one result failed: that request fails alone
                logger.exception("request %s: shaping its result failed", out.rid)
                p.future.set_exception(error)
            else:
                p.future.set_result(result)
                self.metrics.observe_finished(out, p.submitted_s, done_s)

    def _started(self) -> asyncio.Condition:
        if self._cond is None:
            raise RuntimeError("ServingEngine is not started; await start() first")
        return self._cond

    # ---- result shaping --------------------------------------------------------------------

    # ---- control ---------------------------------------------------------------------------

    async def abort(
        self, rid: str | None, *, abort_all: bool = False, message: str | None = None
    ) -> int:
        """Abort queued and running requests whose rid starts with `rid` (or all of them).

        An empty rid without `abort_all` aborts nothing, as in SGLang. Returns the count.
        """
        if not abort_all and not rid:
            return 0
        cond = self._started()

        def hit(p: _Pending) -> bool:
            return abort_all or p.request.rid.startswith(rid or "")

        count = 0
        async with cond:
            for p in [p for p in self._queue.values() if hit(p)]:
                del self._queue[p.request.rid]
                if not p.future.done():
                    p.future.set_result(
                        self.results.aborted(
                            p.request,
                            p.detokenize,
                            message or "Abort in waiting queue.",
                            self.weight_version,
                            p.submitted_s,
                        )
                    )
                    self.metrics.observe_aborted(p.submitted_s, time.perf_counter())
                    count += 1
            # Callers of running requests get the abort now, with the tokens generated so far;
            # the scheduler drops the requests (and frees their KV) before its next step.
            for p in [p for p in self._running.values() if hit(p)]:
                del self._running[p.request.rid]
                if not p.future.done():
                    self._answer_running_abort(p, message or "Abort running request.")
                    self.metrics.observe_aborted(p.submitted_s, time.perf_counter())
                    count += 1
            self._control.append(lambda: self.scheduler.abort(rid, abort_all=abort_all))
            cond.notify_all()
        return count

    def _answer_running_abort(self, p: _Pending, message: str) -> None:
        """Answer an aborted running request with what it has generated so far."""
        try:
            out = self.scheduler.output_so_far(p.handle)
            result = self.results.finished(
                p.request, p.detokenize, p.submitted_s, out, self.weight_version, message
            )
        except Exception as error:  # shaping it failed: that request fails alone
            logger.exception("request %s: shaping its abort failed", p.request.rid)
            p.future.set_exception(error)
        else:
            p.future.set_result(result)

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        cond = self._started()
        async with cond:
            self._paused = True
            cond.notify_all()
        if mode == "abort":
            await self.abort(None, abort_all=True, message="Abort by pause_generation.")
        async with cond:
            self._control.append(lambda: self.scheduler.pause(mode))
            cond.notify_all()

    async def resume(self) -> None:
        cond = self._started()
        async with cond:
            self._control.append(self.scheduler.resume)
            self._paused = False
            cond.notify_all()

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while running requests hold KV (a pause in
        `retract` or `abort` mode releases it; `in_place` keeps it)."""
        lock = self._engine_lock
        assert lock is not None
        if not self._paused and (self._queue or self._running):
            return False  # requests in flight, as SGLang refuses
        # Paused: queued requests have not reached the scheduler and hold no KV (SGLang keeps
        # them out of its scheduler while paused too), so only frozen in-place requests refuse.
        async with lock:
            self._apply_control()  # a pause just asked for takes effect first
            return self.scheduler.flush_cache()
