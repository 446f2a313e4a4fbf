"""A verifiers taskset for `examples/verifiers_env.yaml`, written on verifiers' own classes
(`verifiers.v1`): two-digit additions ("07+58=" → "65"), each task scored by an exact-match
`@vf.reward`. Built from local data, so it runs offline. verst names the taskset by the
function that returns it: `taskset: "examples.verifiers_addition:load_taskset"`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: str
    """The sum, as the model should write it."""


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task: AdditionData, trace: vf.Trace) -> float:
        """1.0 when the answer is the sum, exactly."""
        return float(trace.last_reply == task.answer)


class AdditionConfig(vf.TasksetConfig):
    digits: int = 2
    seed: int = 0


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> Iterator[AdditionTask]:
        n = 10**self.config.digits
        pairs = [(a, b) for a in range(n) for b in range(n)]
        random.Random(self.config.seed).shuffle(pairs)
        width = self.config.digits
        for a, b in pairs:
            data = AdditionData(prompt=f"{a:0{width}d}+{b:0{width}d}=", answer=str(a + b))
            yield AdditionTask(data, self.config.task)


def load_taskset(digits: int = 2, seed: int = 0) -> AdditionTaskset:
    """The additions of `digits`-digit numbers, shuffled by `seed`."""
    return AdditionTaskset(AdditionConfig(digits=digits, seed=seed))
