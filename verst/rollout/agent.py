"""The agent-function layer: multi-turn rollouts written as ordinary OpenAI-client code.

`rollout.agent_function: "pkg.mod:run_agent"` names a coroutine function

    async def run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None

that plays one trajectory. `base_url` is `{sessions_url}/sessions/{id}/v1` on verst's session
server, so `openai.AsyncOpenAI(base_url=base_url, api_key="none")` works against it; `prompt` is
the sample's prompt (text, or a message list); `request_kwargs` are the rollout's sampling
settings as chat-completion arguments (`model`, `max_tokens`, `temperature`, `top_p`, and
`extra_body` for `top_k` / `stop_token_ids`), to pass on with `**request_kwargs`; `metadata` is
a copy of the sample's metadata (the data row's extra fields) with its `label`. The agent calls
the model as often as it likes, runs tools, and returns a dict (merged into the sample's
metadata, where the reward function can read it) or None.

For every sample of every group, `run_agent_groups`:

1. opens a session (`POST /sessions`) and runs the agent on it, at most `max_concurrency` at a
   time, each within `timeout_s`;
2. assembles the session into the sample (`POST /sessions/{id}/samples`): the tokens exactly as
   the engine saw and sampled them, loss mask 1 on sampled tokens and 0 on prompt, tool and
   user tokens, rollout log-probs aligned to them, one weight version per turn, cut on a turn
   boundary at `max_seq_len` (status TRUNCATED); `metadata` gets `session_id`, `num_turns`,
   `dropped_turns`, `mismatch`, the conversation (`messages`) and the last answer's text
   (`response_text`), then the agent's dict;
3. deletes the session, which releases its routing key.

Nothing an agent does stops the run: an agent that raises, runs past `timeout_s`, returns
something other than a dict or None, or makes no model call, and a session server that fails,
leave the sample ABORTED with an empty response and the reason in `metadata["agent_error"]`.
Rewards are computed afterwards (`score_agent_groups`: the reward function on every sample that
is not ABORTED; aborted ones get 0.0).

Agents must not block the event loop for long (use `AsyncOpenAI`, not `OpenAI`): they share a
loop with each other, and a blocked loop also stalls their timeouts.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from typing import Any

from pydantic import Field, field_validator

from verst.configbase import ConfigBase
from verst.models.moe import decode_routed_experts
from verst.plugin_loader import load_plugin
from verst.plugins import AgentFunction
from verst.sessions.templates import MISMATCH_TYPES
from verst.types import Group, Sample, Status

log = logging.getLogger(__name__)


class AgentError(Exception):
    """Why one trajectory was aborted (the message goes to `metadata["agent_error"]`)."""


class AgentConfig(ConfigBase):
    """The agent-function fields of the rollout section (`RolloutConfig` inherits them)."""

    agent_function: str | None = Field(
        None,
        description="multi-turn rollout: 'pkg.mod:run_agent', an async function (base_url, "
        "prompt, request_kwargs, metadata) -> dict | None that talks to the model through the "
        "OpenAI API of a session; unset = single-turn generation",
    )
    agent_timeout_s: float = Field(
        300.0, gt=0, description="an agent running longer than this is cancelled (ABORTED)"
    )
    agent_max_concurrency: int = Field(64, ge=1, description="agents (sessions) running at once")
    agent_max_seq_len: int | None = Field(
        None,
        gt=0,
        description="assembled trajectories longer than this (prompt + all turns, in tokens) "
        "are cut on a turn boundary and marked TRUNCATED; unset = no limit",
    )

    @field_validator("agent_function")
    @classmethod
    def _agent_importable(cls, value: str | None) -> str | None:
        if value is not None:
            load_agent_fn(value)
        return value


def load_agent_fn(path: str) -> AgentFunction:
    """The coroutine function named by 'pkg.mod:fn'; `PluginError` when it is not one that
    takes (base_url, prompt, request_kwargs, metadata)."""
    return load_plugin(path, AgentFunction, field="rollout.agent_function")


def agent_request_kwargs(
    *,
    model: str,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    stop_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The rollout's sampling settings as `chat.completions.create` keyword arguments; what the
    OpenAI client has no parameter for goes in `extra_body` (the session server reads both)."""
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
    }
    extra: dict[str, Any] = {}
    if top_k > 0:
        extra["top_k"] = top_k
    if stop_token_ids:
        extra["stop_token_ids"] = list(stop_token_ids)
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def close_agent(agent_fn: AgentFunction | None) -> None:
    """End of the run: an agent function object with a `close()` method (an environment's,
    which holds sandboxes) releases what it holds."""
    close = getattr(agent_fn, "close", None)
    if callable(close) and not isinstance(agent_fn, type):
        close()


# ---- running agents --------------------------------------------------------------------------


def _abort(sample: Sample, prompt_tokens: list[int], reason: str) -> None:
    """An empty response (nothing to train on) with the reason."""
    sample.tokens = list(prompt_tokens)
    sample.response_length = 0
    sample.loss_mask = []
    sample.rollout_logprobs = []
    sample.weight_versions = []
    sample.status = Status.ABORTED
    sample.metadata["agent_error"] = reason


def _fill(sample: Sample, assembled: dict[str, Any], summary: dict[str, Any]) -> None:
    tokens = [int(t) for t in assembled["tokens"]]
    response_length = int(assembled["response_length"])
    sample.tokens = tokens
    sample.response_length = response_length
    sample.loss_mask = [int(m) for m in assembled["loss_mask"]]
    sample.rollout_logprobs = [float(lp) for lp in assembled["rollout_logprobs"]]
    sample.weight_versions = [int(v) for v in assembled["weight_versions"]]
    sample.status = Status(assembled["status"])
    if assembled.get("routed_experts") is not None:
        sample.routed_experts = decode_routed_experts(assembled["routed_experts"], len(tokens) - 1)
    sample.validate()
    meta = assembled.get("metadata") or {}
    messages = summary.get("messages") or []
    answers = [m for m in messages if m.get("role") == "assistant"]
    kept = answers[: int(meta.get("num_turns", len(answers)))]
    sample.metadata.update(
        session_id=meta.get("session_id"),
        num_turns=meta.get("num_turns"),
        dropped_turns=meta.get("dropped_turns"),
        mismatch=meta.get("mismatch"),
        messages=messages,
        response_text=(kept[-1].get("content") or "") if kept else "",
    )


async def _json(response: Any, what: str) -> Any:
    text = await response.text()
    if response.status != 200:
        raise AgentError(f"{what} answered {response.status}: {text[:500]}")
    try:
        return json.loads(text)
    except ValueError as error:
        raise AgentError(f"{what} answered non-JSON: {text[:200]}") from error


async def run_agent_sample(
    client: Any | None,
    sessions_url: str,
    sample: Sample,
    agent_fn: AgentFunction,
    request_kwargs: dict[str, Any],
    *,
    timeout_s: float,
    max_seq_len: int | None = None,
) -> Sample:
    """One trajectory into `sample`, in place (see the module docstring); never raises except
    on cancellation. `client` is an aiohttp ClientSession to reuse; None opens one for the
    trajectory."""
    import aiohttp

    if client is None:
        async with aiohttp.ClientSession() as own:
            return await run_agent_sample(
                own,
                sessions_url,
                sample,
                agent_fn,
                request_kwargs,
                timeout_s=timeout_s,
                max_seq_len=max_seq_len,
            )
    base = sessions_url.rstrip("/")
    prompt_tokens = list(sample.prompt_tokens)
    started = time.perf_counter()
    sid: str | None = None
    try:
        try:
            async with client.post(f"{base}/sessions") as r:
                sid = (await _json(r, "POST /sessions"))["session_id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError) as error:
            raise AgentError(f"could not open a session at {base}: {error!r}") from error
        result = await _call_agent(
            agent_fn, f"{base}/sessions/{sid}/v1", sample, request_kwargs, timeout_s
        )
        await _assemble(client, f"{base}/sessions/{sid}", sample, max_seq_len)
        if result:
            sample.metadata.update(result)
    except AgentError as error:
        _abort(sample, prompt_tokens, str(error))
        log.warning("agent trajectory aborted (session %s): %s", sid, error)
    finally:
        sample.metadata["agent_time_s"] = time.perf_counter() - started
        if sid is not None:
            await _delete(client, base, sid)
    return sample


async def _call_agent(
    agent_fn: AgentFunction,
    url: str,
    sample: Sample,
    request_kwargs: dict[str, Any],
    timeout_s: float,
) -> dict[str, Any] | None:
    """The agent's play on its session (`url`), with copies of what it may mutate."""
    metadata = copy.deepcopy(sample.metadata)
    metadata.setdefault("label", copy.deepcopy(sample.label))
    try:
        result = await asyncio.wait_for(
            agent_fn(
                url,
                copy.deepcopy(sample.prompt),
                copy.deepcopy(request_kwargs),
                metadata,
            ),
            timeout_s,
        )
    except asyncio.TimeoutError:
        raise AgentError(f"the agent ran past its {timeout_s:g} s timeout") from None
    except asyncio.CancelledError:
        raise
    except Exception as error:  # anything the agent raises aborts only this sample
        raise AgentError(f"the agent raised {type(error).__name__}: {error}") from error
    if result is not None and not isinstance(result, dict):
        raise AgentError(f"the agent returned a {type(result).__name__}, not a dict or None")
    return result


async def _assemble(client: Any, url: str, sample: Sample, max_seq_len: int | None) -> None:
    """The finished session assembled into `sample` (tokens, loss mask, log-probs, versions)."""
    import aiohttp

    try:
        async with client.post(f"{url}/samples", json={"max_seq_len": max_seq_len}) as r:
            if r.status == 422:
                detail = (await r.json(content_type=None))["error"]["message"]
                raise AgentError(f"the session cannot be assembled: {detail}")
            assembled = await _json(r, "POST /sessions/{id}/samples")
        async with client.get(url) as r:
            summary = await _json(r, "GET /sessions/{id}")
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError) as error:
        raise AgentError(f"could not assemble session {url}: {error!r}") from error
    try:
        _fill(sample, assembled, summary)
    except (KeyError, TypeError, ValueError) as error:
        raise AgentError(f"session {url} assembled into a bad sample: {error}") from error


async def _delete(client: Any, base: str, sid: str) -> None:
    import aiohttp

    try:
        async with client.delete(f"{base}/sessions/{sid}") as r:
            if r.status not in (200, 404):
                log.warning("DELETE session %s answered %d", sid, r.status)
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        log.warning("could not delete session %s: %r", sid, error)


async def run_agent_groups(
    sessions_url: str,
    groups: list[Group],
    agent_fn: AgentFunction,
    request_kwargs: dict[str, Any],
    *,
    timeout_s: float,
    max_concurrency: int,
    max_seq_len: int | None = None,
) -> list[Group]:
    """Run the agent on every sample of every group (filled in place); returns `groups`."""
    import aiohttp

    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    gate = asyncio.Semaphore(max_concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as client:

        async def one(sample: Sample) -> None:
            async with gate:
                await run_agent_sample(
                    client,
                    sessions_url,
                    sample,
                    agent_fn,
                    request_kwargs,
                    timeout_s=timeout_s,
                    max_seq_len=max_seq_len,
                )

        await asyncio.gather(*(one(s) for group in groups for s in group))
    return groups


def agent_metrics(groups: list[Group], device: Any = None) -> dict[str, float]:
    """Agent rollout figures over every rank's samples: the aborted share, turns per finished
    trajectory, seconds per trajectory, and the `tito/mismatch_*` chat-template mismatch."""
    samples = [s for group in groups for s in group]
    done = [s for s in samples if s.status != Status.ABORTED]
    totals = [
        float(len(samples)),
        float(len(samples) - len(done)),
        float(len(done)),
        float(sum(s.metadata.get("num_turns") or 0 for s in done)),
        float(sum(s.metadata.get("agent_time_s", 0.0) for s in samples)),
    ]
    if device is not None:
        from verst import distributed

        totals = distributed.all_reduce_sum(totals, device)
    n, aborted, finished, turns, seconds = totals
    return (
        {
            "rollout/agent_aborted_ratio": aborted / max(n, 1.0),
            "rollout/agent_turns_mean": turns / max(finished, 1.0),
            "rollout/agent_time_s_mean": seconds / max(n, 1.0),
        }
        | _env_metrics(done, device)
        | _tito_metrics(done, device)
    )


def _tito_metrics(done: list[Sample], device: Any) -> dict[str, float]:
    """The chat-template mismatch of finished trajectories against a canonical re-render
    (`ChatTokenizer.mismatch`), per kind, as a mean per measured trajectory; nonzero values of
    any kind but `assistant_text` mean a TITO or template bug (docs/chat_templates.md)."""
    measured = [
        s.metadata["mismatch"] for s in done if isinstance(s.metadata.get("mismatch"), dict)
    ]
    totals = [float(len(measured))]
    totals += [float(sum(m.get(kind, 0) for m in measured)) for kind in MISMATCH_TYPES]
    if device is not None:
        from verst import distributed

        totals = distributed.all_reduce_sum(totals, device)
    n = totals[0]
    if n == 0:
        return {}
    kinds = zip(MISMATCH_TYPES, totals[1:], strict=True)
    return {"tito/mismatch_measured": n} | {f"tito/mismatch_{k}": t / n for k, t in kinds}


def _env_metrics(done: list[Sample], device: Any) -> dict[str, float]:
    """Over finished trajectories played by an environment (`verst.envs.runner`): the share
    that reached the environment's end, and its steps and errors per trajectory."""
    played = [s.metadata for s in done if "env_steps" in s.metadata]
    totals = [
        float(len(played)),
        float(sum(bool(m["env_done"]) for m in played)),
        float(sum(m["env_steps"] for m in played)),
        float(sum(m["env_errors"] for m in played)),
    ]
    if device is not None:
        from verst import distributed

        totals = distributed.all_reduce_sum(totals, device)
    n, finished, steps, errors = totals
    if n == 0:
        return {}
    return {
        "rollout/env_done_ratio": finished / n,
        "rollout/env_steps_mean": steps / n,
        "rollout/env_errors_mean": errors / n,
    }
