"""Continuous batching over a paged KV cache with a radix prefix cache.

`Scheduler.step()` runs one forward pass for every running request at once: requests still
in their prompt feed a chunk of it (chunked prefill), the others feed their one newest token
(decode). Requests join at any step (admission matches their prompt against the radix cache,
so a shared prefix is computed once) and leave as soon as they finish; their KV pages go back
to the radix cache for later requests, and least-recently-used pages are evicted when the
pool runs short. When even that is not enough, the newest request is retracted: its KV is
handed to the cache and it re-enters the queue, to be recomputed (mostly from cache) later.

Control: `abort(rid)`, `pause(mode)` with `abort` | `retract` | `in_place` and `resume()`,
`flush_cache()`, weight updates in place with a version stamped on every output.

The model is the Hugging Face one; only its attention is swapped for one that reads and
writes the paged pool in place (`paged_attention`, run by `ModelRunner`). On CUDA decode steps
replay CUDA graphs, sampling stays on the device with one host sync a step (the sampled ids),
and consecutive decode-only steps overlap: step N+1 is launched before the host reads step N's
tokens (`verst.engine.overlap`). With `monitor.trace` each step is an "engine step" span.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Literal

import torch

from verst.engine.adapters import DEFAULT_MAX_ADAPTERS
from verst.engine.config import Quantization
from verst.engine.grammar import Constraint, Grammars
from verst.engine.kernels.cuda_sampling import fused_sample
from verst.engine.kv_pool import KVPool, OutOfPages
from verst.engine.logprob_extras import LogprobRecord, record_step, score_prompt
from verst.engine.memory import EngineMemory
from verst.engine.model_runner import ModelRunner, Row
from verst.engine.overlap import OverlapSteps, PendingStep, StepWork, pending_step
from verst.engine.penalties import PenaltySlots
from verst.engine.prompt_sharing import PromptSharing
from verst.engine.radix_cache import RadixCache
from verst.engine.requests import FINISH_LENGTH, GenerateOutput, GenerateRequest, finish_reason
from verst.engine.running import Running
from verst.engine.sampling import apply_penalties, sample_rows
from verst.engine.scheduler_weights import SchedulerWeights
from verst.engine.stats import SchedulerStats
from verst.monitor import trace

FINISH_ABORT = "abort"
ADAPTER_KEY_SHIFT = 40  # adapter uid << this, added to token ids, namespaces the prefix cache
PauseMode = Literal["abort", "retract", "in_place"]


class Scheduler(PromptSharing, OverlapSteps, SchedulerWeights):
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        max_running: int = 256,
        chunk_tokens: int = 4096,
        enable_prefix_cache: bool = True,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        lean_forward: bool = True,
        fused_kernels: bool = True,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
        tokenizer: Any = None,
        true_on_policy: bool = False,
        quantization: Quantization = "none",
        overlap: bool | None = None,
    ) -> None:
        """`tokenizer` (HF's) enables constrained decoding; `true_on_policy` and
        `quantization`: see `ModelRunner`; `overlap`: launch each decode-only step before
        reading the previous one's tokens (`verst.engine.overlap`); None: on CUDA only (True
        runs its bookkeeping on the CPU too, for its tests, where it gains nothing)."""
        self.model = model
        self.pool = pool
        self.runner = ModelRunner(
            model,
            pool,
            pad_token_id=pad_token_id,
            cuda_graphs=cuda_graphs,
            lean=lean_forward,
            fused_kernels=fused_kernels,
            max_adapters=max_adapters,
            true_on_policy=true_on_policy,
            quantization=quantization,
        )
        # one kernel samples on CUDA; true on-policy keeps PyTorch's `log_softmax`, which the
        # trainer recomputes bit for bit (`train.on_policy`)
        self.fused_sampler = fused_sample if self.runner.use_triton else None
        self.cache = RadixCache(pool) if enable_prefix_cache else None
        self.memory = EngineMemory(
            self.runner, pool, self.cache, lambda: len(self.running) + len(self.waiting)
        )
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        self.device = next(model.parameters()).device
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._pending: PendingStep | None = None  # a step launched, its tokens not yet read
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.weight_version: int | str = 0
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        self.paused: PauseMode | None = None
        self._finished_early: list[GenerateOutput] = []  # ended outside a step's sampling
        self._params_by_name: dict[str, torch.Tensor] | None = None
        self._has_followers = False  # some waiting request follows a prefilling one
        self.stats = SchedulerStats()
        self.penalties = PenaltySlots.for_model(model, self.device, self.eos_token_ids)
        self.grammars = (
            None
            if tokenizer is None
            else Grammars(tokenizer, self.penalties.vocab, self.eos_token_ids)
        )

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        **options: Any,
    ) -> Scheduler:
        """A scheduler over a loaded model (its device and dtype) with a KV pool of
        `kv_cache_bytes`: by default 256 MiB on the CPU, half the free GPU memory on CUDA."""
        pool = KVPool.for_model(model, budget_bytes=kv_cache_bytes, page_size=page_size)
        return cls(model, pool, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, **options)

    # --- requests -----------------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> Running:
        if self.memory.released:
            raise RuntimeError(
                f"the engine's {', '.join(self.memory.released)} memory is released: resume "
                "it (and update released weights) before generating"
            )
        request.sampling_params.validate()
        if not request.input_ids:
            raise ValueError(f"input_ids must be non-empty (rid {request.rid})")
        r = Running(request, list(request.input_ids), prompt_length=len(request.input_ids))
        r.extras = LogprobRecord.for_request(request)  # checks the log-prob options too
        if request.return_routed_experts and self.runner.routing is None:
            raise ValueError(
                "return_routed_experts: the model has no mixture-of-experts layers to report"
            )
        if request.lora_path is not None:
            held = self.adapter_registry().slot(request.lora_path)
            r.adapter, r.cache_offset = held.index, held.uid << ADAPTER_KEY_SHIFT
        seed = request.sampling_params.sampling_seed
        if seed is not None:
            r.generator = torch.Generator(device=self.device)
            r.generator.manual_seed(seed)
        self.penalties.admit(request.sampling_params)
        if request.sampling_params.constraint is not None:
            r.grammar = self.grammar_matcher(request.sampling_params.constraint)
        self.waiting.append(r)
        return r

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Submit, run until these requests finish, and return their outputs in order."""
        for request in requests:
            self.submit(request)
        wanted = {r.rid for r in requests}
        done: dict[str, GenerateOutput] = {}
        while wanted - done.keys():
            finished = self.step()
            if not finished and not self.has_work():
                raise RuntimeError("scheduler is idle with requests unfinished (paused?)")
            done |= {out.rid: out for out in finished}
        return [done[r.rid] for r in requests]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_early) and self.paused is None

    def load(self) -> dict[str, int]:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting)}

    def cache_stats(self) -> dict[str, float]:
        return self.cache.stats() if self.cache is not None else {}

    # --- control --------------------------------------------------------------------------------

    def abort(
        self, rid: str | None = None, *, abort_all: bool = False, exact: bool = False
    ) -> list[GenerateOutput]:
        """Abort requests whose rid starts with `rid` (SGLang's prefix rule; only that rid when
        `exact`), or all."""

        def hit(r: Running) -> bool:
            if exact:
                return r.request.rid == rid
            return abort_all or (bool(rid) and r.request.rid.startswith(rid))

        self._settle()
        aborted = [r for r in [*self.running, *self.waiting] if hit(r)]
        self.running = [r for r in self.running if not hit(r)]
        self.waiting = deque(r for r in self.waiting if not hit(r))
        for r in aborted:
            self._release(r)
        return [self._output(r, FINISH_ABORT) for r in aborted]

    def pause(self, mode: PauseMode) -> list[GenerateOutput]:
        """Stop stepping. abort: abort everything; retract: requeue running requests (their KV
        goes to the cache, recomputed on return); in_place: keep everything as it is. Returns
        the requests that end: aborted ones, and those the pending step (read first) finished."""
        finished = self.drain()
        self.paused = mode
        if mode == "abort":
            return finished + self.abort(abort_all=True)
        if mode == "retract":
            for r in reversed(self.running):
                self._retract(r)
            self.running = []
        return finished

    def resume(self) -> None:
        self.paused = None

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while running requests hold KV pages.

        Queued requests (retracted ones included) hold no pages, so they do not block it: the
        weight-update protocol flushes right after a retracting pause.
        """
        if self.running:
            return False
        if self.cache is not None:
            self.cache.reset()
        return True

    # --- one step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[GenerateOutput]:
        """Admit, run one forward pass for every running request, sample, retire finished.
        Overlapped (`overlap`), a decode-only step is launched before the previous step's
        tokens are read, and its own tokens are read by the next call."""
        if self.paused is not None:
            return []
        start_s = time.perf_counter()
        traced = trace.now()  # None unless `monitor.trace` traces this process
        if self.pool.device.type == "cuda" and self.pool.device.index is not None:
            # step() runs on a worker thread, whose current device is cuda:0 by default; the
            # Triton kernels and CUDA graphs launch on the current device
            torch.cuda.set_device(self.pool.device)
        work = StepWork()
        finished, launched = self._advance(work)
        if not launched:  # outside the overlap's boundary: the pending step was read first
            finished += self._step_now(work)
        finished += self._finished_early
        self._finished_early = []
        if work.ran:
            self.stats.record_step(time.perf_counter() - start_s, work.taken)
            if traced is not None:
                trace.complete(
                    "engine step", traced, cat="engine", requests=work.requests, tokens=work.tokens
                )
        return finished

    def _step_now(self, work: StepWork) -> list[GenerateOutput]:
        """Admit, plan and run one step; its tokens are read now, or left pending where the
        next step may overlap it."""
        finished = self._admit()
        batch = self._plan()
        if not batch:
            return finished
        work.requests, work.tokens = len(batch), sum(n for _, n in batch)
        logits_B_V = self._forward(batch)
        prefilled = [r for r, n in batch if r.computed - n < r.prompt_length <= r.computed]
        for r in prefilled:
            self._share_prompt(r)
        forks = self._fork_followers(prefilled) if self._has_followers else {}
        ready = [i for i, (r, _) in enumerate(batch) if r.computed == len(r.tokens)]
        scored = {i for i in ready if self._remaining(batch[i][0]) <= 0}  # max_new_tokens=0
        for i in sorted(scored):
            finished.append(self._finish(batch[i][0], FINISH_LENGTH))
        logit_rows = [i for i in ready if i not in scored]
        rows = [batch[i][0] for i in logit_rows]
        for i in ready if forks else ():  # followers sample from their leader's logits
            for follower in forks.get(id(batch[i][0]), ()):
                rows.append(follower)
                logit_rows.append(i)
        if rows:
            # every row samples in a decode step: no copy of the logits
            whole = not forks and len(logit_rows) == len(batch)
            tokens_B, logprobs_B = self._sample(
                rows, logits_B_V if whole else logits_B_V[logit_rows]
            )
            if self._may_stay_pending(batch, rows):
                self._pending = pending_step(rows, tokens_B, logprobs_B)
                return finished
            finished += self._take_tokens(rows, tokens_B.tolist(), logprobs_B.tolist())
            work.taken += len(rows)
        now_s = time.perf_counter()  # after sampling's host sync: the tokens exist
        for r in (*prefilled, *(f for fs in forks.values() for f in fs)):
            r.first_token_s = r.first_token_s or now_s  # kept across a retraction's re-prefill
        return finished

    def _admit(self) -> list[GenerateOutput]:
        finished: list[GenerateOutput] = []
        if not self.waiting or len(self.running) >= self.max_running:
            return finished
        prefilling = {self._prompt_key(r) for r in self.running if r.computed < r.prompt_length}
        leaders = {self._lead_key(r): r for r in self.running if self._may_lead(r)}
        self._has_followers = False
        deferred = []
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            if self._remaining(r) <= 0 and r.request.logprob_start_len < 0:
                finished.append(self._output(r, FINISH_LENGTH))
                continue
            r.leader = leaders.get(self._lead_key(r)) if self._may_follow(r) else None
            if r.leader is not None:
                # the same prompt is being prefilled: r copies its KV and its last logits when
                # that prefill ends (the samples of a group), rather than compute it again
                self._has_followers = True
                deferred.append(r)
                continue
            # scoring the prompt needs its logits, so it cannot skip cached positions
            if self.cache is not None and r.computed == 0 and r.request.logprob_start_len < 0:
                # keep one token to compute: the last prompt token's logits start decoding
                match = self.cache.match_prefix(self._keyed(r, r.tokens[:-1]))
                key = self._prompt_key(r)
                if key in prefilling and match.length < len(key):
                    # the same prompt is being prefilled now: wait one step and take it from
                    # the cache (a group's samples arrive together), rather than recompute it
                    deferred.append(r)
                    continue
                self.cache.lock(match)
                r.match = match
                r.pages, r.computed = list(match.pages), match.length
                r.cached_tokens = max(r.cached_tokens, match.length)
                prefilling.add(key)
            self.running.append(r)
            if self._may_lead(r):
                leaders.setdefault(self._lead_key(r), r)
        self.waiting.extendleft(reversed(deferred))
        return finished

    def _plan(self) -> list[tuple[Running, int]]:
        """(request, tokens to feed) for this step, with pages allocated for them."""
        budget = self.chunk_tokens
        batch = []
        retracted_before = len(self.waiting)
        for r in list(self.running):
            if len(self.waiting) > retracted_before and r not in self.running:
                continue  # retracted to make room for an earlier request
            n = min(len(r.tokens) - r.computed, max(budget, 1))
            if -(-len(r.tokens) // self.pool.page_size) > self.pool.num_pages:
                self.running.remove(r)
                self._release(r)
                self._finished_early.append(self._output(r, FINISH_ABORT))
                continue
            if not self._reserve(r, r.computed + n):
                continue
            batch.append((r, n))
            budget -= n
        if len(self.waiting) == retracted_before:
            return batch
        running = {id(r) for r in self.running}
        return [(r, n) for r, n in batch if id(r) in running]

    def _reserve(self, r: Running, length: int) -> bool:
        """Make r's pages cover `length` tokens, evicting cache or retracting newer requests."""
        missing = -(-length // self.pool.page_size) - len(r.pages)
        while missing > 0:
            short = missing - self.pool.num_free()
            if short > 0 and self.cache is not None:
                self.cache.evict(short)
            try:
                r.pages += self.pool.alloc(missing)
                return True
            except OutOfPages:
                victim = self.running[-1]
                self._retract(victim)
                self.running.remove(victim)
                if victim is r:
                    return False
        return True

    def _forward(self, batch: list[tuple[Running, int]]) -> torch.Tensor:
        """Feed each row its next tokens on top of its KV in the pool; returns last-token
        logits [B, V] (float32). Attention reads and writes the pool in place (`ModelRunner`)."""
        rows = [
            Row(
                tokens=r.tokens[r.computed : r.computed + n],
                past=r.computed,
                pages=r.pages,
                all_logits=r.request.logprob_start_len >= 0 and r.computed < r.prompt_length,
                adapter=r.adapter,
            )
            for r, n in batch
        ]
        last_B_V, full = self.runner.forward(rows)
        for row, (r, n) in enumerate(batch):
            if row in full:
                self._score_prompt(r, full[row])
            elif rows[row].all_logits:  # one token fed: its logits are the last ones
                self._score_prompt(r, last_B_V[row : row + 1])
            r.computed += n
        return last_B_V

    def _score_prompt(self, r: Running, logits_T_V: torch.Tensor) -> None:
        """Log-probs of the prompt tokens this chunk predicts (SGLang's input_token_logprobs)."""
        if r.computed == 0:
            r.input_logprobs = [None]  # position `start` has no prediction in SGLang's shape
        # logits row o predicts position computed + o + 1; scored: start + 1 ... prompt - 1
        first = max(r.request.logprob_start_len - r.computed, 0)
        targets = r.tokens[r.computed + first + 1 : r.prompt_length]
        temperature, fresh = r.request.sampling_params.temperature, r.computed == 0
        r.input_logprobs += score_prompt(logits_T_V[first:], targets, temperature, r.extras, fresh)

    def grammar_matcher(self, constraint: Constraint) -> Any:
        """A matcher of `constraint` for one request; ValueError when it does not compile or
        this scheduler has no tokenizer to compile it with."""
        if self.grammars is None:
            raise ValueError(
                f"{constraint.kind} needs an engine built with its tokenizer (constrained decoding)"
            )
        return self.grammars.matcher(constraint)

    def _sample(
        self, rows: list[Running], logits_B_V: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token and its log-prob, on the device (`_take_tokens` reads them)."""
        params = [r.request.sampling_params for r in rows]
        matchers = [r.grammar for r in rows]  # masked in place: the log-probs are constrained
        if any(m is not None for m in matchers):
            assert self.grammars is not None  # a request gets a matcher from them only
            self.grammars.mask(matchers, logits_B_V)
        penalties = self.penalties.step(rows, params)
        if penalties is not None:  # once, for the sampler and the top-k / chosen-id log-probs
            logits_B_V = apply_penalties(logits_B_V, penalties.rows)
        generators = [r.generator for r in rows]
        tokens_B, logprobs_B = sample_rows(
            logits_B_V, params, generators, self.generator, fused=self.fused_sampler
        )
        if penalties is not None:  # on the device, before the step's one host sync
            self.penalties.record(penalties.slots_B, tokens_B)
        record_step([r.extras for r in rows], params, logits_B_V)
        return tokens_B, logprobs_B

    def _take_tokens(
        self, rows: list[Running], tokens: list[int], logprobs: list[float]
    ) -> list[GenerateOutput]:
        """Append each row's sampled token and retire the rows it finishes."""
        finished = []
        for r, token, logprob in zip(rows, tokens, logprobs, strict=True):
            if r.grammar is not None:
                Grammars.accept(r.grammar, token)
            r.output_logprobs.append(logprob)
            r.token_versions.append(self.weight_version)
            r.tokens.append(token)  # last: `output_so_far` counts the tokens first
            reason, r.matched_stop = finish_reason(r.request, r.output_ids, self.eos_token_ids)
            if reason is not None:
                # an overlapped step may have fed r once more: its KV is of its own tokens only
                r.computed = min(r.computed, len(r.tokens) - 1)
                finished.append(self._finish(r, reason))
        return finished

    def _finish(self, r: Running, reason: str) -> GenerateOutput:
        self.running.remove(r)
        out = self._output(r, reason)  # first: its routed experts are read from its pages
        self._release(r)
        return out

    # --- bookkeeping ----------------------------------------------------------------------------

    def _remaining(self, r: Running) -> int:
        return r.request.sampling_params.max_new_tokens - len(r.output_ids)

    def _release(self, r: Running) -> None:
        """Give r's KV back: whole pages to the prefix cache, the rest to the pool."""
        if self.cache is not None and r.pages:
            full = r.computed // self.pool.page_size
            keys = self._keyed(r, r.tokens[: full * self.pool.page_size])
            duplicates = self.cache.insert(keys, r.pages[:full])
            self.pool.free(duplicates + r.pages[full:])
        elif r.pages:
            self.pool.free(r.pages)
        if self.cache is not None and r.match is not None:
            self.cache.unlock(r.match)
        r.pages, r.match, r.computed = [], None, 0

    def _retract(self, r: Running) -> None:
        self._release(r)
        r.retractions += 1
        self.waiting.appendleft(r)

    def _output(self, r: Running, reason: str) -> GenerateOutput:
        req = r.request
        self.stats.record_request(r.prompt_length, r.cached_tokens, r.retractions)
        self.penalties.leave(r, req.sampling_params)  # every way out comes here, once
        return GenerateOutput(
            rid=req.rid,
            output_ids=list(r.output_ids),
            output_token_logprobs=list(r.output_logprobs) if req.return_logprob else [],
            finish_reason=reason,
            prompt_tokens=r.prompt_length,
            completion_tokens=len(r.output_ids),
            weight_version=self.weight_version,
            cached_tokens=r.cached_tokens,
            input_token_logprobs=list(r.input_logprobs),
            token_weight_versions=list(r.token_versions),
            # one that finishes in the step of its first token is stamped here
            first_token_s=r.first_token_s or (time.perf_counter() if r.output_ids else None),
            matched_stop=r.matched_stop,  # set only by the step that ends r with a stop
            routed_experts=self._routed_experts(r),
            **(r.extras.output_fields() if r.extras is not None else {}),
        )

    def _routed_experts(self, r: Running) -> torch.Tensor | None:
        """The experts of r's fed positions (all but its last token, once it has run), read
        from its pages; None unless it asks for them."""
        if not r.request.return_routed_experts:
            return None
        return self.pool.routed_rows(r.pages, min(len(r.tokens) - 1, r.computed))

    def output_so_far(self, r: Running) -> GenerateOutput:
        """An aborted request's answer, its tokens so far (safe while a step runs: see _sample)."""
        n = len(r.output_ids)  # first: a token being appended meanwhile is left out
        return self._output(r, FINISH_ABORT).first(n)
