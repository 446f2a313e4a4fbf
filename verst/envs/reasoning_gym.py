"""reasoning-gym (PyPI `reasoning-gym`, `pip install verst[envs]`): its procedural datasets as a
data source, and their scorers as the reward.

    data: {task: reasoning_gym, task_kwargs: {dataset: leg_counting, size: 1000}}
    rollout: {reward: reasoning_gym}        # or env.name: reasoning_gym, to play it as an episode

Each row's prompt is the entry's question and its label the entry's answer; the entry itself
(question, answer and the generator's metadata) rides in the row as `rg_entry`, with the
dataset's name as `rg_dataset`, so that the dataset's own `score_answer` can judge a response
(partial credit included: scores are in [0, 1]).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from verst.envs.base import Action, Environment, Message, StepResult
from verst.types import Sample


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(
            "reasoning-gym tasks and rewards need reasoning-gym: pip install 'verst[envs]'"
        ) from error
    return reasoning_gym


def reasoning_gym_rows(seed: int, dataset: str, size: int = 1000, **config: Any) -> list[dict]:
    """`size` entries of reasoning-gym dataset `dataset` (its generator's `config` keywords),
    as rows: prompt, label, `rg_dataset`, `rg_entry`."""
    rg = _reasoning_gym()
    try:
        entries = rg.create_dataset(dataset, size=size, seed=seed, **config)
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"reasoning_gym: dataset {dataset!r}: {error}") from error
    rows = []
    for entry in entries:
        plain = json.loads(json.dumps(dict(entry), default=str))  # rows travel as JSON
        rows.append(
            {
                "prompt": plain["question"],
                "label": plain["answer"],
                "rg_dataset": dataset,
                "rg_entry": plain,
            }
        )
    return rows


@functools.lru_cache(maxsize=64)
def _scorer(dataset: str) -> Any:
    return _reasoning_gym().get_score_answer_fn(dataset)


def score_answer(answer: str, metadata: dict[str, Any]) -> float:
    """The dataset's own score of `answer` for the entry in `metadata` (a row's fields)."""
    dataset, entry = metadata.get("rg_dataset"), metadata.get("rg_entry")
    if not isinstance(dataset, str) or not isinstance(entry, dict):
        raise ValueError(
            "reasoning_gym: the sample has no rg_dataset / rg_entry (use data.task: reasoning_gym)"
        )
    return float(_scorer(dataset)(answer, entry))


def reasoning_gym_reward(sample: Sample) -> float:
    """`rollout.reward: reasoning_gym`: the dataset's scorer on the response."""
    return score_answer(str(sample.metadata.get("response_text", "")), sample.metadata)


class ReasoningGymEnv(Environment):
    """`env.name: reasoning_gym`: the question, one answer, the dataset's score."""

    async def reset(self, prompt: str | list[Message], metadata: dict[str, Any]) -> list[Message]:
        score_answer("", metadata)  # a row without its entry fails here, before the model runs
        self.metadata = metadata
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return list(prompt)

    async def step(self, action: Action) -> StepResult:
        score = score_answer(action.content, self.metadata)
        return StepResult(reward=score, done=True, info={"answer": action.content.strip()})
