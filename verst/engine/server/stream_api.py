"""Streamed `/generate` over a `ServingEngine`: a job's items as chunks while they decode.

Owns `item_stream` (one item's cumulative results, then its final one), `merged` (the streams
of a job's items as one, each result tagged with its item's index) and `generate_chunks`
(SGLang's `/generate` stream: cumulative `text` and `output_ids`, `meta_info` per chunk with
`finish_reason` null until the last, `index` when the request is a batch or has `n` > 1), and
`error_event`, the event a stream that fails after it started ends with. No aiohttp here: the
handlers write these chunks as server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from verst.engine.requests import GenerateRequest
from verst.engine.results import GenerateResult
from verst.engine.server.protocol_errors import ProtocolError, value_error
from verst.engine.server.sglang_api import GenerateItem, GenerateJob
from verst.engine.serving import ServingEngine

_END = object()  # a merged stream's marker: that item's stream has ended


async def item_stream(serving: ServingEngine, item: GenerateItem) -> AsyncIterator[GenerateResult]:
    """One item's results as it decodes; a request the engine refuses is SGLang's 400."""
    request = GenerateRequest(
        list(item.input_ids),
        item.params,
        rid=item.rid,
        return_logprob=item.return_logprob,
        logprob_start_len=item.logprob_start_len,
        lora_path=item.lora_path,
        top_logprobs_num=item.top_logprobs_num,
        token_ids_logprob=item.token_ids_logprob,
    )
    results = serving.generate_stream(request, item.detokenize)
    async with contextlib.aclosing(results):
        try:
            async for result in results:
                yield result
        except ValueError as error:
            raise value_error(str(error)) from error


async def merged(
    serving: ServingEngine, items: list[GenerateItem]
) -> AsyncIterator[tuple[int, GenerateResult]]:
    """Every item's stream at once, as (item index, result) in the order they come. A queue
    of one slot per item keeps each item's results coalescing in its own stream while the
    consumer is busy; an item that fails ends the whole stream with its error."""
    if len(items) == 1:
        async with contextlib.aclosing(item_stream(serving, items[0])) as results:
            async for result in results:
                yield 0, result
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=len(items))

    async def pump(index: int, item: GenerateItem) -> None:
        try:
            async with contextlib.aclosing(item_stream(serving, item)) as results:
                async for result in results:
                    await queue.put((index, result))
        except Exception as error:  # handed to the consumer, which raises it
            await queue.put((index, error))
        await queue.put((index, _END))

    tasks = [asyncio.create_task(pump(i, item)) for i, item in enumerate(items)]
    try:
        running = len(tasks)
        while running:
            index, result = await queue.get()
            if result is _END:
                running -= 1
            elif isinstance(result, Exception):
                raise result
            else:
                yield index, result
    finally:
        for task in tasks:
            task.cancel()  # a consumer that left: every item's request is aborted
        await asyncio.gather(*tasks, return_exceptions=True)


async def generate_chunks(serving: ServingEngine, job: GenerateJob) -> AsyncIterator[Any]:
    """SGLang's `/generate` stream of a checked job (`check_job`): cumulative chunks."""
    async for index, result in merged(serving, job.items):
        chunk = result.to_dict()
        if job.return_prompt_token_ids:
            chunk["prompt_token_ids"] = job.items[index].input_ids
        if job.is_list:
            chunk["index"] = index
        yield chunk


def error_event(error: Exception) -> dict[str, Any]:
    """The event a stream that fails once started ends with (S14+'s shape), before `[DONE]`."""
    status, message = 500, f"{type(error).__name__}: {error}"
    if isinstance(error, ProtocolError):
        status = error.status
        inner = error.body.get("error") if isinstance(error.body, dict) else None
        if isinstance(inner, dict):
            message = inner.get("message", message)
        elif isinstance(inner, str):
            message = inner
        elif isinstance(error.body, dict) and "message" in error.body:
            message = error.body["message"]
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return {"error": {"message": message, "type": kind, "code": status, "retryable": False}}
