"""SGLang's `/generate` as plain functions over a `ServingEngine`: request body in, response body
out (the OpenAI routes in `openai_api.py` build on it).

Owns the `/generate` body's parsing and validation (`parse_generate` into a `GenerateJob`, one
`GenerateItem` per prompt and sample, each sample's params from `sample_params`; the
`sampling_params` inside it are `sampling_api`'s), the checks that refuse a whole job before any
item is queued (`check_job`), and running it (`run_job`, `run_generate`). Errors are
`protocol_errors.ProtocolError`. Both transports call these functions: the aiohttp handlers
only move JSON, and the in-process `EngineClient` calls them directly, so the HTTP and
in-process dicts cannot drift. Nothing here imports aiohttp, so the in-process path works
without the `serve` extra.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, replace
from typing import Any

from verst.engine import request_checks
from verst.engine.results import DetokenizeParams
from verst.engine.sampling import SEED_LIMIT, SamplingParams
from verst.engine.server.protocol_errors import contract_error, validation_error, value_error
from verst.engine.server.sampling_api import flag, is_token, parse_sampling_params
from verst.engine.serving import ServingEngine

# Top-level /generate fields the engine cannot honour yet: a non-null value is a 400.
GENERATE_UNSUPPORTED = (
    "input_embeds",
    "session_params",
    "session_id",
    "custom_logit_processor",
    "image_data",
    "video_data",
    "audio_data",
)

# S23's top-level /generate fields the engine does not implement yet, with their "off" value:
# accepted at it (SGLang's frontends send some on every call), any other value is a 400.
GENERATE_OFF: dict[str, Any] = {
    "return_sampling_mask": False,
    "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_indexer_topk": False,
    "return_bytes": False,
    "return_entropy": False,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "background": False,
    "positional_embed_overrides": None,
    "watermark": None,
    "extra_key": None,
    "cache_salt": None,
}


# ---- /generate -------------------------------------------------------------------------------


@dataclass
class GenerateItem:
    input_ids: list[int]
    params: SamplingParams
    detokenize: DetokenizeParams
    rid: str
    return_logprob: bool
    logprob_start_len: int = -1  # >= 0: also score the prompt from here (input_token_logprobs)
    lora_path: str | None = None  # the LoRA adapter it runs with (a name the engine holds)
    top_logprobs_num: int = 0  # with return_logprob: the k likeliest tokens at each position
    token_ids_logprob: list[int] | None = None  # with return_logprob: these ids' log-probs
    return_routed_experts: bool = False  # MoE: meta_info.routed_experts, base64 int32


@dataclass
class GenerateJob:
    items: list[GenerateItem]  # prompt-major: prompt i sample j at i * n + j
    is_list: bool
    return_prompt_token_ids: bool
    n: int = 1


def _prompts(payload: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], bool]:
    text, input_ids = payload.get("text"), payload.get("input_ids")
    if text is not None:  # SGLang: text wins when several are given
        if isinstance(text, str):
            return [tokenizer.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tokenizer.encode(t) for t in text], True
        raise contract_error("text must be a string or a non-empty list of strings")
    if input_ids is None:
        raise value_error("Either text, input_ids or input_embeds should be provided.")
    if isinstance(input_ids, list) and all(is_token(t) for t in input_ids):
        if not input_ids:
            raise value_error("input_ids cannot be empty.")
        return [list(input_ids)], False
    if (
        isinstance(input_ids, list)
        and input_ids
        and all(isinstance(p, list) and all(is_token(t) for t in p) for p in input_ids)
    ):
        if any(not p for p in input_ids):
            raise value_error("input_ids cannot be empty.")
        return [list(p) for p in input_ids], True
    raise contract_error("input_ids must be a list of ints or a list of lists of ints")


def _per_prompt_fields(payload: dict[str, Any], n_prompts: int) -> tuple[Any, Any]:
    """`return_logprob` (a bool, or one per prompt) and `rid` (a string, or one per prompt),
    type-checked; `stream` too, though only the transport reads it."""
    flag(payload, "stream", False)
    return_logprob = payload.get("return_logprob")
    if isinstance(return_logprob, list):
        if len(return_logprob) != n_prompts:
            raise contract_error("return_logprob list must have one entry per prompt")
        if not all(isinstance(b, bool) for b in return_logprob):
            raise contract_error("return_logprob must be a boolean or a list of booleans")
    else:
        return_logprob = flag(payload, "return_logprob", False)
    rid = payload.get("rid")
    if isinstance(rid, list):
        if not all(isinstance(r, str) for r in rid):
            raise contract_error("rid must be a string or a list of strings")
        if len(rid) != n_prompts or len(set(rid)) != len(rid):
            raise value_error("The rid list must match the batch size and have no duplicates.")
    elif rid is not None and not isinstance(rid, str):
        raise contract_error(f"rid must be a string or a list of strings, got {rid!r}")
    return return_logprob, rid


def _lora_paths(payload: dict[str, Any], n_prompts: int) -> list[str | None]:
    """`lora_path`: one adapter name for every prompt, or a list with one (or null) each."""
    value = payload.get("lora_path")
    if isinstance(value, list):
        if len(value) != n_prompts:
            raise contract_error("lora_path list must have one entry per prompt")
        paths = value
    else:
        paths = [value] * n_prompts
    if not all(p is None or (isinstance(p, str) and p) for p in paths):
        raise contract_error("lora_path must be an adapter name, or a list of names or nulls")
    return paths


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n samples' params: with a seed it draws from seed + j, so they differ."""
    seed = params.sampling_seed
    return params if seed is None else replace(params, sampling_seed=(seed + j) % SEED_LIMIT)


def _logprob_extras(payload: dict[str, Any], n_prompts: int) -> list[tuple[int, Any]]:
    """`top_logprobs_num` (an int, or one per prompt) and `token_ids_logprob` (a list of ids,
    or one list or null per prompt), as (k, ids) per prompt; 400 for a wrong type."""
    top = payload.get("top_logprobs_num")
    tops = top if isinstance(top, list) else [top] * n_prompts
    if len(tops) != n_prompts:
        raise contract_error("top_logprobs_num list must have one entry per prompt")
    if not all(t is None or (is_token(t) and t >= 0) for t in tops):
        raise contract_error(f"top_logprobs_num must be an int >= 0 (or one per prompt): {top!r}")
    ids = payload.get("token_ids_logprob")
    if ids is None or (isinstance(ids, list) and all(is_token(t) for t in ids)):
        id_lists = [ids] * n_prompts
    elif isinstance(ids, list) and len(ids) == n_prompts:
        id_lists = ids
    else:
        raise contract_error(
            "token_ids_logprob must be a list of token ids, or one list (or null) per prompt"
        )
    if not all(i is None or (isinstance(i, list) and all(map(is_token, i))) for i in id_lists):
        raise contract_error("token_ids_logprob must be a list of token ids")
    return [(t or 0, i) for t, i in zip(tops, id_lists, strict=True)]


def parse_generate(payload: Any, tokenizer: Any, context_len: int) -> GenerateJob:
    """A `/generate` body → one item per (prompt, sample), prompt-major."""
    if not isinstance(payload, dict):
        raise validation_error("the request body must be a JSON object")
    for key in GENERATE_UNSUPPORTED:
        if payload.get(key) is not None:
            raise value_error(f"{key} is not supported by the verst engine")
    for key, off in GENERATE_OFF.items():
        if payload.get(key) is not None and payload[key] != off:
            raise value_error(f"{key} is not supported by the verst engine yet")
    start = payload.get("logprob_start_len", -1)
    start = -1 if start is None else start
    if not isinstance(start, int) or isinstance(start, bool) or start < -1:
        raise contract_error("logprob_start_len must be an int >= -1")
    rank = payload.get("routed_dp_rank", payload.get("data_parallel_rank"))
    if rank not in (None, 0):
        raise value_error(f"routed_dp_rank {rank} is out of range: this server has dp_size 1")
    prompts, is_batch = _prompts(payload, tokenizer)
    raw_params = payload.get("sampling_params")
    params_list = raw_params if isinstance(raw_params, list) else None
    if params_list is not None and len(params_list) != len(prompts):
        raise contract_error("sampling_params list must have one entry per prompt")
    return_logprob, rid = _per_prompt_fields(payload, len(prompts))
    lora_paths = _lora_paths(payload, len(prompts))
    extras = _logprob_extras(payload, len(prompts))
    text_in_logprobs = flag(payload, "return_text_in_logprobs", False)
    routed_experts = flag(payload, "return_routed_experts", False)

    parsed = []
    for i, prompt in enumerate(prompts):
        raw = params_list[i] if params_list is not None else raw_params
        parsed.append(parse_sampling_params(raw, len(prompt), context_len))
    ns = {n for _, _, n in parsed}
    if len(ns) > 1:
        raise value_error("sampling_params.n must be the same for every prompt of a batch")
    n = ns.pop()
    base = uuid.uuid4().hex if rid is None else None
    items: list[GenerateItem] = []
    for i, (prompt, (params, detok, _)) in enumerate(zip(prompts, parsed, strict=True)):
        detok.return_text_in_logprobs = text_in_logprobs
        if isinstance(rid, list):
            prompt_rid = str(rid[i])
        elif is_batch:
            prompt_rid = f"{rid if rid is not None else base}_{i}"
        else:
            prompt_rid = str(rid) if rid is not None else str(base)
        logprob = return_logprob[i] if isinstance(return_logprob, list) else return_logprob
        if logprob and start >= len(prompt):
            raise value_error(
                f"logprob_start_len ({start}) is larger than the prompt length ({len(prompt)})"
            )
        for j in range(n):
            items.append(
                GenerateItem(
                    input_ids=prompt,
                    params=sample_params(params, j),
                    detokenize=detok,
                    rid=prompt_rid if n == 1 else f"{prompt_rid}_{j}",
                    return_logprob=bool(logprob),
                    logprob_start_len=start if logprob else -1,
                    lora_path=lora_paths[i],
                    # SGLang reads them only with return_logprob
                    top_logprobs_num=extras[i][0] if logprob else 0,
                    token_ids_logprob=extras[i][1] if logprob else None,
                    return_routed_experts=routed_experts,
                )
            )
    return GenerateJob(
        items=items,
        is_list=is_batch or n > 1,
        return_prompt_token_ids=flag(payload, "return_prompt_token_ids", False),
        n=n,
    )


def check_job(serving: ServingEngine, job: GenerateJob) -> None:
    """Refuse the whole job before any item is queued: a bad token id or a rid already in
    flight is a 400, and the good items batched with it never start."""
    for item in job.items:
        try:
            request_checks.check_request(
                serving.scheduler,
                serving.vocab_size,
                item.input_ids,
                item.params,
                item.lora_path,
                top_logprobs_num=item.top_logprobs_num,
                token_ids_logprob=item.token_ids_logprob,
                return_routed_experts=item.return_routed_experts,
            )
        except ValueError as error:
            raise value_error(str(error)) from error
        if not serving.rid_is_free(item.rid):
            raise value_error(f"Duplicate request ID detected: {item.rid}")


async def run_job(serving: ServingEngine, job: GenerateJob) -> list[dict[str, Any]]:
    """Submit every item at once (so they batch together); results in item order."""

    check_job(serving, job)

    async def one(item: GenerateItem) -> dict[str, Any]:
        try:
            result = await serving.generate(
                item.input_ids,
                item.params,
                rid=item.rid,
                return_logprob=item.return_logprob,
                detokenize=item.detokenize,
                logprob_start_len=item.logprob_start_len,
                lora_path=item.lora_path,
                top_logprobs_num=item.top_logprobs_num,
                token_ids_logprob=item.token_ids_logprob,
                return_routed_experts=item.return_routed_experts,
            )
        except ValueError as error:
            raise value_error(str(error)) from error
        body = result.to_dict()
        if job.return_prompt_token_ids:
            body["prompt_token_ids"] = item.input_ids
        return body

    return list(await asyncio.gather(*(one(item) for item in job.items)))


async def run_generate(
    serving: ServingEngine, tokenizer: Any, payload: Any
) -> dict[str, Any] | list[dict[str, Any]]:
    """A `/generate` body → its response body: one object, or a prompt-major list."""
    job = parse_generate(payload, tokenizer, serving.context_len)
    results = await run_job(serving, job)
    return results if job.is_list else results[0]
