"""SGLang's native HTTP protocol as plain functions over a `ServingEngine`: request body in,
response body out (the OpenAI-compatible routes build on it in `openai_protocol.py`).

Owns request parsing and validation (`parse_generate`, `parse_sampling_params`) and the
body → response functions (`run_generate`, `run_pause`, `run_abort`,
`run_update_weights_from_disk`, `run_update_weight_version`, `loads_body`, `model_info_body`,
`server_info_body`); their errors are `protocol_errors.ProtocolError`. Both transports call
these functions: the aiohttp app in `http_server.py` only moves JSON, and the in-process
`EngineClient` calls them directly, so the HTTP and in-process dicts cannot drift. Nothing here
imports aiohttp, so the in-process path works without the `serve` extra.
"""

from __future__ import annotations

import asyncio
import math
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any

from verst.engine import request_checks
from verst.engine.grammar import GRAMMAR_FIELDS, Constraint
from verst.engine.results import DetokenizeParams
from verst.engine.sampling import SEED_LIMIT, SamplingParams
from verst.engine.server.protocol_errors import contract_error, validation_error, value_error
from verst.engine.serving import ServingEngine
from verst.engine.stop_strings import MAX_STOPS, compile_stop_regex

SGLANG_TOP_K_ALL = 1 << 30
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
PAUSE_OK = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUE_OK = {"message": "Generation continued successfully.", "status": "ok"}

# S23's sampling_params contract: every key it accepts, with the value meaning "off". The engine
# implements the first group; the rest are accepted only at their off value (400 otherwise).
SAMPLING_SUPPORTED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
    "stream_interval",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop_regex",
    "logit_bias",
    *GRAMMAR_FIELDS,
}
SAMPLING_OFF: dict[str, Any] = {
    "structural_tag": None,
    "beam_width": None,
    "custom_params": None,
    "watermark": None,
    "choice": [],
}
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


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _number(d: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """A finite number of `kind` (an int may be written 3.0, as JSON allows), else a 400."""
    value = d.get(key)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(value, float):
        ok = math.isfinite(value) and (kind is float or value.is_integer())
    if ok and kind is float and isinstance(value, int):
        ok = abs(value) < 1 << 1000  # float() of a huge int overflows
    if not ok:
        what = "a finite number" if kind is float else "an int"
        raise contract_error(f"sampling_params.{key} must be {what}, got {value!r}")
    return kind(value)


def _flag(d: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    """A JSON boolean (or null for the default); "yes" or 1 is a 400, not a truthy value."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise contract_error(f"{where}{key} must be a boolean, got {value!r}")
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_sampling_params(
    raw: Any, prompt_len: int, context_len: int
) -> tuple[SamplingParams, DetokenizeParams, int]:
    """SGLang sampling_params → (engine params, detokenize options, n); 400 on a bad key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise contract_error(f"sampling_params must be an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if key in SAMPLING_SUPPORTED:
            continue
        if key not in SAMPLING_OFF:
            raise contract_error(f"sampling_params: unknown key {key!r}")
        if value is not None and value != SAMPLING_OFF[key]:
            raise value_error(f"sampling_params.{key} is not supported by the verst engine yet")
    max_new = _number(raw, "max_new_tokens", 128, int)
    temperature = _number(raw, "temperature", 1.0, float)
    if temperature < 0:  # checked before small temperatures become greedy
        raise value_error(f"sampling_params.temperature must be >= 0, got {temperature}")
    top_k = _number(raw, "top_k", SGLANG_TOP_K_ALL, int)
    n = _number(raw, "n", 1, int)
    if n < 1:
        raise value_error(f"sampling_params.n must be >= 1, got {n}")
    stop_list, stop_regex = _stops(raw, "stop"), _stops(raw, "stop_regex")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_token(t) for t in stop_ids):
        raise contract_error("sampling_params.stop_token_ids must be a list of ints")
    if context_len:
        check_context(prompt_len, raw.get("max_new_tokens"), context_len)
        max_new = min(max_new, context_len - prompt_len)  # only the default can be larger
    min_new = _min_new_tokens(raw, max_new, context_len - prompt_len if context_len else None)
    params = SamplingParams(
        max_new_tokens=max_new,
        # SGLang: temperature below 1e-6 is greedy.
        temperature=0.0 if temperature < 1e-6 else temperature,
        top_p=_number(raw, "top_p", 1.0, float),
        top_k=-1 if top_k == -1 or top_k >= SGLANG_TOP_K_ALL else top_k,
        min_p=_number(raw, "min_p", 0.0, float),
        stop_token_ids=list(stop_ids),
        ignore_eos=_flag(raw, "ignore_eos", False, "sampling_params."),
        sampling_seed=_number(raw, "sampling_seed", None, int),
        min_new_tokens=min_new,
        frequency_penalty=_number(raw, "frequency_penalty", 0.0, float),
        presence_penalty=_number(raw, "presence_penalty", 0.0, float),
        repetition_penalty=_number(raw, "repetition_penalty", 1.0, float),
        logit_bias=_logit_bias(raw.get("logit_bias")),
        constraint=_constraint(raw),
    )
    try:
        params.validate()
    except ValueError as error:
        raise value_error(str(error)) from error
    stream_interval = _number(raw, "stream_interval", 1, int)
    if stream_interval < 1:
        raise value_error(f"sampling_params.stream_interval must be >= 1, got {stream_interval}")
    detok = DetokenizeParams(
        stream_interval=stream_interval,
        stop=tuple(stop_list),
        stop_regex=tuple(stop_regex),
        no_stop_trim=_flag(raw, "no_stop_trim", False, "sampling_params."),
        skip_special_tokens=_flag(raw, "skip_special_tokens", True, "sampling_params."),
        spaces_between_special_tokens=_flag(
            raw, "spaces_between_special_tokens", True, "sampling_params."
        ),
    )
    return params, detok, n


def _constraint(raw: dict[str, Any]) -> Constraint | None:
    """`json_schema` / `regex` / `ebnf` (at most one; null is none) as a `Constraint`."""
    given = [key for key in GRAMMAR_FIELDS if raw.get(key) is not None]
    if len(given) > 1:
        raise value_error("Only one of regex, json_schema, or EBNF can be set.")
    if not given:
        return None
    value = raw[given[0]]
    if not isinstance(value, str):
        raise contract_error(f"sampling_params.{given[0]} must be a string")
    return Constraint(given[0], value)


def _min_new_tokens(raw: dict[str, Any], max_new: int, room: int | None) -> int:
    """`min_new_tokens` in [0, max_new_tokens], and within the `room` the context leaves."""
    min_new = _number(raw, "min_new_tokens", 0, int)
    if not 0 <= min_new <= max_new:
        raise value_error(
            f"sampling_params.min_new_tokens must be in [0, max_new_tokens={max_new}], "
            f"got {min_new}"
        )
    if room is not None and min_new > room:
        raise value_error(
            f"sampling_params.min_new_tokens ({min_new}) is more than the context leaves for "
            f"the output ({room} tokens)"
        )
    return min_new


def _stops(raw: dict[str, Any], key: str) -> list[str]:
    """`stop` / `stop_regex`: a string or a list of at most 32 non-empty ones; null or [] is
    none. Each regex must compile."""
    value = raw.get(key)
    stops = [] if value is None else _as_list(value)
    if not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise contract_error(f"sampling_params.{key} must be a string or a list of <= 32 strings")
    if any(not s for s in stops):
        raise value_error(f"sampling_params.{key} must not hold an empty string")
    if key == "stop_regex":
        for pattern in stops:
            try:
                compile_stop_regex(pattern)
            except ValueError as error:
                raise value_error(str(error)) from error
    return stops


_TOKEN_KEY = re.compile(r"-?[0-9]+")


def _logit_bias(value: Any) -> dict[int, float]:
    """SGLang's / OpenAI's `{"token id": bias}` (JSON keys are strings; in-process callers may
    use ints); null or {} is none. Ranges are checked by `SamplingParams.validate`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise contract_error("sampling_params.logit_bias must be an object of token id -> bias")
    bias: dict[int, float] = {}
    for key, number in value.items():
        if _is_token(key):
            token = key
        elif isinstance(key, str) and _TOKEN_KEY.fullmatch(key):
            token = int(key)
        else:
            raise contract_error(f"sampling_params.logit_bias key {key!r} is not a token id")
        ok = isinstance(number, (int, float)) and not isinstance(number, bool)
        if not ok or not abs(number) <= 1e30:  # NaN compares false
            raise contract_error(f"sampling_params.logit_bias[{key!r}] must be a finite number")
        bias[token] = float(number)
    return bias


def check_context(prompt_len: int, max_new_tokens: int | None, context_len: int) -> None:
    """SGLang's 400s for a prompt the context cannot hold, and for an explicit
    `max_new_tokens` that would run past it (never silently capped)."""
    if prompt_len >= context_len:
        raise value_error(
            f"The input ({prompt_len} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    if max_new_tokens is not None and prompt_len + max_new_tokens > context_len:
        raise value_error(
            "Requested token count exceeds the model's maximum context length of "
            f"{context_len} tokens. You requested a total of {prompt_len + max_new_tokens} "
            f"tokens: {prompt_len} tokens from the input messages and {max_new_tokens} tokens "
            "for the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."
        )


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
    if isinstance(input_ids, list) and all(_is_token(t) for t in input_ids):
        if not input_ids:
            raise value_error("input_ids cannot be empty.")
        return [list(input_ids)], False
    if (
        isinstance(input_ids, list)
        and input_ids
        and all(isinstance(p, list) and all(_is_token(t) for t in p) for p in input_ids)
    ):
        if any(not p for p in input_ids):
            raise value_error("input_ids cannot be empty.")
        return [list(p) for p in input_ids], True
    raise contract_error("input_ids must be a list of ints or a list of lists of ints")


def _per_prompt_fields(payload: dict[str, Any], n_prompts: int) -> tuple[Any, Any]:
    """`return_logprob` (a bool, or one per prompt) and `rid` (a string, or one per prompt),
    type-checked; `stream` too, though only the transport reads it."""
    _flag(payload, "stream", False)
    return_logprob = payload.get("return_logprob")
    if isinstance(return_logprob, list):
        if len(return_logprob) != n_prompts:
            raise contract_error("return_logprob list must have one entry per prompt")
        if not all(isinstance(b, bool) for b in return_logprob):
            raise contract_error("return_logprob must be a boolean or a list of booleans")
    else:
        return_logprob = _flag(payload, "return_logprob", False)
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
    if not all(t is None or (_is_token(t) and t >= 0) for t in tops):
        raise contract_error(f"top_logprobs_num must be an int >= 0 (or one per prompt): {top!r}")
    ids = payload.get("token_ids_logprob")
    if ids is None or (isinstance(ids, list) and all(_is_token(t) for t in ids)):
        id_lists = [ids] * n_prompts
    elif isinstance(ids, list) and len(ids) == n_prompts:
        id_lists = ids
    else:
        raise contract_error(
            "token_ids_logprob must be a list of token ids, or one list (or null) per prompt"
        )
    if not all(i is None or (isinstance(i, list) and all(map(_is_token, i))) for i in id_lists):
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
    params_list = _as_list(raw_params) if isinstance(raw_params, list) else None
    if params_list is not None and len(params_list) != len(prompts):
        raise contract_error("sampling_params list must have one entry per prompt")
    return_logprob, rid = _per_prompt_fields(payload, len(prompts))
    lora_paths = _lora_paths(payload, len(prompts))
    extras = _logprob_extras(payload, len(prompts))
    text_in_logprobs = _flag(payload, "return_text_in_logprobs", False)
    routed_experts = _flag(payload, "return_routed_experts", False)

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
        return_prompt_token_ids=_flag(payload, "return_prompt_token_ids", False),
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
