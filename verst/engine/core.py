"""The embedded engine core: in-process, batched generation with a KV cache.

Owns `Engine`, which runs a Hugging Face causal LM on a list of `GenerateRequest`s (SGLang's
field names) and returns one `GenerateOutput` per request, in request order, stamped with the
engine's weight version. Also owns in-place weight updates.

Promises:
- padding never changes results: prompts are left-padded with explicit position ids, so each
  row computes what it would alone;
- each output token carries the log-prob the trainer recomputes (see `sampling`);
- a fixed seed gives the same outputs for the same requests.

The request / output shapes are those a future scheduler (continuous batching, paged KV, HTTP
`/generate`) will keep; `generate` is the single entry point it will replace.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from verst.engine.requests import FINISH_LENGTH, FINISH_STOP, GenerateOutput, GenerateRequest
from verst.engine.sampling import sample_next_tokens
from verst.models.forward import cached_forward, new_cache


class Engine:
    """Batched generation over a Hugging Face causal LM (eval mode, any device / dtype)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        max_batch_size: int = 256,
        seed: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version

    @torch.no_grad()
    def update_weights_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy tensors into the model's parameters by name, then set the weight version.

        Streams: tensors are copied as they arrive (so bucketed senders need not hold them all);
        on an error, earlier tensors are already copied and the version is left unchanged.
        """
        # remove_duplicate=False so tied aliases (e.g. lm_head.weight) resolve too.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"unknown parameter name: {name!r}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {name!r}: model {tuple(param.shape)}, "
                    f"got {tuple(tensor.shape)}"
                )
            param.copy_(tensor)
        self.weight_version = version

    @torch.no_grad()
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Generate for every request; outputs come back in request order."""
        for req in requests:
            req.sampling_params.validate()
            if req.sampling_params.sampling_seed is not None or req.logprob_start_len >= 0:
                raise ValueError(
                    f"request {req.rid}: sampling_seed and logprob_start_len need the "
                    "continuous-batching Scheduler (verst.engine.scheduler), not the batch Engine"
                )
            if not req.input_ids:
                raise ValueError(f"input_ids must be non-empty (rid {req.rid})")
        outputs: list[GenerateOutput] = []
        for start in range(0, len(requests), self.max_batch_size):
            outputs.extend(self._generate_batch(requests[start : start + self.max_batch_size]))
        return outputs

    def _forward(self, input_ids_B_T, attention_mask_B_S, position_ids_B_T, cache) -> torch.Tensor:
        logits = cached_forward(
            self.model, input_ids_B_T, attention_mask_B_S, position_ids_B_T, cache, last_only=True
        )
        return logits[:, -1, :]

    def _generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        device = self.device
        B = len(requests)
        params = [r.sampling_params for r in requests]
        prompt_lens = [len(r.input_ids) for r in requests]
        max_new = [p.max_new_tokens for p in params]
        max_steps = max(max_new)
        if max_steps == 0:
            return [self._output(r, [], [], FINISH_LENGTH) for r in requests]
        max_prompt = max(prompt_lens)

        # Left padding; the attention mask is built for the whole run (decode columns all ones:
        # finished rows attend to their pad tokens, which is harmless) and sliced per step.
        pad = self.pad_token_id
        input_ids_B_L = torch.tensor(
            [[pad] * (max_prompt - len(r.input_ids)) + r.input_ids for r in requests],
            dtype=torch.long,
        ).to(device)
        mask_B_S = torch.tensor(
            [[0] * (max_prompt - n) + [1] * (n + max_steps) for n in prompt_lens],
            dtype=torch.long,
        ).to(device)
        position_ids_B_L = (mask_B_S[:, :max_prompt].cumsum(-1) - 1).clamp(min=0)
        prompt_lens_B = torch.tensor(prompt_lens, device=device)

        temperature_B = torch.tensor([p.temperature for p in params], device=device)
        any_sampled = any(p.temperature > 0 for p in params)
        any_greedy = any(p.temperature <= 0 for p in params)
        top_p_B = top_k_B = None
        if any(p.top_p < 1.0 for p in params):
            top_p_B = torch.tensor([p.top_p for p in params], device=device)
        if any(p.top_k > 0 for p in params):
            top_k_B = torch.tensor([p.top_k for p in params], device=device)
        min_p_B = None
        if any(p.min_p > 0 for p in params):
            min_p_B = torch.tensor([p.min_p for p in params], device=device)
        max_new_B = torch.tensor(max_new, device=device)
        stop_sets = [
            list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids) for p in params
        ]
        width = max(1, max(len(s) for s in stop_sets))
        stop_ids_B_K = torch.tensor(
            [s + [-1] * (width - len(s)) for s in stop_sets], dtype=torch.long, device=device
        )

        tokens_B_N = torch.empty((B, max_steps), dtype=torch.long, device=device)
        logprobs_B_N = torch.empty((B, max_steps), dtype=torch.float32, device=device)
        done_B = max_new_B == 0
        stopped_B = torch.zeros(B, dtype=torch.bool, device=device)
        gen_len_B = torch.zeros(B, dtype=torch.long, device=device)
        pad_B = torch.full((B,), self.pad_token_id, dtype=torch.long, device=device)

        # Requests with the same prompt (the n samples of a group) share one prefill: the
        # distinct prompts run once and their KV cache rows are then repeated per request.
        distinct: dict[tuple[int, ...], int] = {}
        first_row: list[int] = []
        for row, req in enumerate(requests):
            if distinct.setdefault(tuple(req.input_ids), len(distinct)) == len(first_row):
                first_row.append(row)
        cache = new_cache(self.model)
        logits_B_V = self._forward(
            input_ids_B_L[first_row],
            mask_B_S[first_row, :max_prompt],
            position_ids_B_L[first_row],
            cache,
        )
        if len(first_row) < B:
            index_B = torch.tensor(
                [distinct[tuple(req.input_ids)] for req in requests], device=device
            )
            cache.batch_select_indices(index_B)
            logits_B_V = logits_B_V[index_B]
        for step in range(max_steps):
            tokens_B, token_logprobs_B = sample_next_tokens(
                logits_B_V,
                temperature_B,
                top_p_B,
                top_k_B,
                self.generator,
                any_sampled=any_sampled,
                min_p_B=min_p_B,
                any_greedy=any_greedy,
            )
            tokens_B_N[:, step] = tokens_B
            logprobs_B_N[:, step] = token_logprobs_B
            live_B = ~done_B
            gen_len_B += live_B
            hit_stop_B = (tokens_B.unsqueeze(-1) == stop_ids_B_K).any(-1) & live_B
            stopped_B |= hit_stop_B
            done_B = done_B | hit_stop_B | (gen_len_B >= max_new_B)
            if step == max_steps - 1 or bool(done_B.all()):  # the one host sync per step
                break
            fed_B = torch.where(done_B, pad_B, tokens_B)
            logits_B_V = self._forward(
                fed_B.unsqueeze(-1),
                mask_B_S[:, : max_prompt + step + 1],
                (prompt_lens_B + step).unsqueeze(-1),
                cache,
            )

        tokens = tokens_B_N.tolist()
        logprobs = logprobs_B_N.tolist()
        gen_lens = gen_len_B.tolist()
        stopped = stopped_B.tolist()
        return [
            self._output(
                req,
                tokens[i][: gen_lens[i]],
                logprobs[i][: gen_lens[i]] if req.return_logprob else [],
                FINISH_STOP if stopped[i] else FINISH_LENGTH,
            )
            for i, req in enumerate(requests)
        ]

    def _output(
        self, req: GenerateRequest, output_ids: list[int], logprobs: list[float], finish: str
    ) -> GenerateOutput:
        return GenerateOutput(
            rid=req.rid,
            output_ids=output_ids,
            output_token_logprobs=logprobs,
            finish_reason=finish,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(output_ids),
            weight_version=self.weight_version,
        )
