"""A built-in terminal environment (`env.name: terminal`): a shell in the episode's sandbox, a
task description, and a checker script run at the end.

The sample's row carries the task: its prompt is the description, `files` (path → text) are
written into the work directory before the first turn, and `check` is a shell script whose exit
status is the verdict (0 = solved). Tool `sh(cmd)` runs `cmd` under `/bin/sh -c` in the work
directory and returns its output. The episode ends at a turn without a tool call, or when
`env.max_turns` runs out; either way the checker then runs in the same sandbox, on the state the
model left, and the reward is 1.0 when it exits 0.

`terminal_tasks` generates a small procedural task set of this shape (`data.task: terminal`).
"""

from __future__ import annotations

import random
from typing import Any

from verst.envs.base import Message, StepResult, ToolEnvironment, tool
from verst.envs.python_tool import describe_run

_STRING = {"type": "string"}


class TerminalEnv(ToolEnvironment):
    needs_sandbox = True

    async def reset(self, prompt: str | list[Message], metadata: dict[str, Any]) -> list[Message]:
        check = metadata.get("check")
        if not isinstance(check, str) or not check.strip():
            raise ValueError("terminal: the sample has no 'check' script (a row field)")
        files = metadata.get("files") or {}
        if not isinstance(files, dict):
            raise ValueError("terminal: the row field 'files' must map paths to text")
        assert self.sandbox is not None
        for path, text in files.items():
            self.sandbox.put(str(path), str(text))
        self.check, self.commands = check, 0
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return list(prompt)

    @tool("Run a shell command in the work directory; returns its output", {"cmd": _STRING})
    async def sh(self, cmd: str) -> str:
        assert self.sandbox is not None
        self.commands += 1
        result = await self.sandbox.run(cmd)
        return describe_run(result.stdout, result.stderr, result.exit_code, result.timed_out)

    async def answer(self, text: str) -> StepResult:
        return await self._verdict()

    async def truncate(self) -> StepResult:
        return await self._verdict()

    async def _verdict(self) -> StepResult:
        assert self.sandbox is not None
        result = await self.sandbox.run(["/bin/sh", "-c", self.check])
        info = {"solved": result.ok, "commands": self.commands}
        return StepResult(reward=float(result.ok), done=True, info=info)


_NAMES = [f"{c}{d}" for c in "abcdefgh" for d in range(10)]
_WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "sea", "sky"]


def _write_task(rng: random.Random) -> dict[str, Any]:
    name, value = rng.choice(_NAMES), rng.randint(10, 99)
    return {
        "prompt": f"put {value} in {name}",
        "label": f"echo {value}>{name}",
        "files": {},
        "check": f'[ "$(cat {name})" = {value} ]',
    }


def _copy_task(rng: random.Random) -> dict[str, Any]:
    src, dst = rng.sample(_NAMES, 2)
    word = rng.choice(_WORDS)
    return {
        "prompt": f"copy {src} to {dst}",
        "label": f"cp {src} {dst}",
        "files": {src: word + "\n"},
        "check": f'[ "$(cat {dst})" = {word} ]',
    }


def _count_task(rng: random.Random) -> dict[str, Any]:
    src, dst = rng.sample(_NAMES, 2)
    lines = rng.randint(2, 9)
    return {
        "prompt": f"count lines of {src} into {dst}",
        "label": f"wc -l<{src}>{dst}",
        "files": {src: "".join(rng.choice(_WORDS) + "\n" for _ in range(lines))},
        "check": f'[ "$(tr -d " " < {dst})" = {lines} ]',
    }


_KINDS = {"write": _write_task, "copy": _copy_task, "count": _count_task}


def terminal_tasks(
    seed: int, size: int = 2000, kinds: tuple[str, ...] = ("write", "copy", "count")
) -> list[dict[str, Any]]:
    """`size` distinct terminal tasks of `kinds`, in an order shuffled by `seed`; each row's
    label is one command that solves it (what a warm start imitates)."""
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown:
        raise ValueError(f"terminal: unknown task kinds {unknown}; known: {sorted(_KINDS)}")
    rng = random.Random(seed)
    rows: dict[str, dict[str, Any]] = {}
    for _ in range(size * 20):
        if len(rows) == size:
            break
        row = _KINDS[rng.choice(list(kinds))](rng)
        rows.setdefault(row["prompt"], row)
    if len(rows) < size:
        raise ValueError(f"terminal: only {len(rows)} distinct tasks of kinds {list(kinds)}")
    return list(rows.values())
