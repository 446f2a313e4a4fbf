"""SGLang's `/generate` bodies from and to the engine's `GenerateRequest` / `GenerateOutput`."""

from __future__ import annotations

from typing import Any

from verst.engine import GenerateOutput, GenerateRequest, SamplingParams
from verst.models.moe import decode_routed_experts


def request_body(request: GenerateRequest) -> dict[str, Any]:
    """A `GenerateRequest` as SGLang's `/generate` body."""
    params = request.sampling_params
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
    }
    if params.sampling_seed is not None:
        sampling["sampling_seed"] = params.sampling_seed
    sampling.update(_penalties(params))
    body: dict[str, Any] = {
        "input_ids": list(request.input_ids),
        "sampling_params": sampling,
        "return_logprob": request.return_logprob,
        "rid": request.rid,
    }
    if request.logprob_start_len >= 0:
        body["logprob_start_len"] = request.logprob_start_len
    if request.lora_path is not None:
        body["lora_path"] = request.lora_path
    if request.top_logprobs_num > 0:
        body["top_logprobs_num"] = request.top_logprobs_num
    if request.token_ids_logprob is not None:
        body["token_ids_logprob"] = list(request.token_ids_logprob)
    if request.return_routed_experts:
        body["return_routed_experts"] = True
    return body


def _penalties(params: SamplingParams) -> dict[str, Any]:
    """The penalties a request sets, SGLang-named; none when off (a server without them, or
    the vLLM client, then sees the same body as before)."""
    fields: dict[str, Any] = {}
    if params.min_new_tokens:
        fields["min_new_tokens"] = params.min_new_tokens
    for name, off in (
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ):
        if getattr(params, name) != off:
            fields[name] = getattr(params, name)
    if params.logit_bias:
        fields["logit_bias"] = {str(t): b for t, b in params.logit_bias.items()}
    return fields


def _version(value: Any) -> int | str:
    text = str(value)
    return int(text) if text.lstrip("-").isdigit() else text


def _top(rows: Any) -> list[Any]:
    """SGLang's per-position `[[logprob, id, text], ...]` (or null) as (logprob, id) pairs."""
    return [None if row is None else [(float(e[0]), int(e[1])) for e in row] for row in rows or []]


def _chosen(rows: Any) -> list[Any]:
    return [None if row is None else [float(e[0]) for e in row] for row in rows or []]


def output_from_body(request: GenerateRequest, body: dict[str, Any]) -> GenerateOutput:
    """SGLang's `/generate` answer as a `GenerateOutput` (finish reason stop | length | abort)."""
    meta = body["meta_info"]
    ids = list(body["output_ids"])
    logprobs = [float(triple[0]) for triple in meta.get("output_token_logprobs") or []]
    token_versions: list[int | str] = []
    for span in meta.get("weight_versions") or []:
        token_versions += [_version(span["version"])] * (span["end"] - span["start"])
    if len(token_versions) != len(ids):
        token_versions = [_version(meta["weight_version"])] * len(ids)
    input_logprobs = [
        None if triple[0] is None else float(triple[0])
        for triple in meta.get("input_token_logprobs") or []
    ]
    routed = meta.get("routed_experts")
    if routed is not None:  # SGLang's rows: every position but the last
        rows = int(meta["prompt_tokens"]) + len(ids) - 1
        routed = decode_routed_experts(routed, rows)
    return GenerateOutput(
        rid=request.rid,
        output_ids=ids,
        output_token_logprobs=logprobs,
        finish_reason=meta["finish_reason"]["type"],
        prompt_tokens=int(meta["prompt_tokens"]),
        completion_tokens=int(meta["completion_tokens"]),
        weight_version=_version(meta["weight_version"]),  # type: ignore[arg-type]
        cached_tokens=int(meta.get("cached_tokens", 0)),
        input_token_logprobs=input_logprobs,
        token_weight_versions=token_versions,
        output_top_logprobs=_top(meta.get("output_top_logprobs")),
        input_top_logprobs=_top(meta.get("input_top_logprobs")),
        output_token_ids_logprobs=_chosen(meta.get("output_token_ids_logprobs")),
        input_token_ids_logprobs=_chosen(meta.get("input_token_ids_logprobs")),
        routed_experts=routed,
    )
