"""The OpenEnv connector (`env.name: openenv`): an OpenEnv environment server played as a verst
environment, through OpenEnv's own client (PyPI `openenv-core`, `pip install verst[connectors]`).

    env:
      name: openenv
      options: {url: "http://127.0.0.1:8000", action_field: message, observation_field: prompt}

Each episode opens its own session on the server (`GenericEnvClient`, OpenEnv's WebSocket
protocol: the server builds a fresh environment per session), so episodes never share state.
`reset` sends the server's `reset` and turns its observation into the opening user message;
each model turn becomes one `step` whose action is `{action_field: the turn's text}`, and the
server's observation, reward and done come back as the step's. An observation is shown as its
`observation_field` when set and present, else as its JSON. The sample's `metadata` may carry
`openenv_reset` (a dict of keyword arguments for the server's `reset`, e.g. a seed).
"""

from __future__ import annotations

import json
from typing import Any

from verst.envs.base import Action, Environment, Message, StepResult


def _generic_client() -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as error:
        raise ImportError(
            "env.name: openenv needs openenv-core: pip install 'verst[connectors]'"
        ) from error
    return GenericEnvClient


class OpenEnvEnvironment(Environment):
    """An episode on an OpenEnv server (see the module docstring for `env.options`)."""

    async def reset(self, prompt: str | list[Message], metadata: dict[str, Any]) -> list[Message]:
        url = self.options.get("url")
        if not isinstance(url, str):
            raise ValueError("env.options.url: the OpenEnv server's address is not set")
        self.action_field = str(self.options.get("action_field", "message"))
        self.observation_field = self.options.get("observation_field")
        self.client = _generic_client()(base_url=url)
        await self.client.connect()
        first = await self.client.reset(**dict(metadata.get("openenv_reset") or {}))
        return [{"role": "user", "content": self._show(first.observation)}]

    async def step(self, action: Action) -> StepResult:
        result = await self.client.step({self.action_field: action.content})
        observation = [{"role": "user", "content": self._show(result.observation)}]
        reward = float(result.reward or 0.0)
        return StepResult(observation, reward=reward, done=bool(result.done))

    async def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            await client.close()

    def _show(self, observation: dict[str, Any]) -> str:
        field = self.observation_field
        if isinstance(field, str) and field in observation:
            return str(observation[field])
        return json.dumps(observation, default=str)
