"""A multi-turn verifiers environment for `examples/verifiers_guess.yaml`, written on verifiers'
own classes (`verifiers.v1`): guess the number. The task asks for a number from 1 to `high`;
the env (`GuessEnv.run`, a `vf.Env`) answers each guess with "higher" or "lower" as the next
user turn and ends the game at the right guess; the task's `@vf.reward` scores the whole
conversation. Built from local data, so it runs offline. verst names the taskset by the
function that returns it and the env by its class:

    env: {name: verifiers, options: {taskset: "examples.verifiers_guess:load_taskset",
                                      env: "examples.verifiers_guess:GuessEnv"}}
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int
    """The number to guess."""


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def found(self, task: GuessData, trace: vf.Trace) -> float:
        """1.0 when the last guess is the number."""
        return float(trace.last_reply == str(task.secret))

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessConfig(vf.TasksetConfig):
    high: int = 8
    num_tasks: int = 400
    seed: int = 0


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> Iterator[GuessTask]:
        rng = random.Random(self.config.seed)
        high = self.config.high
        for i in range(self.config.num_tasks):
            data = GuessData(name=f"guess#{i}", prompt=f"1-{high}?", secret=rng.randint(1, high))
            yield GuessTask(data, self.config.task)


def hint(guess: str, secret: int) -> str | None:
    """The env's answer to a guess: "higher", "lower", a request for a number, or None (right)."""
    if not guess.isdigit():
        return "a number"
    if int(guess) == secret:
        return None
    return "higher" if int(guess) < secret else "lower"


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task: GuessTask, agents: vf.Agents) -> None:
        # the task's prompt opens the game, so the model guesses first (a bare turn())
        async with agents.player.interaction(task) as game:
            segment = await game.turn()
            while not segment.terminated:
                answer = hint(segment.last_reply, task.data.secret)
                if answer is None:
                    break
                segment = await game.turn(answer)


def load_taskset(high: int = 8, num_tasks: int = 400, seed: int = 0) -> GuessTaskset:
    """`num_tasks` games, each a number from 1 to `high` drawn with `seed`."""
    return GuessTaskset(GuessConfig(high=high, num_tasks=num_tasks, seed=seed))
