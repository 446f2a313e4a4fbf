"""Playing an environment as an agent function, so every token goes through the session server.

`env.name` names an `Environment` class; `EnvironmentAgent(cfg)` is then the run's agent
function (`verst.rollout.agent`): for each sample it takes a fresh sandbox from the pool (when
the environment needs one), builds the environment, and loops

    messages = env.reset(prompt, metadata)
    model turn via POST {base_url}/chat/completions (tools = the environment's schemas)
    action = the answer, its tool calls parsed by the session server in the template's format
    result = env.step(action); messages += result.observation; until done or env.max_turns

and, when the turns ran out before done, `env.truncate()` (a last reward, e.g. a checker's);
then closes the environment and the sandbox (kills what is left, deletes the work directory).

A malformed tool call, an unknown tool, bad arguments, and an environment that raises are
handled by `env.on_error`: `observe` sends the error back as the observation (a `tool` message,
or `user` when the turn made no call) and the episode goes on; `abort` ends it, and the agent
layer marks the sample ABORTED with the reason. A sandbox that cannot start, and an
environment that raises `EpisodeError` (its episode cannot go on), always abort.
The returned dict (merged into the sample's metadata) carries `env_reward` (the sum of the
steps' rewards; `env_reward` below is the reward function that reads it), `env_done`,
`env_steps`, `env_errors`, the last error if any, and each step's `info`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Any, Literal

from pydantic import Field, field_validator

from verst.configbase import ConfigBase
from verst.envs.base import (
    Environment,
    Message,
    StepResult,
    ToolCallError,
    check_calls,
    parse_action,
)
from verst.envs.sandbox.base import Sandbox
from verst.envs.sandbox.config import SandboxConfig
from verst.envs.sandbox.pool import SandboxPool
from verst.plugin_loader import PluginError, load_object
from verst.types import Sample

log = logging.getLogger(__name__)

BUILTIN_ENVS = {
    "python_tool": "verst.envs.python_tool:PythonToolEnv",
    "math": "verst.envs.math_env:MathEnv",
    "python_code": "verst.envs.python_code:PythonCodeEnv",
    "terminal": "verst.envs.terminal:TerminalEnv",
    "reasoning_gym": "verst.envs.reasoning_gym:ReasoningGymEnv",
    "openenv": "verst.envs.openenv_connector:OpenEnvEnvironment",
    "verifiers": "verst.envs.verifiers_connector:VerifiersEnvironment",
}


class EnvConfig(ConfigBase):
    """The `env` section: an environment played through the agent-function layer."""

    name: str | None = Field(
        None,
        description="the environment: a built-in (math, openenv, python_code, python_tool, "
        "reasoning_gym, terminal, verifiers) or 'pkg.mod:Class', an "
        "Environment subclass; unset = no environment",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="settings the environment reads (env.options; e.g. openenv's url, "
        "verifiers' taskset)",
    )
    max_turns: int = Field(4, ge=1, description="model turns per episode at most")
    on_error: Literal["observe", "abort"] = Field(
        "observe",
        description="a malformed or unknown tool call, or an environment that raises: observe "
        "= the error goes back to the model as the observation; abort = the sample is ABORTED",
    )
    max_observation_chars: int = Field(
        4000, ge=16, description="an observation message longer than this is cut"
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="the sandbox of each episode"
    )

    @field_validator("name")
    @classmethod
    def _loadable(cls, value: str | None) -> str | None:
        if value is not None:
            load_environment(value)
        return value


def load_environment(name: str) -> type[Environment]:
    """The Environment class named by a built-in name or an import path; `PluginError`."""
    path = BUILTIN_ENVS.get(name, name)
    try:
        obj = load_object(path)
    except (ImportError, ValueError) as error:
        builtins = ", ".join(sorted(BUILTIN_ENVS))
        raise PluginError(f"env.name: {error} (built-ins: {builtins})") from error
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise PluginError(f"env.name: {path!r} is not a verst.envs.base.Environment subclass")
    return obj


class EpisodeError(Exception):
    """Ends the episode; the agent layer records the message as the sample's agent_error."""


class EnvironmentAgent:
    """The agent function of `env.name` (see the module docstring)."""

    def __init__(self, cfg: EnvConfig) -> None:
        if cfg.name is None:
            raise ValueError("env.name: no environment to play")
        self.cfg = cfg
        self.env_cls = load_environment(cfg.name)
        # a pool per event loop: its refills are tasks of the loop that uses it
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SandboxPool] = (
            weakref.WeakKeyDictionary()
        )

    def pool(self) -> SandboxPool | None:
        """This event loop's sandbox pool; None when the environment needs no sandbox."""
        if not self.env_cls.needs_sandbox:
            return None
        loop = asyncio.get_running_loop()
        if loop not in self._pools:
            self._pools[loop] = SandboxPool(self.cfg.sandbox)
        return self._pools[loop]

    def close(self) -> None:
        """Close every sandbox the pools still hold (the run is over)."""
        for pool in list(self._pools.values()):
            pool.close()

    async def __call__(
        self,
        base_url: str,
        prompt: str | list[Message],
        request_kwargs: dict[str, Any],
        metadata: dict[str, Any],
    ) -> dict[str, Any]:
        import aiohttp

        pool = self.pool()
        box = None
        if pool is not None:
            try:
                box = await pool.acquire()
            except Exception as error:  # noqa: BLE001 - a provider failure ends only this episode
                raise EpisodeError(f"the sandbox could not start: {error}") from error
        try:
            async with aiohttp.ClientSession() as client:
                return await self._episode(client, box, base_url, prompt, request_kwargs, metadata)
        finally:
            if pool is not None and box is not None:
                await pool.release(box)

    async def _episode(
        self,
        client: Any,
        box: Sandbox | None,
        base_url: str,
        prompt: str | list[Message],
        request_kwargs: dict[str, Any],
        metadata: dict[str, Any],
    ) -> dict[str, Any]:
        env = self.env_cls(box, self.cfg.options)
        tally = _Tally()
        try:
            messages = list(await env.reset(prompt, metadata))
            schemas = [t.schema() for t in env.tools]
            for _ in range(self.cfg.max_turns):
                reply, finish = await _chat(client, base_url, messages, schemas, request_kwargs)
                messages.append(_history_entry(reply))
                result = await self._step(env, parse_action(reply, finish), tally)
                tally.add(result)
                if result.done:
                    break
                messages.extend(self._cut(m) for m in result.observation)
            else:
                last = await self._guard(env.truncate(), tally, "user")
                if last is not None:
                    tally.add(last, turn=False)
        finally:
            await env.close()
        return tally.summary()

    async def _step(self, env: Environment, action: Any, tally: _Tally) -> StepResult:
        """`env.step`, with bad calls and environment errors handled by `on_error`."""
        role = "tool" if action.tool_calls or action.malformed else "user"

        async def checked() -> StepResult:
            check_calls(action, env.tools)
            return await env.step(action)

        result = await self._guard(checked(), tally, role)
        return result if result is not None else StepResult()

    async def _guard(self, call: Any, tally: _Tally, role: str) -> StepResult | None:
        """Await an environment call; an error it raises is handled by `on_error` (abort, or
        a result whose observation is the error as a `role` message)."""
        try:
            return await call
        except (asyncio.CancelledError, EpisodeError):
            raise
        except Exception as error:  # noqa: BLE001 - a tool call or an environment failing
            if isinstance(error, ToolCallError):
                reason = f"tool call error: {error}"
            else:
                reason = f"environment error: {type(error).__name__}: {error}"
            tally.error(reason)
            if self.cfg.on_error == "abort":
                raise EpisodeError(reason) from error
            return StepResult(observation=[{"role": role, "content": f"error: {reason}"}])

    def _cut(self, message: Message) -> Message:
        limit, content = self.cfg.max_observation_chars, message.get("content")
        if isinstance(content, str) and len(content) > limit:
            message = {**message, "content": content[:limit] + "\n[output cut]"}
        return message


class _Tally:
    def __init__(self) -> None:
        self.reward, self.steps, self.done = 0.0, 0, False
        self.errors: list[str] = []
        self.info: dict[str, Any] = {}

    def add(self, result: StepResult, turn: bool = True) -> None:
        self.reward += float(result.reward)
        self.steps += int(turn)
        self.done = self.done or result.done
        self.info.update(result.info)

    def error(self, reason: str) -> None:
        self.errors.append(reason)

    def summary(self) -> dict[str, Any]:
        out = {
            **self.info,
            "env_reward": self.reward,
            "env_done": self.done,
            "env_steps": self.steps,
            "env_errors": len(self.errors),
        }
        if self.errors:
            out["env_last_error"] = self.errors[-1]
        return out


def _history_entry(reply: Message) -> Message:
    """The assistant message as the session server answered it (history is append-only)."""
    entry: Message = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("tool_calls"):
        entry["tool_calls"] = reply["tool_calls"]
    return entry


async def _chat(
    client: Any,
    base_url: str,
    messages: list[Message],
    tools: list[dict[str, Any]],
    request_kwargs: dict[str, Any],
) -> tuple[Message, str]:
    """One model turn on the session; (the assistant message, the finish reason)."""
    body = {k: v for k, v in request_kwargs.items() if k != "extra_body"}
    body.update(request_kwargs.get("extra_body") or {})
    body["messages"] = messages
    if tools:
        body["tools"] = tools
    async with client.post(f"{base_url.rstrip('/')}/chat/completions", json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise EpisodeError(f"the model call answered {response.status}: {text[:300]}")
    choice = json.loads(text)["choices"][0]
    return choice["message"], str(choice.get("finish_reason") or "stop")


def env_reward(sample: Sample) -> float:
    """The reward function of environment runs: the episode's summed step rewards."""
    value = sample.metadata.get("env_reward")
    if value is None:
        raise ValueError("the sample has no env_reward: was it played by an environment?")
    return float(value)
