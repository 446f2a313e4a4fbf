"""A built-in math environment (`env.name: math`): one answer per episode, checked against the
sample's label by `math-verify` (PyPI `math-verify`, `pip install verst[envs]`).

math-verify parses both sides (LaTeX, `\\boxed{...}`, plain expressions and numbers) into sympy
and compares them symbolically, so `\\frac{1}{2}`, `0.5` and `1/2` all match a label of `1/2`.
The same check is the reward function `math_verify` (`rollout.reward: math_verify`) for
single-turn runs without an environment.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from verst.envs.base import Action, Environment, Message, StepResult
from verst.types import Sample

_TIMEOUT_S = 5


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(
            "the math environment and reward need math-verify: pip install 'verst[envs]'"
        ) from error
    return math_verify


def math_equal(answer: str, label: Any) -> bool:
    """Whether the answer's final expression equals the label, as math-verify judges it.

    The label is read as LaTeX or a plain expression (a `$` pair is added when it has none, so
    `\\frac{1}{2}` parses); an answer or label it cannot parse is not a match. Verdicts are
    cached: a rollout repeats answers often, and a check costs milliseconds of sympy."""
    return _equal(answer, str(label).strip())


@functools.lru_cache(maxsize=1 << 16)
def _equal(answer: str, gold_text: str) -> bool:
    mv = _math_verify()
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(gold_text, parsing_timeout=timeout)
    target = mv.parse(answer, parsing_timeout=timeout)
    if not gold or not target:
        return False
    return bool(mv.verify(gold, target, timeout_seconds=timeout))


def math_verify_reward(sample: Sample) -> float:
    """1.0 when math-verify finds the response equal to the label; else 0.0."""
    return float(math_equal(str(sample.metadata.get("response_text", "")), sample.label))


class MathEnv(Environment):
    """The prompt, one answer, the verdict: reward 1.0 when it equals the label."""

    async def reset(self, prompt: str | list[Message], metadata: dict[str, Any]) -> list[Message]:
        if metadata.get("label") is None:
            raise ValueError("math: the sample has no label to check the answer against")
        self.label = metadata["label"]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return list(prompt)

    async def step(self, action: Action) -> StepResult:
        correct = math_equal(action.content, self.label)
        info = {"answer": action.content.strip(), "correct": correct}
        return StepResult(reward=float(correct), done=True, info=info)
