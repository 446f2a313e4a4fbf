"""Connectors to environment libraries, against the real packages from PyPI, offline.

OpenEnv (`openenv-core`): an environment written on OpenEnv's own classes, served by OpenEnv's
own FastAPI app (`create_app`) under uvicorn on loopback, played through `env.name: openenv`
(OpenEnv's `GenericEnvClient`, one WebSocket session per episode): scripted turns, then whole
episodes through the agent layer and the session server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

openenv_types = pytest.importorskip("openenv.core.env_server.types")
pytest.importorskip("uvicorn")

from openenv.core.env_server.http_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment as OpenEnvBase  # noqa: E402

from tests.test_builtin_envs import scripted  # noqa: E402
from tests.test_envs import play, sessions_url  # noqa: E402, F401
from verst.envs.openenv_connector import OpenEnvEnvironment  # noqa: E402
from verst.envs.runner import EnvConfig, EnvironmentAgent  # noqa: E402
from verst.types import Status  # noqa: E402


class GuessAction(openenv_types.Action):
    message: str


class GuessObservation(openenv_types.Observation):
    prompt: str = ""


class GuessEnv(OpenEnvBase):
    """Guess a digit: the secret is the reset's seed mod 10; three tries."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Any:
        self.secret, self.tries = (seed or 0) % 10, 0
        return GuessObservation(prompt="guess a digit")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any) -> Any:
        self.tries += 1
        right = action.message.strip() == str(self.secret)
        done = right or self.tries >= 3
        hint = "right" if right else "wrong"
        return GuessObservation(prompt=hint, reward=float(right), done=done)

    @property
    def state(self) -> openenv_types.State:
        return openenv_types.State(step_count=getattr(self, "tries", 0))


@pytest.fixture(scope="module")
def openenv_url() -> Iterator[str]:
    import uvicorn

    app = create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_openenv_episode_with_scripted_turns(openenv_url: str) -> None:
    options = {"url": openenv_url, "action_field": "message", "observation_field": "prompt"}
    cfg = EnvConfig(name="openenv", options=options)
    meta = {"openenv_reset": {"seed": 7}}
    turns = [{"content": "3"}, {"content": "7"}]
    opening, [miss, hit], _ = scripted(OpenEnvEnvironment, cfg, "ignored", meta, turns)
    assert opening == [{"role": "user", "content": "guess a digit"}]
    assert miss.observation == [{"role": "user", "content": "wrong"}] and not miss.done
    assert miss.reward == 0.0 and hit.done and hit.reward == 1.0
    with pytest.raises(ValueError, match="env.options.url"):
        scripted(OpenEnvEnvironment, EnvConfig(name="openenv"), "x", {}, [])


def test_openenv_episodes_through_the_session_server(
    openenv_url: str,
    sessions_url: str,  # noqa: F811
) -> None:
    options = {"url": openenv_url, "observation_field": "prompt"}
    agent = EnvironmentAgent(EnvConfig(name="openenv", options=options, max_turns=3))
    samples = play(sessions_url, agent, n=4)
    for sample in samples:  # a random model guesses: three wrong tries end the episode
        assert sample.status is not Status.ABORTED, sample.metadata
        meta = sample.metadata
        assert 1 <= meta["env_steps"] <= 3 and meta["num_turns"] == meta["env_steps"]
        assert meta["env_reward"] in (0.0, 1.0)
        assert meta["messages"][0]["content"] == "guess a digit"


def test_an_openenv_server_that_is_not_there_aborts_the_sample(sessions_url: str) -> None:  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    agent = EnvironmentAgent(EnvConfig(name="openenv", options={"url": dead}))
    for sample in play(sessions_url, agent, n=2):
        assert sample.status is Status.ABORTED
        assert "agent_error" in sample.metadata
