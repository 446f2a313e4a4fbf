"""Multi-turn verifiers environments: a `verifiers.v1` `Env` played with verst's model turns.

In verifiers 0.4 a multi-turn environment is an `Env` subclass whose `run(task, agents)` is the
conversation's control flow: it opens `agents.<role>.interaction(task)` and calls
`interaction.turn(message)` once per turn (the environment's message in, the model's reply out
as a `vf.Segment`), e.g. TextArena's game loop. `EnvEpisode` runs the env's own `setup`, `run`
and `finalize` with a stand-in for its one agent whose turns are verst's: each `turn` hands its
message to the episode (`verst.envs.runner` sends it to the model through the session server)
and waits for the model's reply. The exchange ends as verifiers ends it: `run` returns, a
terminated segment (the seat's `max_turns`, a task `@vf.stop` on the trace), or verst's
`env.max_turns`; closing the interaction scores the trace with the task's own rewards
(`Task.score`), and `run` and `finalize` may record more (`trace.record_reward`).

What the stand-in does not play, refused when the episode starts: more than one agent (or the
one marked untrainable), an agent pinned to another model, client or a harness other than
`null`, token limits, a borrowed runtime or tool servers, `agent.run` (a whole harness run),
request / response `@vf.stop`s and `@vf.intercept` hooks. The Env is built without its base
`__init__` (which loads harnesses, runtimes and the interception server that verst replaces):
`self.config` is validated from `env_args`; `self.taskset` is not set.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from verst.envs.base import Message
from verst.envs.verifiers_trace import (
    add_message,
    new_trace,
    system_messages,
    vf_module,
    wire_messages,
)
from verst.plugin_loader import load_object

Reply = tuple[Message, str]  # the model's assistant message and its finish reason
_DONE = object()  # the env's run and finalize are over


def load_env(spec: str, args: dict[str, Any]) -> Any:
    """The `vf.Env` that `spec` names (`pkg.mod:Class`, or a verifiers env id), its config
    validated from `args`; `ValueError` when verst cannot play it (see the module docstring)."""
    vf = vf_module()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import environment_class

    env_cls = load_object(spec) if ":" in spec else environment_class("", spec)
    if not (isinstance(env_cls, type) and issubclass(env_cls, vf.Env)):
        raise ValueError(f"env {spec!r} is not a vf.Env subclass")
    if env_cls.__init__ is not vf.Env.__init__:
        raise ValueError(f"env {spec!r} has its own __init__, which verst does not run")
    config_type = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    env = env_cls.__new__(env_cls)
    env.config = config_type.model_validate(args)
    roles = agent_config_fields(env.config)
    if len(roles) != 1:
        raise ValueError(
            f"env {spec!r} has agents {sorted(roles)}: verst plays exactly one (the policy)"
        )
    [(name, seat)] = roles.items()
    _check_seat(spec, name, seat)
    return env


def _check_seat(spec: str, name: str, seat: Any) -> None:
    pinned = [f for f in ("model", "client") if getattr(seat, f) is not None]
    if seat.harness is not None and seat.harness.id != "null":
        pinned.append(f"harness {seat.harness.id!r}")
    limits = ("max_input_tokens", "max_output_tokens", "max_total_tokens")
    pinned += [f for f in limits if getattr(seat, f) is not None]
    if pinned:
        raise ValueError(
            f"env {spec!r}: agent {name!r} sets {', '.join(pinned)}; verst plays the policy "
            "with plain chat turns (token limits: rollout.max_new_tokens and the context)"
        )


def check_task_hooks(task: Any) -> None:
    """`ValueError` for the task hooks a verst turn cannot run: `@vf.intercept`s and `@vf.stop`s
    on a request or response (a `@vf.stop` on the trace runs before each turn)."""
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    intercepts = [fn.__name__ for fn in discover_decorated(task, "intercept")]
    stops = [fn.__name__ for fn in task.hooks("stop") if not _on_trace(hook_boundary, fn)]
    if intercepts or stops:
        raise ValueError(
            f"verifiers: task {task.data.idx} has request/response hooks verst does not run: "
            f"{', '.join(intercepts + stops)}"
        )


def _on_trace(hook_boundary: Any, fn: Any) -> bool:
    from verifiers.v1.trace import Trace

    return hook_boundary(fn, allow_trace=True) is Trace


class EnvEpisode:
    """One episode of a `vf.Env` (see the module docstring): `start` gives the opening
    messages, `answer` takes each model turn and gives the environment's next messages, and
    None once the env is done; then `trace` holds the scored conversation."""

    def __init__(self, env: Any, task: Any) -> None:
        self.env, self.task = env, task
        self.exchange: Exchange | None = None
        self._asks: asyncio.Queue[Any] = asyncio.Queue()
        self._reply: asyncio.Future[Reply | None] | None = None
        self._play: asyncio.Task[None] | None = None

    @property
    def trace(self) -> Any:
        if self.exchange is None:
            raise RuntimeError("the env opened no interaction")
        return self.exchange.trace

    async def start(self) -> list[Message]:
        self._play = asyncio.create_task(self._run())
        opening = await self._next()
        if opening is None:
            raise ValueError(f"verifiers: {type(self.env).__name__}.run() played no turn")
        return opening

    async def answer(self, message: Message, finish_reason: str) -> list[Message] | None:
        return await self._deliver((message, finish_reason))

    async def end(self) -> None:
        """verst's turns ran out: the pending turn comes back terminated (`max_turns`)."""
        if await self._deliver(None) is not None:
            raise RuntimeError("the env asked for another turn after a terminated one")

    async def close(self) -> None:
        if self._play is not None and not self._play.done():
            self._play.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._play

    async def ask(self, messages: list[Message]) -> Reply | None:
        """The env's side: show the model `messages`; its reply (None: no more turns)."""
        self._reply = asyncio.get_running_loop().create_future()
        await self._asks.put(messages)
        return await self._reply

    async def _deliver(self, reply: Reply | None) -> list[Message] | None:
        if self._reply is None or self._reply.done():
            raise RuntimeError("no turn of the env is waiting for the model")
        self._reply.set_result(reply)
        return await self._next()

    async def _next(self) -> list[Message] | None:
        item = await self._asks.get()
        if isinstance(item, BaseException):
            raise item
        return None if item is _DONE else item

    async def _run(self) -> None:
        vf = vf_module()
        from verifiers.v1.episode import EnvInfo

        try:
            agents = vf.Agents(self.env.config, lambda name, spec: Seat(self, name, spec))
            await self.env.setup(agents)
            await self.env.run(self.task, agents)
            task = vf.TraceTask(
                type=type(self.task).__name__,
                data=self.task.data,
                key=self.task.key,
                hash=self.task.hash,
            )
            episode = vf.Episode(env=EnvInfo(id=type(self.env).__name__), task=task)
            episode.traces.append(self.trace)
            await self.env.finalize(self.task, episode)
            await self._asks.put(_DONE)
        except Exception as error:  # noqa: BLE001 - handed to the verst side, which raises it
            await self._asks.put(error)


class Seat:
    """The env's one agent, played by verst: only `interaction` (turn by turn)."""

    def __init__(self, episode: EnvEpisode, name: str, config: Any) -> None:
        self.episode, self.name, self.config = episode, name, config
        self.trainable = True

    async def run(self, task: Any, **_: Any) -> Any:
        raise ValueError(
            "verifiers: agent.run (a whole harness run) is not played by verst; "
            "an env that verst plays drives agent.interaction(task) turn by turn"
        )

    @contextlib.asynccontextmanager
    async def interaction(
        self,
        task: Any,
        *,
        runtime: Any = None,
        tools: Any = None,
        on_trace: Callable[[Any], None] | None = None,
    ) -> AsyncIterator[Exchange]:
        if runtime is not None or tools:
            raise ValueError("verifiers: verst's turns borrow no runtime or tool servers")
        if not self.trainable:
            raise ValueError(f"verifiers: the env marks agent {self.name!r} untrainable")
        if self.episode.exchange is not None:
            raise ValueError("verifiers: verst plays one interaction per episode")
        check_task_hooks(task)
        exchange = Exchange(self.episode, task, new_trace(task, self.config, self.name))
        self.episode.exchange = exchange
        if on_trace is not None:
            on_trace(exchange.trace)
        yield exchange
        await exchange.close()


class Exchange:
    """A `vf.Interaction` whose turns are verst's model turns (`turn`, `trace`, `close`)."""

    def __init__(self, episode: EnvEpisode, task: Any, trace: Any) -> None:
        self.episode, self.task, self.trace = episode, task, trace
        self._started = self._over = self._closed = False
        self._stops = task.hooks("stop")

    async def turn(self, message: str | list[Any] | None = None) -> Any:
        """verifiers' `Interaction.turn`: send `message`, run one model turn, its `Segment`."""
        vf = vf_module()
        if self._closed or self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        messages = self._turn_messages(message)
        if await self._refused():
            return self._terminated()
        reply = await self.episode.ask(messages)
        if reply is None:
            self.trace.stop("max_turns")
            return self._terminated()
        for m in messages:
            add_message(self.trace, m)
        add_message(self.trace, *reply)
        return vf.Segment(messages=[self.trace.nodes[-1].message])

    def _turn_messages(self, message: str | list[Any] | None) -> list[Message]:
        prompted = not self._started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: this exchange takes a user message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take a bare turn() first")
        opening = [] if self._started else system_messages(self.task)
        self._started = True
        return [*opening, *wire_messages(self.task.data.prompt if prompted else message)]

    async def _refused(self) -> bool:
        """verifiers' checks before each model call: the seat's `max_turns`, then the task's
        `@vf.stop`s on the trace; the first that fires is the trace's stop condition."""
        from verifiers.v1.session import RolloutLimits, call_hook

        vf = vf_module()
        limit = RolloutLimits(max_turns=self.trace.agent.config.max_turns).reached(self.trace)
        if limit is not None:
            self.trace.stop(limit)
            return True
        for stop in self._stops:
            fired = await call_hook(stop, {vf.Trace: self.trace})
            if not isinstance(fired, bool):
                raise TypeError(f"@stop must return bool, got {type(fired).__name__}")
            if fired:
                self.trace.stop(stop.__name__)
                return True
        return False

    def _terminated(self) -> Any:
        self._over = True
        return vf_module().Segment(messages=[], terminated=True)

    async def close(self) -> Any:
        """End the exchange (`user_closed` unless already stopped) and score it with the
        task's own metrics and rewards."""
        if not self._closed:
            self._closed = True
            self.trace.stop("user_closed")
            await self.task.score(self.trace)
            self.trace.is_completed = self.trace.ok = True
        return self.trace
