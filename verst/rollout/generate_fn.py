"""The generate-function layer (`rollout.generate_function`): one sample's tokens and episode
loop written as a coroutine, in both modes.

A generate function (`verst.plugins.GenerateFunction`) gets an engine with one method,
`await engine.agenerate(request, key=...)`. In fully asynchronous mode that is the fleet
(`verst.rollout.source.AsyncRollout`); in synchronous mode it is a `TickBatcher` over the
step's engine: every call waiting at the same moment goes to the engine in one batch, so a
step's samples still decode together, turn by turn.

`generate_groups_with` runs the function on every sample of a step's groups. Nothing it does
stops the run: a function that raises or returns something other than a well-formed `Sample`
leaves its sample ABORTED with an empty response and the reason in
`metadata["abort_error"]`; the loop never trains on it.
"""

from __future__ import annotations

import asyncio
import copy
import logging

from verst.engine import GenerateOutput, GenerateRequest, SamplingParams
from verst.plugins import Decode, FleetGenerator, GenerateFunction, Generator
from verst.types import Group, Sample, Status

log = logging.getLogger(__name__)


class TickBatcher:
    """`agenerate` over a synchronous `Generator`: the requests made before the event loop
    next runs its callbacks go to `engine.generate` together."""

    def __init__(self, engine: Generator) -> None:
        self.engine = engine
        self._pending: list[tuple[GenerateRequest, asyncio.Future]] = []

    async def agenerate(
        self, request: GenerateRequest, *, key: str | None = None
    ) -> GenerateOutput:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        if not self._pending:
            # after every task already scheduled has taken its step, and made its request
            loop.call_soon(self._flush)
        self._pending.append((request, future))
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        try:
            outputs = self.engine.generate([request for request, _ in batch])
        except Exception as error:  # every waiting sample gets the engine's error
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), output in zip(batch, outputs, strict=True):
            if not future.done():
                future.set_result(output)


async def generate_one(
    fn: GenerateFunction,
    engine: FleetGenerator,
    sample: Sample,
    params: SamplingParams,
    decode: Decode,
) -> Sample:
    """`fn`'s trajectory for `sample`, checked: `TypeError` / `ValueError` when it returned no
    `Sample` or one whose per-token arrays disagree with its response length."""
    result = await fn(engine, sample, copy.copy(params), decode)
    if not isinstance(result, Sample):
        raise TypeError(
            f"rollout.generate_function returned a {type(result).__name__}, not a Sample"
        )
    if result.status == Status.PENDING:
        raise ValueError("rollout.generate_function returned a sample still PENDING")
    result.validate()
    return result


def aborted_copy(prompt: Sample, error: BaseException) -> Sample:
    """An empty trajectory of `prompt`, ABORTED, with the reason in `metadata["abort_error"]`."""
    aborted = prompt.clone_prompt(prompt.index)
    aborted.status = Status.ABORTED
    aborted.metadata["abort_error"] = f"{type(error).__name__}: {error}"
    return aborted


def generate_groups_with(
    fn: GenerateFunction,
    engine: Generator,
    decode: Decode,
    groups: list[Group],
    params: SamplingParams,
) -> list[Group]:
    """Every sample of `groups` through `fn`, concurrently (a `TickBatcher` batches their
    engine calls); returns the groups of the resulting samples, in order."""
    batcher = TickBatcher(engine)

    async def one(sample: Sample) -> Sample:
        prompt = sample.clone_prompt(sample.index)
        try:
            return await generate_one(fn, batcher, sample, params, decode)
        except Exception as error:
            log.warning("rollout.generate_function failed, sample aborted: %r", error)
            return aborted_copy(prompt, error)

    async def every() -> list[Sample]:
        return list(await asyncio.gather(*(one(s) for group in groups for s in group)))

    samples = iter(asyncio.run(every()))
    return [[next(samples) for _ in group] for group in groups]
