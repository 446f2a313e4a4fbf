"""Procedural tasks: prompt sets generated in-process, with fixed, disjoint train/dev/test splits.

A task is a function `(split, seed, **kwargs) -> list[{"prompt": str, "label": str}]` in
`TASKS`. The same seed always gives the same splits, and the splits never share a prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

SPLITS = ("train", "dev", "test")


def _split_rows(rows: list[dict], split: str, *, test: int = 200, dev: int = 200) -> list[dict]:
    if split == "test":
        return rows[:test]
    if split == "dev":
        return rows[test : test + dev]
    return rows[test + dev :]


def addition(split: str, seed: int, digits: int = 2) -> list[dict]:
    """All sums a+b with a, b < 10**digits, zero-padded ("07+58=" → "65"), shuffled by `seed`.

    test is the first 200 shuffled pairs, dev the next 200, train the rest.
    """
    if digits < 1:
        raise ValueError(f"addition: digits must be >= 1, got {digits}")
    n = 10**digits
    pairs = [(a, b) for a in range(n) for b in range(n)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "label": str(a + b)} for a, b in pairs]
    return _split_rows(rows, split)


def subtraction(split: str, seed: int, digits: int = 2) -> list[dict]:
    """All differences a-b >= 0 with a, b < 10**digits, zero-padded ("58-07=" → "51"), shuffled
    by `seed`; test is the first 200 shuffled pairs, dev the next 200, train the rest (4,650
    with two digits)."""
    if digits < 1:
        raise ValueError(f"subtraction: digits must be >= 1, got {digits}")
    n = 10**digits
    pairs = [(a, b) for a in range(n) for b in range(a + 1)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{a:0{digits}d}-{b:0{digits}d}=", "label": str(a - b)} for a, b in pairs]
    return _split_rows(rows, split)


def arithmetic(split: str, seed: int, digits: int = 2) -> list[dict]:
    """`addition` and `subtraction` together, split by split (so the splits stay disjoint),
    shuffled by `seed`: a base that knows a little of both (the multi-LoRA recipe's)."""
    rows = addition(split, seed, digits) + subtraction(split, seed, digits)
    random.Random(seed).shuffle(rows)
    return rows


def terminal(split: str, seed: int, **kwargs: Any) -> list[dict]:
    """Toy terminal tasks for `env.name: terminal` (`verst.envs.terminal.terminal_tasks`:
    description, files, checker); test is the first 200, dev the next 200, train the rest."""
    from verst.envs.terminal import terminal_tasks

    return _split_rows(terminal_tasks(seed, **kwargs), split)


def reasoning_gym(split: str, seed: int, **kwargs: Any) -> list[dict]:
    """A reasoning-gym dataset (`task_kwargs`: `dataset`, `size`, the generator's config); the
    splits are made from different seeds of the generator (`verst.envs.reasoning_gym`), so
    they are the generator's, disjoint as far as its space of tasks is large."""
    from verst.envs.reasoning_gym import reasoning_gym_rows

    if "dataset" not in kwargs:
        raise ValueError("reasoning_gym: task_kwargs needs 'dataset' (a reasoning-gym name)")
    return reasoning_gym_rows(seed * len(SPLITS) + SPLITS.index(split), **kwargs)


def verifiers(split: str, seed: int, **kwargs: Any) -> list[dict]:
    """A verifiers taskset's tasks as rows (`task_kwargs`: `taskset`, `args`, `size`,
    `test_size`, `dev_size`; `verst.envs.verifiers_connector`), for `env.name: verifiers`: test
    is the first `test_size` tasks, dev the next `dev_size`, train the rest (`seed` unused:
    the order is the taskset's)."""
    from verst.envs.verifiers_connector import verifiers_rows

    if "taskset" not in kwargs:
        raise ValueError("verifiers: task_kwargs needs 'taskset' (an import path or an id)")
    return verifiers_rows(split, **kwargs)


TASKS: dict[str, Callable[..., list[dict]]] = {
    "addition": addition,
    "subtraction": subtraction,
    "arithmetic": arithmetic,
    "terminal": terminal,
    "reasoning_gym": reasoning_gym,
    "verifiers": verifiers,
}


def make_task(name: str, split: str, seed: int, **kwargs) -> list[dict]:
    """The rows of procedural task `name` for `split` ("train", "dev" or "test")."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for task {name!r}; use one of {SPLITS}")
    return TASKS[name](split, seed, **kwargs)
