"""verifiers conversations on both sides: a `verifiers.v1` task's opening messages as OpenAI
chat messages (what verst sends the model), and a conversation as a `vf.Trace` (what the task's
rewards read). Shared by the single-turn connector and the multi-turn env player."""

from __future__ import annotations

from typing import Any

from verst.envs.base import Message

_FINISH_REASONS = ("stop", "length", "tool_calls")


def vf_module() -> Any:
    """`verifiers.v1`, or an `ImportError` that says how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ImportError(
            "env.name: verifiers needs verifiers: pip install 'verst[verifiers]'"
        ) from error
    return vf


def system_messages(task: Any) -> list[Message]:
    """The task's system prompt as a system message (none when it has none)."""
    system_prompt = task.data.system_prompt
    return [] if system_prompt is None else [{"role": "system", "content": system_prompt}]


def wire_messages(messages: Any) -> list[Message]:
    """A verifiers prompt or turn (text: one user message; else typed or wire messages) as
    OpenAI chat messages."""
    from verifiers.v1.dialects.chat import message_to_wire

    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [m if isinstance(m, dict) else message_to_wire(m) for m in messages]


def opening_messages(task: Any) -> list[Message]:
    """The task's opening messages as OpenAI chat messages: its system prompt, then its
    prompt (text as one user message, or its messages), as verifiers' `null` harness sends."""
    if task.data.prompt is None:
        raise ValueError(
            f"verifiers: task {task.data.idx} has no prompt (the user opens the conversation): "
            "it needs a user agent, which this connector does not play"
        )
    return [*system_messages(task), *wire_messages(task.data.prompt)]


def new_trace(task: Any, agent: Any = None, name: str = "verst") -> Any:
    """An empty `vf.Trace` of `task`, played by the agent `name` (config `agent`)."""
    vf = vf_module()
    from verifiers.v1.state import state_cls

    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=vf.AgentInfo(config=agent or vf.AgentConfig(), name=name),
    )


def add_message(trace: Any, message: Message, finish_reason: str | None = None) -> None:
    """Append `message` to the trace as a message node, the child of the last one; a model
    turn (`finish_reason` set) is a sampled node with its model call. No token ids: verst
    keeps the sampled tokens itself."""
    vf = vf_module()
    from verifiers.v1.dialects.chat import parse_message

    index = len(trace.nodes)
    sampled = finish_reason is not None
    trace.nodes.append(
        vf.MessageNode(
            parent=index - 1 if index else None,
            message=parse_message(message),
            sampled=sampled,
        )
    )
    if sampled:
        finish = finish_reason if finish_reason in _FINISH_REASONS else None
        trace.calls.append(
            vf.ModelCall(node=index, endpoint="/chat/completions", finish_reason=finish)
        )


def build_trace(task: Any, messages: list[Message], finish_reasons: dict[int, str]) -> Any:
    """A finished `vf.Trace` of the conversation: one message node per message, the model's
    turns (the indices in `finish_reasons`) sampled, stopped as `agent_completed`."""
    trace = new_trace(task)
    for i, message in enumerate(messages):
        add_message(trace, message, finish_reasons.get(i))
    trace.stop("agent_completed")
    return trace
