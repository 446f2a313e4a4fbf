"""The environment contract: multi-turn episodes of reset → observation, step → observation,
reward, done, with tools declared once as OpenAI tool schemas.

    class MyEnv(ToolEnvironment):
        @tool("Run a shell command in the sandbox", {"cmd": {"type": "string"}})
        async def shell(self, cmd: str) -> str: ...

        async def reset(self, prompt, metadata) -> list[Message]: ...
        async def answer(self, text: str) -> StepResult: ...   # a turn with no tool call

An environment never talks to the model. `verst.envs.runner` plays it through the agent-function
layer: the model's turns go through the session server (so every token is recorded), which
parses tool calls out of the model's text in the chat template family's format
(`verst.chat.tool_parsers`: Hermes / Qwen `<tool_call>{json}</tool_call>`, GLM-4, DeepSeek-V3,
Mistral); the
runner turns each answer into an `Action`, checks its calls against the declared tools, and
hands `step` only calls that name a declared tool with the arguments it requires.
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from verst.chat.tool_parsers import TOOL_PARSERS
from verst.envs.sandbox.base import Sandbox

Message = dict[str, Any]
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


class ToolCallError(ValueError):
    """A tool call the environment cannot run: malformed, unknown, or with bad arguments."""


@dataclass(frozen=True)
class Tool:
    """One tool, declared once: its name, what it does, and its parameters (JSON schema
    properties, all required unless listed in `optional`)."""

    name: str
    description: str
    parameters: dict[str, dict[str, Any]]
    optional: tuple[str, ...] = ()

    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema (`tools=[...]` of a chat completion)."""
        required = [p for p in self.parameters if p not in self.optional]
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": self.parameters,
                    "required": required,
                },
            },
        }

    def check(self, arguments: dict[str, Any]) -> None:
        """`ToolCallError` naming the argument that is missing, unknown or of the wrong type."""
        missing = [p for p in self.parameters if p not in self.optional and p not in arguments]
        if missing:
            raise ToolCallError(f"{self.name}: missing argument {missing[0]!r}")
        for key, value in arguments.items():
            spec = self.parameters.get(key)
            if spec is None:
                raise ToolCallError(f"{self.name}: unknown argument {key!r}")
            types = _JSON_TYPES.get(spec.get("type", ""), (object,))
            wrong_bool = isinstance(value, bool) and bool not in types
            if not isinstance(value, types) or wrong_bool:
                raise ToolCallError(f"{self.name}: argument {key!r} must be a {spec['type']}")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Action:
    """One model turn as the environment sees it: its text, its well-formed tool calls, and
    what could not be read as a call (`malformed`, one message each)."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    finish_reason: str = "stop"


@dataclass
class StepResult:
    """What a step gives back: messages for the model (tool results, a user turn), the
    step's reward, whether the episode is over, and facts for the sample's metadata."""

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def parse_action(message: Message, finish_reason: str = "stop") -> Action:
    """An OpenAI assistant message (as the session server answers it) → an `Action`.

    The session server leaves a tool call it cannot read in the text; text that still holds a
    tool-call marker of any family, calls whose arguments are not a JSON object, and the calls
    of a turn cut at the token limit go to `malformed`."""
    content = message.get("content") or ""
    action = Action(content=content, finish_reason=finish_reason)
    for raw in message.get("tool_calls") or []:
        fn = raw.get("function") or {}
        name, arguments = fn.get("name"), fn.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        if not isinstance(name, str) or not isinstance(parsed, dict):
            action.malformed.append(f"tool call {name!r}: arguments are not a JSON object")
            continue
        action.tool_calls.append(ToolCall(str(raw.get("id") or ""), name, parsed))
    marker = next((p.start for p in TOOL_PARSERS.values() if p.start in content), None)
    if marker is not None:
        action.malformed.append(f"a {marker} tool call that is not well-formed")
    if finish_reason == "length" and action.tool_calls:
        # the model never ended its turn: running its calls would reward whatever it wrote up
        # to the token limit, and RL then stops learning to end the turn
        action.malformed.append(
            "tool calls in a turn cut at the token limit (finish_reason length)"
        )
        action.tool_calls = []
    return action


class Environment(ABC):
    """One episode. Built by the runner with the episode's sandbox (None unless
    `needs_sandbox`) and `env.options`, reset once, stepped until done or the turn limit,
    then closed."""

    needs_sandbox: ClassVar[bool] = False

    def __init__(
        self, sandbox: Sandbox | None = None, options: dict[str, Any] | None = None
    ) -> None:
        self.sandbox = sandbox
        self.options = dict(options or {})  # `env.options`: settings of the run's environment

    @property
    def tools(self) -> list[Tool]:
        return []

    @abstractmethod
    async def reset(self, prompt: str | list[Message], metadata: dict[str, Any]) -> list[Message]:
        """The opening messages (the prompt, and any system message), given the sample's
        prompt and a copy of its metadata with its `label`."""

    @abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Act on one model turn; its tool calls name declared tools with valid arguments."""

    async def truncate(self) -> StepResult | None:
        """The episode ran out of turns (`env.max_turns`) before it was done: a last result,
        e.g. a checker's verdict on the state the model left, or None for nothing more."""
        return None

    async def close(self) -> None:  # noqa: B027 (an optional hook)
        """Release what the episode holds (the runner closes its sandbox itself)."""


ToolHandler = Callable[..., Awaitable[str]]


def tool(
    description: str, parameters: dict[str, dict[str, Any]], optional: tuple[str, ...] = ()
) -> Callable[[ToolHandler], ToolHandler]:
    """Declare an `async def` method of a `ToolEnvironment` as a tool named after it."""

    def mark(fn: ToolHandler) -> ToolHandler:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {fn.__name__} must be an async method")
        fn.__verst_tool__ = Tool(fn.__name__, description, parameters, optional)  # type: ignore[attr-defined]
        return fn

    return mark


class ToolEnvironment(Environment):
    """An environment whose turns are tool calls (each answered by its method's return
    value, as a `tool` message) until a turn without one, which `answer` scores."""

    declared: ClassVar[dict[str, Tool]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.declared = {
            t.name: t
            for name in dir(cls)
            if (t := getattr(getattr(cls, name, None), "__verst_tool__", None)) is not None
        }

    @property
    def tools(self) -> list[Tool]:
        return list(self.declared.values())

    async def step(self, action: Action) -> StepResult:
        if not action.tool_calls:
            return await self.answer(action.content)
        observation = []
        for call in action.tool_calls:
            output = await getattr(self, call.name)(**call.arguments)
            observation.append({"role": "tool", "tool_call_id": call.id, "content": output})
        return StepResult(observation=observation)

    @abstractmethod
    async def answer(self, text: str) -> StepResult:
        """Score a turn without a tool call (the episode's final answer, usually)."""


def check_calls(action: Action, tools: list[Tool]) -> None:
    """`ToolCallError` for the first malformed call, unknown tool, or bad arguments."""
    if action.malformed:
        raise ToolCallError(action.malformed[0])
    declared = {t.name: t for t in tools}
    for call in action.tool_calls:
        if call.name not in declared:
            known = ", ".join(sorted(declared)) or "none"
            raise ToolCallError(f"unknown tool {call.name!r} (tools: {known})")
        declared[call.name].check(call.arguments)
