"""Warm-start data for `examples/terminal_agent.yaml`: the built-in `terminal` environment
(`env.name: terminal`), where the model solves toy shell tasks in a bubblewrap sandbox.

A trajectory is one model call: the model writes a shell command as a tool call in the chat
template's format,

    <tool_call>{"name":"sh","arguments":{"cmd":"echo 42>a3"}}</tool_call>

the session server parses it, the environment runs it in the episode's sandbox, the turns run
out (`env.max_turns: 1`) and the task's checker script decides the reward on what the command
left behind. The SFT warm start imitates one solving command per task, on tasks of the `dev`
split; RL runs on the `train` split (`data.task: terminal`), the warm start's check on `test`.

    python examples/terminal_agent.py --write-data    # regenerate examples/data/terminal_*
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verst.data.tasks import make_task

END = "<|im_end|>"


def tool_call(cmd: str) -> str:
    call = {"name": "sh", "arguments": {"cmd": cmd}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def write_data(out: Path, *, seed: int = 0) -> None:
    sft = [
        {"prompt": r["prompt"], "label": tool_call(r["label"]) + END}
        for r in make_task("terminal", "dev", seed)
    ]
    dev = [
        {"prompt": r["prompt"], "label": tool_call(r["label"]) + END}
        for r in make_task("terminal", "test", seed)
    ]
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("terminal_sft", sft), ("terminal_dev", dev)):
        with (out / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the terminal_agent example's data")
    parser.add_argument("--write-data", action="store_true", required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    write_data(parser.parse_args().out)
