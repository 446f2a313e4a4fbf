"""Teacher scoring for on-policy distillation (`loss.opd`): each sampled trajectory is sent to
its teacher's engine as a prefill (`max_new_tokens=0`, `return_logprob`, `logprob_start_len`),
and the teacher's log-prob of every response token lands in `sample.teacher_logprobs`.

A teacher is any server speaking SGLang's `/generate` (`verst serve --model DIR`, or SGLang);
which one scores a sample is `verst.train.opd.teacher_name`. One request per sample, all of a
step's requests at once. The teacher sees the very token ids the student sampled, so it must
tokenise as the student does: `check()` sends a probe text and compares the teacher's token ids
with the student tokenizer's before the run starts. Every failure names the teacher's field,
`loss.opd.teacher_urls.<name>`: `TeacherConfigError` (a ValueError, so `verst train` exits
with code 2) at the start, `TeacherError` when a teacher stops answering mid-run.

The teacher's log-probs are taken at the rollout temperature, as the student's are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from verst import distributed
from verst.fleet.client import EngineError, HttpEngineClient
from verst.train.opd import OPDConfig, teacher_name
from verst.types import Group, Sample

# digits, arithmetic, words, a newline; short, so that it fits a tiny model's context
PROBE_TEXT = "0123456789+-=?\nThe sum."


class TeacherConfigError(ValueError):
    """A teacher that cannot serve this run (unreachable, another tokenizer), found at start."""


class TeacherError(RuntimeError):
    """A teacher that failed to score a step's samples."""


class TeacherScorer:
    """Scores samples with the teachers of `cfg` (`loss.opd`) at `temperature`;
    `encode(text) -> ids` is the student's tokenizer."""

    def __init__(
        self, cfg: OPDConfig, encode: Callable[[str], list[int]], *, temperature: float
    ) -> None:
        self.cfg = cfg
        self.encode = encode
        self.temperature = temperature if temperature > 0 else 1.0

    def field(self, name: str) -> str:
        return f"loss.opd.teacher_urls.{name}"

    def check(self) -> None:
        """Every teacher answers and tokenises the probe text as the student does."""
        asyncio.run(self._with_clients(self._check_all))

    def score_groups(self, groups: list[Group], device: torch.device) -> dict[str, float]:
        """Set `teacher_logprobs` on every sample; `opd/reverse_kl` is the mean over all
        ranks' loss-masked tokens of (student − teacher) log-prob, a sample of
        KL(student ‖ teacher) on the student's own tokens."""
        samples = [s for group in groups for s in group]
        names = [teacher_name(s, self.cfg.teacher_urls) for s in samples]

        async def score_all(clients: dict[str, HttpEngineClient]) -> None:
            await asyncio.gather(
                *(self._score(clients, n, s) for n, s in zip(names, samples, strict=True))
            )

        if samples:
            asyncio.run(self._with_clients(score_all))
        total, count = 0.0, 0.0
        for sample in samples:
            assert sample.teacher_logprobs is not None
            for mask, student, teacher in zip(
                sample.loss_mask, sample.rollout_logprobs, sample.teacher_logprobs, strict=True
            ):
                total += mask * (student - teacher)
                count += mask
        total, count = distributed.all_reduce_sum([total, count], device)
        return {"opd/reverse_kl": total / max(count, 1.0)}

    # --- internals ------------------------------------------------------------------------------

    async def _with_clients(
        self, work: Callable[[dict[str, HttpEngineClient]], Coroutine[Any, Any, None]]
    ) -> None:
        # clients live for one event loop (an aiohttp session belongs to the loop it started on)
        clients = {
            name: HttpEngineClient(url, timeout_s=self.cfg.timeout_s)
            for name, url in self.cfg.teacher_urls.items()
        }
        try:
            await work(clients)
        finally:
            for client in clients.values():
                await client.close()

    async def _generate(
        self, client: HttpEngineClient, name: str, payload: dict[str, Any], error: type[Exception]
    ) -> dict[str, Any]:
        import aiohttp

        url = self.cfg.teacher_urls[name]
        try:
            body = await client.generate(payload)
        except EngineError as refused:
            raise error(f"{self.field(name)}: the teacher at {url} refused: {refused}") from None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as failure:
            reason = str(failure) or type(failure).__name__
            raise error(
                f"{self.field(name)}: the teacher at {url} does not answer: {reason}"
            ) from None
        if not isinstance(body, dict) or "input_token_logprobs" not in body.get("meta_info", {}):
            raise error(
                f"{self.field(name)}: the teacher at {url} gave no input_token_logprobs: is it "
                "a verst or SGLang server?"
            )
        return body

    def _payload(self, **fields: Any) -> dict[str, Any]:
        sampling = {"max_new_tokens": 0, "temperature": self.temperature}
        return {"sampling_params": sampling, "return_logprob": True, **fields}

    async def _check_all(self, clients: dict[str, HttpEngineClient]) -> None:
        await asyncio.gather(*(self._check(client, name) for name, client in clients.items()))

    async def _check(self, client: HttpEngineClient, name: str) -> None:
        payload = self._payload(text=PROBE_TEXT, logprob_start_len=0)
        body = await self._generate(client, name, payload, TeacherConfigError)
        teacher_ids = [int(triple[1]) for triple in body["meta_info"]["input_token_logprobs"]]
        student_ids = self.encode(PROBE_TEXT)
        if teacher_ids != student_ids:
            shorter = min(len(teacher_ids), len(student_ids))
            first = next((i for i in range(shorter) if teacher_ids[i] != student_ids[i]), shorter)
            raise TeacherConfigError(
                f"{self.field(name)}: the teacher at {self.cfg.teacher_urls[name]} has another "
                f"tokenizer than the student: a probe text is {len(teacher_ids)} tokens to the "
                f"teacher and {len(student_ids)} to the student, first different at token "
                f"{first}; a teacher scores the student's token ids, so both must share one"
            )

    async def _score(self, clients: dict[str, HttpEngineClient], name: str, sample: Sample) -> None:
        length = sample.response_length
        if length == 0:
            sample.teacher_logprobs = []
            return
        # from the last prompt token: its entry is None (SGLang's shape), the rest score the
        # response (a prompt of one token starts at 0, the same entries)
        payload = self._payload(
            input_ids=list(sample.tokens), logprob_start_len=max(sample.prompt_length - 1, 0)
        )
        body = await self._generate(clients[name], name, payload, TeacherError)
        scored = body["meta_info"]["input_token_logprobs"][-length:]
        values = [triple[0] for triple in scored]
        if len(values) != length or any(value is None for value in values):
            raise TeacherError(
                f"{self.field(name)}: the teacher at {self.cfg.teacher_urls[name]} scored "
                f"{len(values)} of the {length} response tokens of a sample"
            )
        sample.teacher_logprobs = [float(value) for value in values]
