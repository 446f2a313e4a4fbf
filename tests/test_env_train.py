"""An environment in `verst train`: the python_tool example end to end through the CLI (a few
steps of a smaller model), each episode in a bubblewrap sandbox of its own."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from tests.test_loop import records  # noqa: E402
from verst.cli import main  # noqa: E402
from verst.envs.sandbox import bubblewrap_problem  # noqa: E402

EXAMPLE = "examples/python_tool.yaml"
TINY_RUN = [  # two steps of a tiny model on the CPU, for any recipe
    "num_steps=2",
    "num_threads=1",
    "trainer.device=cpu",
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 256}",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
]
QUICK = [
    *TINY_RUN,
    "warm_start.max_steps=2",
    "warm_start.batch_size=8",
    "warm_start.check_interval_steps=1",
    "warm_start.dev_data.max_prompts=4",
    "env.sandbox.pool_size=2",
]


def assert_no_tito_bug(row: dict) -> None:
    """Every trajectory was measured against a re-render, and none differs but in assistant
    text (the char tokenizer's template prints no tool calls, so those turns do)."""
    assert row["tito/mismatch_measured"] == row["rollout/num_samples"]
    for kind in ("special_token_count", "special_token_type", "non_assistant_text"):
        assert row[f"tito/mismatch_{kind}"] == 0.0, kind


def test_python_tool_example_trains_through_the_cli(tmp_path: Path) -> None:
    if (problem := bubblewrap_problem()) is not None:
        pytest.skip(f"bwrap fails its probe here: {problem}")
    # this run's own (other tests' sandboxes may be open beside it), in the system temp: the
    # uid commands run as under root must pass through it, which pytest's tmp_path forbids
    work_root = Path(tempfile.mkdtemp(prefix="verst-test-sandboxes-"))
    work_root.chmod(0o711)
    run_dir = tmp_path / "run"
    overrides = [*QUICK, f"env.sandbox.work_root={work_root}"]
    try:
        assert main(["train", EXAMPLE, *overrides, "--run-dir", str(run_dir)]) == 0
        left = list(work_root.iterdir())
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["rollout/agent_aborted_ratio"] == 0.0
        assert row["rollout/num_samples"] == 8 and row["rollout/response_len_mean"] > 0
        assert row["rollout/env_steps_mean"] >= 1.0 and 0.0 <= row["rollout/env_done_ratio"]
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-4
        assert_no_tito_bug(row)
    # the sandboxes the pool still held were closed at the end of the run
    assert left == []


TERMINAL_QUICK = [
    "num_steps=2",
    "num_threads=1",
    "trainer.device=cpu",
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 192}",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "warm_start.max_steps=2",
    "warm_start.batch_size=8",
    "warm_start.check_interval_steps=1",
    "warm_start.dev_data.max_prompts=4",
    "env.sandbox.pool_size=2",
]


@pytest.mark.slow
def test_terminal_agent_example_trains_through_the_cli(tmp_path: Path) -> None:
    if (problem := bubblewrap_problem()) is not None:
        pytest.skip(f"bwrap fails its probe here: {problem}")
    run_dir = tmp_path / "run"
    args = ["train", "examples/terminal_agent.yaml", *TERMINAL_QUICK, "--run-dir", str(run_dir)]
    assert main(args) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["rollout/agent_aborted_ratio"] == 0.0
        assert row["rollout/env_steps_mean"] == 1.0  # one command, then the checker
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0
        assert_no_tito_bug(row)


@pytest.mark.slow
def test_math_env_example_trains_through_the_cli(tmp_path: Path) -> None:
    pytest.importorskip("math_verify")
    run_dir = tmp_path / "run"
    quick = [
        "num_steps=3",
        "num_threads=1",
        "warm_start.max_steps=3",
        "eval.interval_steps=3",
        "eval.data.max_prompts=8",
        "rollout.prompts_per_step=4",
    ]
    assert main(["train", "examples/math_env.yaml", *quick, "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows][-1] == 3
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows[1:])
    assert any("eval/" in key for r in rows for key in r)
