"""The OpenAI-compatible routes (`/v1/completions`, `/v1/chat/completions`) over a
`ServingEngine`, built on the native protocol in `sglang_api.py`: OpenAI bodies are translated to
`/generate` jobs (chat prompts through the tokenizer's chat template, with the request's tools:
`openai_tools`) and the results back to OpenAI's response and streaming-chunk shapes, with
OpenAI's error envelope.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from verst.chat.families import template_messages
from verst.engine.server.openai_logprobs import chat_logprobs, completion_logprobs
from verst.engine.server.openai_tools import ChatTools, chat_tools, tool_message
from verst.engine.server.protocol_errors import ProtocolError, openai_error
from verst.engine.server.sampling_api import parse_sampling_params
from verst.engine.server.sglang_api import (
    GenerateItem,
    GenerateJob,
    check_job,
    run_job,
    sample_params,
)
from verst.engine.serving import ServingEngine

# ---- OpenAI-compatible -----------------------------------------------------------------------

OPENAI_OFF: dict[str, Any] = {
    "suffix": None,
    "best_of": None,
}


# OpenAI request fields passed on as SGLang sampling_params of another name (or the same).
OPENAI_SAMPLING_NAMES = {
    "min_tokens": "min_new_tokens",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "stop_regex": "stop_regex",
    "regex": "regex",  # SGLang's extra fields on the OpenAI routes
    "ebnf": "ebnf",
}


def _token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _content(message: Any) -> Any:
    """A message's content as text (content parts: only text is supported)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise openai_error("each message needs a role (a string)")
    content = message.get("content")
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        if not all(isinstance(p, str) for p in parts):
            raise openai_error("a content part's text must be a string")
        return "".join(parts)
    if content is not None and not isinstance(content, str):
        raise openai_error("a message's content must be a string or a list of content parts")
    return content


def _chat_prompt(payload: dict[str, Any], tokenizer: Any, tools: ChatTools | None) -> list[int]:
    if payload.get("input_ids") is not None:
        if not _token_list(payload["input_ids"]):
            raise openai_error("input_ids must be a non-empty list of token ids")
        return list(payload["input_ids"])
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise openai_error("messages must be a non-empty list")
    normalized = []
    for message in messages:
        content = _content(message)  # checks the message is an object first
        normalized.append({**message, "content": content})
    kwargs = payload.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise openai_error("chat_template_kwargs must be an object")
    continue_final = bool(payload.get("continue_final_message"))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if tools is not None and "tools" not in template:
        raise openai_error("this model's chat template does not render tools")
    try:
        text = tokenizer.apply_chat_template(
            template_messages(normalized),
            tools=tools.tools if tools is not None else None,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **kwargs,
        )
    except Exception as error:  # the template rejects these messages: the request's fault
        raise openai_error(f"the chat template cannot render these messages: {error}") from error
    return tokenizer.encode(text, add_special_tokens=False)


def _openai_prompts(
    payload: dict[str, Any], tokenizer: Any, chat: bool, tools: ChatTools | None
) -> list[list[int]]:
    if chat:
        return [_chat_prompt(payload, tokenizer, tools)]
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if _token_list(prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt]
        if all(_token_list(p) for p in prompt):
            return [list(p) for p in prompt]
    raise openai_error("prompt must be a string, a list of strings or a list of token ids")


def _check_envelope(payload: Any, *, chat: bool) -> None:
    """400s for a body that is not an object, fields the engine does not honour, and bad
    stream options."""
    if not isinstance(payload, dict):
        raise openai_error("the request body must be a JSON object")
    if not chat and payload.get("tools") not in (None, []):
        raise openai_error("tools are only supported on /v1/chat/completions")
    for key, off in OPENAI_OFF.items():
        value = payload.get(key)
        if value is not None and value != off and value != []:
            raise openai_error(f"{key} is not supported by the verst engine yet")
    if not isinstance(payload.get("stream", False) or False, bool):
        raise openai_error("stream must be a boolean")
    stream_options = payload.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise openai_error("stream_options must be an object")
    if not isinstance(stream_options.get("include_usage", False), bool):
        raise openai_error("stream_options.include_usage must be a boolean")


def _raw_sampling(payload: dict[str, Any], tools: ChatTools | None) -> dict[str, Any]:
    """The body's sampling fields under SGLang's names (None where unset); a forced tool
    choice constrains the answer to its calls."""
    raw: dict[str, Any] = {
        "temperature": payload.get("temperature"),
        "top_p": payload.get("top_p"),
        "top_k": payload.get("top_k"),
        "min_p": payload.get("min_p"),
        "n": payload.get("n"),
        "stop": payload.get("stop"),
        "stop_token_ids": payload.get("stop_token_ids"),
        "ignore_eos": payload.get("ignore_eos"),
        "skip_special_tokens": payload.get("skip_special_tokens"),
        "no_stop_trim": payload.get("no_stop_trim"),
        "sampling_seed": payload.get("seed"),
        **{key: payload.get(name) for name, key in OPENAI_SAMPLING_NAMES.items()},
        "json_schema": _response_format_schema(payload.get("response_format")),
    }
    if tools is not None and tools.forced:
        if raw["json_schema"] is not None or raw["regex"] is not None or raw["ebnf"] is not None:
            raise openai_error(
                "tool_choice 'required' or a named function constrains the answer itself; "
                "it cannot be combined with response_format, regex or ebnf"
            )
        raw["json_schema"] = tools.call_schema()
    return raw


def parse_openai(
    payload: Any, tokenizer: Any, context_len: int, *, chat: bool, tools: ChatTools | None = None
) -> GenerateJob:
    """An OpenAI completions / chat body → the same job `/generate` runs; `tools` are the
    chat request's, checked (`openai_tools.chat_tools`)."""
    _check_envelope(payload, chat=chat)
    logprobs, top, start = _logprob_options(payload, chat=chat)
    if chat:
        max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
    else:
        max_tokens = payload.get("max_tokens", 16)
    raw = _raw_sampling(payload, tools)
    prompts = _openai_prompts(payload, tokenizer, chat, tools)
    lora_path = payload.get("lora_path")
    if lora_path is not None and (not isinstance(lora_path, str) or not lora_path):
        raise openai_error("lora_path must be the name of a loaded adapter")
    parsed = []
    for prompt in prompts:
        sampling = {k: v for k, v in raw.items() if v is not None}
        # Chat without max_tokens may use the rest of the context, as SGLang does.
        sampling["max_new_tokens"] = (
            max_tokens if max_tokens is not None else max(context_len - len(prompt), 0)
        )
        try:
            parsed.append(parse_sampling_params(sampling, len(prompt), context_len))
        except ProtocolError as error:
            inner = error.body.get("error")
            message = inner if isinstance(inner, str) else inner["message"]
            for name, key in OPENAI_SAMPLING_NAMES.items():
                message = message.replace(f"sampling_params.{key}", name)
            raise openai_error(message) from error
    n = parsed[0][2]
    base = str(payload.get("rid") or uuid.uuid4().hex)
    for _, detok, _ in parsed:
        detok.return_text_in_logprobs = logprobs  # OpenAI's log-probs name tokens by their text
    items = [
        GenerateItem(
            prompt,
            sample_params(params, j),
            detok,
            rid=base if len(prompts) * n == 1 else f"{base}_{i * n + j}",
            return_logprob=logprobs,
            logprob_start_len=start,
            lora_path=lora_path,
            top_logprobs_num=top,
        )
        for i, (prompt, (params, detok, _)) in enumerate(zip(prompts, parsed, strict=True))
        for j in range(n)
    ]
    return GenerateJob(items=items, is_list=True, return_prompt_token_ids=False, n=n)


def _response_format_schema(response_format: Any) -> str | None:
    """OpenAI `response_format` as SGLang's `json_schema` (a JSON string), as SGLang maps it:
    `json_object` is any object; `json_schema` takes its `schema`; `text` is none."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise openai_error("response_format must be an object")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise openai_error("response_format.json_schema.schema must be a JSON schema object")
        return json.dumps(schema)
    raise openai_error(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}"
    )


def _logprob_options(payload: dict[str, Any], *, chat: bool) -> tuple[bool, int, int]:
    """(return_logprob, top_logprobs_num, logprob_start_len) of an OpenAI body. Chat:
    `logprobs` (a boolean) and `top_logprobs` (alternatives per token, needs `logprobs`).
    Completions: `logprobs` (alternatives per token, 0 for none; null for no log-probs at all)
    and `echo` (the prompt first in `text`, and in the log-probs from its first token)."""
    count_key = "top_logprobs" if chat else "logprobs"
    top = payload.get(count_key)
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
        raise openai_error(f"{count_key} must be an int >= 0, got {top!r}")
    if chat:
        logprobs = payload.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise openai_error(f"logprobs must be a boolean, got {logprobs!r}")
        if top and not logprobs:
            raise openai_error("top_logprobs needs logprobs: true")
        return bool(logprobs), top or 0, -1
    echo = payload.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise openai_error(f"echo must be a boolean, got {echo!r}")
    return top is not None, top or 0, 0 if echo and top is not None else -1


async def prepare_openai(
    serving: ServingEngine, tokenizer: Any, payload: Any, *, chat: bool
) -> tuple[GenerateJob, ChatTools | None]:
    """An OpenAI completions / chat body → its checked job and the chat request's tools
    (400s in OpenAI's envelope)."""
    if not isinstance(payload, dict):
        raise openai_error("the request body must be a JSON object")
    tools = chat_tools(payload) if chat else None
    # Rendering and tokenizing a long prompt takes seconds: never on the event loop.
    job = await asyncio.to_thread(
        parse_openai, payload, tokenizer, serving.context_len, chat=chat, tools=tools
    )
    try:
        check_job(serving, job)
    except ProtocolError as error:  # a token id outside the vocabulary: OpenAI's envelope
        raise openai_error(error.body["error"]["message"]) from error
    return job, tools


def is_echo(payload: dict[str, Any], chat: bool) -> bool:
    """Completions' `echo: true` (the prompt first in each choice's text)."""
    return not chat and payload.get("echo") is True


def echo_texts(payload: dict[str, Any], tokenizer: Any) -> list[str]:
    """The prompt text `echo` puts before each prompt's completions (token prompts decoded)."""
    prompt = payload["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    prompts = [prompt] if all(isinstance(t, int) for t in prompt) else prompt
    return [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]


def openai_finish(meta: dict[str, Any]) -> tuple[str, Any]:
    finish = meta["finish_reason"]
    matched = finish.get("matched") if finish["type"] == "stop" else None
    return finish["type"], matched


async def run_openai(
    serving: ServingEngine,
    tokenizer: Any,
    payload: Any,
    served_model_name: str,
    *,
    chat: bool,
    tool_format: str | None = None,
) -> dict[str, Any]:
    """An OpenAI completions / chat body → its (non-streamed) response body; chat tool calls
    are parsed in `tool_format` (None: the chat template's family's)."""
    job, tools = await prepare_openai(serving, tokenizer, payload, chat=chat)
    results = await run_job(serving, job)
    echo = is_echo(payload, chat)
    echoed = echo_texts(payload, tokenizer) if echo else []
    choices = []
    for index, result in enumerate(results):
        meta = result["meta_info"]
        finish, matched = openai_finish(meta)
        logprobs = None
        item = job.items[index]
        if item.return_logprob and chat:
            logprobs = chat_logprobs(meta)
        elif item.return_logprob:
            logprobs = completion_logprobs(meta, echo=echo, top=item.top_logprobs_num > 0)
        choice: dict[str, Any] = {"index": index}
        if chat:
            content, calls = (
                tool_message(tokenizer, result, tools, tool_format)
                if tools
                else (result["text"], None)
            )
            if calls and finish == "stop":
                finish, matched = "tool_calls", None
            choice["message"] = {
                "role": "assistant",
                "content": content,
                "reasoning_content": None,
                "tool_calls": calls,
            }
        else:
            choice["text"] = (echoed[index // job.n] if echo else "") + result["text"]
        choice.update(logprobs=logprobs, finish_reason=finish, matched_stop=matched)
        choices.append(choice)
    prompt_tokens = sum(r["meta_info"]["prompt_tokens"] for r in results[:: job.n])
    completion_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": served_model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "metadata": {"weight_version": serving.weight_version},
    }
