"""A built-in tool environment: the model may run Python in the episode's sandbox before it
answers (`env.name: python_tool`).

Tool `python(code)`: runs `code` with `python3` in the sandbox's work directory and returns its
stdout (and stderr, and the exit status when it failed, or that it timed out). A turn without
a tool call is the answer: reward 1.0 when it matches the sample's label, as a number when the
label is one (the last number in the answer), otherwise as stripped text.
"""

from __future__ import annotations

from typing import Any

from verst.envs.base import Message, StepResult, ToolEnvironment, tool
from verst.rollout.rewards import parse_last_number


def answer_matches(text: str, label: Any) -> bool:
    """The answer's last number equals a numeric label; otherwise the stripped texts match."""
    try:
        want = float(str(label).strip())
    except ValueError:
        return text.strip() == str(label).strip()
    got = parse_last_number(text)
    return got is not None and abs(got - want) < 1e-9


def describe_run(stdout: str, stderr: str, exit_code: int, timed_out: bool) -> str:
    """A command's result as the text an observation carries."""
    parts = [stdout.rstrip("\n")] if stdout else []
    if stderr:
        parts.append(f"stderr: {stderr.rstrip()}")
    if timed_out:
        parts.append("timed out (killed)")
    elif exit_code != 0:
        parts.append(f"exit status {exit_code}")
    return "\n".join(parts) if parts else "(no output)"


class PythonToolEnv(ToolEnvironment):
    needs_sandbox = True

    async def reset(self, prompt: str | list[Message], metadata: dict[str, Any]) -> list[Message]:
        self.label = metadata.get("label")
        self.tool_runs = 0
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return list(prompt)

    @tool("Run Python 3 code; returns what it prints", {"code": {"type": "string"}})
    async def python(self, code: str) -> str:
        assert self.sandbox is not None
        self.tool_runs += 1
        self.sandbox.put("main.py", code)
        result = await self.sandbox.run(["python3", "main.py"])
        return describe_run(result.stdout, result.stderr, result.exit_code, result.timed_out)

    async def answer(self, text: str) -> StepResult:
        correct = answer_matches(text, self.label)
        info = {"answer": text.strip(), "correct": correct, "tool_runs": self.tool_runs}
        return StepResult(reward=float(correct), done=True, info=info)
