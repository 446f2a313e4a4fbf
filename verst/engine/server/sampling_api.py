"""SGLang's `sampling_params` as plain functions: `parse_sampling_params` turns one request's
dict into the engine's `SamplingParams`, its `DetokenizeParams` and `n`, or raises the 400
SGLang answers with. Owns the contract's accepted keys (`SAMPLING_SUPPORTED`, and those accepted
only at their off value), the context-length checks (`check_context`) and the JSON field checks
`/generate`'s top-level fields share (`flag`, `is_token`). `/generate` (`sglang_api`) and the
OpenAI routes (`openai_api`) both parse through here.
"""

from __future__ import annotations

import math
import re
from typing import Any

from verst.engine.grammar import GRAMMAR_FIELDS, Constraint
from verst.engine.results import DetokenizeParams
from verst.engine.sampling import SamplingParams
from verst.engine.server.protocol_errors import contract_error, value_error
from verst.engine.stop_strings import MAX_STOPS, compile_stop_regex

SGLANG_TOP_K_ALL = 1 << 30

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


def flag(d: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    """A JSON boolean (or null for the default); "yes" or 1 is a 400, not a truthy value."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise contract_error(f"{where}{key} must be a boolean, got {value!r}")
    return value


def is_token(value: Any) -> bool:
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
    if not isinstance(stop_ids, list) or not all(is_token(t) for t in stop_ids):
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
        ignore_eos=flag(raw, "ignore_eos", False, "sampling_params."),
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
        no_stop_trim=flag(raw, "no_stop_trim", False, "sampling_params."),
        skip_special_tokens=flag(raw, "skip_special_tokens", True, "sampling_params."),
        spaces_between_special_tokens=flag(
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
        if is_token(key):
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
