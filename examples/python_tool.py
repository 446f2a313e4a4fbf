"""Data and the warm start's check for `examples/python_tool.yaml`: the built-in `python_tool`
environment (`env.name: python_tool`), where the model computes a product by running Python in
a bubblewrap sandbox.

A trajectory is two model calls: the model writes a tool call in the chat template's format,

    <tool_call>{"name":"python","arguments":{"code":"print(37*48)"}}</tool_call>

the session server parses it, the environment runs the code in the episode's sandbox and sends
its output back as a `tool` message (`1776`), and the model's next answer is scored against the
label. The SFT warm start teaches both moves on other problems.

    python examples/python_tool.py --write-data    # regenerate examples/data/python_tool_*
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from verst.types import Sample

END = "<|im_end|>"


def tool_call(a: int, b: int) -> str:
    arguments = {"code": f"print({a}*{b})"}
    call = {"name": "python", "arguments": arguments}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def sft_match(sample: Sample) -> float:
    """The warm start's single-turn dev check: the response text is the label without `END`."""
    want = str(sample.label).removesuffix(END).strip()
    return float(str(sample.metadata.get("response_text", "")).strip() == want)


def _rows(pairs: list[tuple[int, int]]) -> tuple[list[dict], list[dict]]:
    rl, sft = [], []
    for a, b in pairs:
        question, product = f"{a}*{b}", str(a * b)
        rl.append({"prompt": question, "label": product})
        sft.append({"prompt": question, "label": tool_call(a, b) + END})
        conversation = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": tool_call(a, b)},
            {"role": "tool", "content": product},
        ]
        sft.append({"prompt": conversation, "label": product + END})
    return rl, sft


def write_data(out: Path, *, seed: int = 0) -> None:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    rl, _ = _rows(pairs[:1000])
    _, sft = _rows(pairs[1000:1600])
    _, dev = _rows(pairs[1600:1700])
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("python_tool", rl), ("python_tool_sft", sft), ("python_tool_dev", dev)):
        with (out / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the python_tool example's data")
    parser.add_argument("--write-data", action="store_true", required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    write_data(parser.parse_args().out)
