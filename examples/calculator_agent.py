"""A multi-turn tool-use agent for `rollout.agent_function: examples.calculator_agent:run_agent`.

The task is two-digit multiplication ("37*48"), which a tiny model cannot do in its head but can
do with a calculator: it answers `calc 37*48`, the agent runs the calculator and sends the
result back as a `tool` message ("1776"), and the model's next answer is its final answer. A
trajectory is at most `MAX_TURNS` model calls; an answer that is not a `calc` call ends it.

The agent talks to the model only through the OpenAI chat API of its session (`base_url`), so
the same code would drive any OpenAI-compatible server; verst records every token the model saw
and sampled, and trains on the model's own tokens only (the tool results are masked out).

    verst train examples/calculator_agent.yaml
    python examples/calculator_agent.py --write-data    # regenerate examples/data/calculator_*

Rewards: `reward` gives 1.0 for the right final answer (read from what the agent returned in
metadata); `sft_match` scores the warm start's single-turn dev prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import weakref
from pathlib import Path
from typing import Any

from verst.types import Sample, Status

MAX_TURNS = 3
END = "<|im_end|>"  # the chat template's end of an assistant turn: SFT labels end with it
_CALL = re.compile(r"^\s*calc\s+(\d{1,3})\s*\*\s*(\d{1,3})\s*$")


def calculator(text: str) -> str | None:
    """The tool: `calc A*B` → the product as text; None when `text` is not a call."""
    match = _CALL.match(text)
    if match is None:
        return None
    return str(int(match[1]) * int(match[2]))


# One HTTP connection pool per event loop, shared by every agent on it: building an OpenAI
# client with a pool of its own costs ~30 ms of CPU (mostly an SSL context), more than a turn.
_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


def _client(base_url: str) -> Any:
    import openai  # imported here so that loading the config does not need it

    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = openai.DefaultAsyncHttpxClient()
    return openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, http_client=_POOLS[loop]
    )


async def run_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    messages: list[dict[str, Any]] = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    )
    answer, calls = "", 0
    client = _client(base_url)
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(messages=messages, **request_kwargs)
        answer = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        result = calculator(answer)
        if result is None:
            break  # a final answer
        calls += 1
        messages.append({"role": "tool", "content": result})
    return {
        "answer": answer.strip(),
        "tool_calls": calls,
        "correct": answer.strip() == str(metadata["label"]),
    }


def reward(sample: Sample) -> float:
    """1.0 when the agent's final answer is the product and the model ended its turn itself."""
    if sample.status != Status.COMPLETED:
        return 0.0
    return 1.0 if sample.metadata.get("correct") else 0.0


def sft_match(sample: Sample) -> float:
    """Single-turn check for the warm start's dev prompts: the answer text, without `END`."""
    want = str(sample.label).removesuffix(END).strip()
    return float(str(sample.metadata.get("response_text", "")).strip() == want)


# ---- data --------------------------------------------------------------------------------


def _rows(pairs: list[tuple[int, int]]) -> tuple[list[dict], list[dict]]:
    """RL prompts, and SFT rows of both turns: the call, then the answer after the result."""
    rl, sft = [], []
    for a, b in pairs:
        question, product = f"{a}*{b}", str(a * b)
        call = f"calc {a}*{b}"
        rl.append({"prompt": question, "label": product})
        sft.append({"prompt": question, "label": call + END})
        conversation = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": call},
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
    for name, rows in (("calculator", rl), ("calculator_sft", sft), ("calculator_dev", dev)):
        with (out / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the calculator example's data")
    parser.add_argument("--write-data", action="store_true", required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    write_data(parser.parse_args().out)
