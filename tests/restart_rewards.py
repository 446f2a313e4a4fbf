"""Reward functions for `tests/test_restarts.py`, named by import path in the child trainers'
configs: one with a real GRPO signal, a slow one (so a test can act mid-run), and one that
kills its own process the way the OOM killer would."""

from __future__ import annotations

import os
import signal
import time

from verst.types import Sample


def response_chars(sample: Sample) -> float:
    """Longer responses score higher: rewards differ within a group, so every step updates."""
    return float(len(sample.metadata["response_text"]))


def slow_response_chars(sample: Sample) -> float:
    time.sleep(0.02)
    return response_chars(sample)


def sigkill(sample: Sample) -> float:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")
