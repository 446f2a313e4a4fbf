"""The async serving core: request queue, batching, abort, pause, weight updates.

Owns `ServingEngine`, which puts an `Engine` and its tokenizer behind an async interface that
the HTTP server and the in-process client share. One background task gathers the requests
submitted within `batch_wait_s` of each other into one `Engine.generate` call, run in a worker
thread so the event loop keeps serving. Results come back shaped as SGLang's `/generate` items
(`text`, `output_ids`, `meta_info`).

Promises (SGLang's semantics, at batch granularity until the continuous-batching scheduler
replaces the core):
- while paused, new `generate` calls wait (they are not rejected); `abort` mode aborts every
  queued and running request, `retract` and `in_place` hold the queue, and take effect between
  batches (a running batch finishes);
- an aborted request returns at once with `finish_reason.type == "abort"` and no output;
- weights change only between batches, so every token of a result carries one version;
- an un-paused disk update waits for the requests already submitted, and holds new ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from verst.engine.core import FINISH_STOP, Engine, GenerateOutput, GenerateRequest
from verst.engine.sampling import SamplingParams

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


@dataclass
class DetokenizeParams:
    """How output ids become `text` (SGLang's sampling keys that act after sampling)."""

    stop: Sequence[str] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_text_in_logprobs: bool = False


@dataclass
class GenerateResult:
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info}


@dataclass
class _Pending:
    request: GenerateRequest
    detokenize: DetokenizeParams
    submitted_s: float
    future: asyncio.Future[GenerateResult] = field(repr=False)


class ServingEngine:
    """An `Engine` behind an async queue; create and use it inside one event loop."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        max_batch_size: int = 256,
        batch_wait_s: float = 0.002,
        model_path: str = "",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.model_path = model_path
        self.weight_version = str(engine.weight_version)
        self.context_len = int(
            getattr(getattr(engine.model, "config", None), "max_position_embeddings", 0) or 0
        )
        self.num_batches = 0  # engine calls so far; batching is observable in tests and metrics
        self._queue: list[_Pending] = []
        self._running: list[_Pending] = []
        self._paused = False
        self._updating = 0
        self._cond: asyncio.Condition | None = None
        self._engine_lock: asyncio.Lock | None = None
        self._task: asyncio.Task[None] | None = None

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
    ) -> ServingEngine:
        """Load a local HF directory into an `Engine` that stops on the model's EOS ids."""
        from verst.models.loading import ModelConfig, eos_token_ids, load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(
            ModelConfig(path=model_path), seed=seed, dtype=dtype, device=device
        )
        eos = eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        engine = Engine(
            model, eos_token_ids=eos, pad_token_id=pad, max_batch_size=max_batch_size, seed=seed
        )
        return cls(
            engine,
            tokenizer,
            max_batch_size=max_batch_size,
            batch_wait_s=batch_wait_s,
            model_path=model_path,
        )

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

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, int]:
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._queue)}

    # ---- generation ------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str,
        return_logprob: bool,
        detokenize: DetokenizeParams | None = None,
    ) -> GenerateResult:
        """Queue one request and wait for its result (SGLang's `/generate` item shape)."""
        cond = self._started()
        submitted_s = time.perf_counter()
        params.validate()
        if not input_ids:
            raise ValueError("input_ids must be non-empty")
        async with cond:
            await cond.wait_for(lambda: not self._paused and not self._updating)
            pending = _Pending(
                GenerateRequest(list(input_ids), params, rid=rid, return_logprob=return_logprob),
                detokenize or DetokenizeParams(),
                submitted_s,
                asyncio.get_running_loop().create_future(),
            )
            self._queue.append(pending)
            cond.notify_all()
        try:
            # shield: a cancelled caller must not cancel the future the batch loop resolves.
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            async with cond:
                if pending in self._queue:
                    self._queue.remove(pending)
                    cond.notify_all()
            raise

    async def _loop(self) -> None:
        cond, lock = self._started(), self._engine_lock
        assert lock is not None
        while True:
            async with cond:
                await cond.wait_for(lambda: bool(self._queue) and not self._paused)
            if len(self._queue) < self.max_batch_size:
                await asyncio.sleep(self.batch_wait_s)
            async with cond:
                if self._paused or not self._queue:
                    continue
                batch = self._queue[: self.max_batch_size]
                del self._queue[: len(batch)]
                self._running = batch
            outputs: list[GenerateOutput] | None = None
            try:
                async with lock:
                    version = self.weight_version
                    self.num_batches += 1
                    outputs = await asyncio.to_thread(
                        self.engine.generate, [p.request for p in batch]
                    )
            except Exception as error:  # the engine failed: every request of the batch fails
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(error)
            finally:
                async with cond:
                    self._running = []
                    cond.notify_all()
            if outputs is None:
                continue
            for p, out in zip(batch, outputs, strict=True):
                if not p.future.done():  # aborted while running
                    p.future.set_result(self._result(p, out, version))

    def _started(self) -> asyncio.Condition:
        if self._cond is None:
            raise RuntimeError("ServingEngine is not started; await start() first")
        return self._cond

    # ---- result shaping --------------------------------------------------------------------

    def _decode(self, ids: list[int], opts: DetokenizeParams) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=opts.skip_special_tokens,
            spaces_between_special_tokens=opts.spaces_between_special_tokens,
        )

    def _result(self, p: _Pending, out: GenerateOutput, version: str) -> GenerateResult:
        opts = p.detokenize
        ids, logprobs = out.output_ids, out.output_token_logprobs
        finish: dict[str, Any]
        text_ids = ids
        if out.finish_reason == FINISH_STOP:
            finish = {"type": "stop", "matched": ids[-1]}
            if not opts.no_stop_trim:
                text_ids = ids[:-1]
        else:
            finish = {"type": "length", "length": len(ids)}
        text = self._decode(text_ids, opts)
        if opts.stop and any(s in text for s in opts.stop):
            k, text, matched = self._cut_at_stop(ids, opts)
            ids, logprobs = ids[:k], logprobs[:k]
            finish = {"type": "stop", "matched": matched}
        meta: dict[str, Any] = {
            "id": out.rid,
            "finish_reason": finish,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "weight_version": version,
            "e2e_latency": time.perf_counter() - p.submitted_s,
        }
        if p.request.return_logprob:
            meta["output_token_logprobs"] = self._logprob_triples(ids, logprobs, opts)
            meta["output_token_logprobs_length"] = len(ids)
        return GenerateResult(text=text, output_ids=list(ids), meta_info=meta)

    def _cut_at_stop(self, ids: list[int], opts: DetokenizeParams) -> tuple[int, str, str]:
        """The shortest output prefix whose text holds a stop string: (length, text, matched).

        Finding "contains a stop string" is monotone in the prefix length, so a binary search
        costs O(log n) decodes rather than one per token.
        """
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in self._decode(ids[:mid], opts) for s in opts.stop):
                hi = mid
            else:
                lo = mid + 1
        text = self._decode(ids[:lo], opts)
        pos, matched = min((text.find(s), s) for s in opts.stop if s in text)
        end = pos + len(matched) if opts.no_stop_trim else pos
        return lo, text[:end], matched

    def _logprob_triples(
        self, ids: list[int], logprobs: list[float], opts: DetokenizeParams
    ) -> list[list[Any]]:
        return [
            [lp, tid, self.tokenizer.decode([tid]) if opts.return_text_in_logprobs else None]
            for lp, tid in zip(logprobs, ids, strict=True)
        ]

    def _aborted(self, p: _Pending, message: str) -> GenerateResult:
        meta: dict[str, Any] = {
            "id": p.request.rid,
            "finish_reason": {"type": "abort", "message": message, "status_code": None},
            "prompt_tokens": len(p.request.input_ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - p.submitted_s,
        }
        if p.request.return_logprob:
            meta["output_token_logprobs"] = []
            meta["output_token_logprobs_length"] = 0
        return GenerateResult(text="", output_ids=[], meta_info=meta)

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
            for p in [p for p in self._queue if hit(p)]:
                self._queue.remove(p)
                if not p.future.done():
                    p.future.set_result(self._aborted(p, message or "Abort in waiting queue."))
                    count += 1
            # A running batch cannot be interrupted yet: its callers get the abort now and
            # the engine's outputs for them are dropped when the batch ends.
            for p in self._running:
                if hit(p) and not p.future.done():
                    p.future.set_result(self._aborted(p, message or "Abort running request."))
                    count += 1
            cond.notify_all()
        return count

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        cond = self._started()
        async with cond:
            self._paused = True
            cond.notify_all()
        if mode == "abort":
            await self.abort(None, abort_all=True, message="Abort by pause_generation.")

    async def resume(self) -> None:
        cond = self._started()
        async with cond:
            self._paused = False
            cond.notify_all()

    async def flush_cache(self) -> bool:
        """No prefix cache yet; succeeds exactly when SGLang's would (nothing in flight)."""
        return not self._queue and not self._running

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
        cond, lock = self._started(), self._engine_lock
        assert lock is not None
        if abort_all_requests:
            await self.abort(None, abort_all=True, message="Abort by update_weights_from_disk.")
        async with cond:
            self._updating += 1
            cond.notify_all()
            # Paused: update at once (between batches); else drain what was already submitted.
            await cond.wait_for(lambda: self._paused or (not self._queue and not self._running))
        try:
            async with lock:
                ok, message = await asyncio.to_thread(self._load_from_disk, model_path)
                if ok:
                    self.model_path = model_path
                    if weight_version is not None:
                        self._set_version(str(weight_version))
                return ok, message
        finally:
            async with cond:
                self._updating -= 1
                cond.notify_all()

    def _set_version(self, version: str) -> None:
        self.weight_version = version
        # The engine's own counter is an int; keep it in step when the version is one.
        if version.lstrip("-").isdigit():
            self.engine.set_weight_version(int(version))

    def _load_from_disk(self, model_path: str) -> tuple[bool, str]:
        from safetensors import safe_open

        path = Path(model_path).expanduser()
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not files[0].is_file():
            return False, f"no .safetensors weights found at {model_path!r}"
        params = dict(self.engine.model.named_parameters(remove_duplicate=False))
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name not in params:
                        return False, f"{file.name}: unknown parameter name {name!r}"
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(params[name].shape):
                        return False, (
                            f"{file.name}: shape mismatch for {name!r}: model "
                            f"{tuple(params[name].shape)}, checkpoint {shape}"
                        )

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        self.engine.update_weights_from_tensors(tensors(), self.engine.weight_version)
        return True, "Succeeded to update model weights."
