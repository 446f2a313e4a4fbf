"""`verst plot`: a PNG of one or several runs, and a line for everything it could not draw."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from verst.cli import main
from verst.monitor.plot import loop_phases
from verst.monitor.records import read_run


def write_run(run_dir: Path, rows: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps(row) + "\n" for row in rows) + tail
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def rl_row(step: int, **extra: float) -> dict:
    return {
        "step": step,
        "rollout/reward_mean": step / 10,
        "rollout/response_len_mean": 4.0 + step,
        "train/train_rollout_logprob_abs_diff": 1e-7 * (step + 1),
        "train/grad_norm": 1.0 / (step + 1),
        "perf/rollout_time_s": 0.2,
        "perf/train_time_s": 0.5,
        "perf/train_forward_time_s": 0.1,
        "perf/step_time_s": 0.7,
        **extra,
    }


def assert_png_with_content(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 800
    assert pixels[..., :3].std() > 0.05  # curves and text, not a blank page


def test_runs_are_overlaid_and_what_is_missing_is_said(tmp_path: Path, capsys) -> None:
    a = write_run(
        tmp_path / "a",
        [rl_row(s, **{"eval/accuracy": s / 20, "perf/eval_time_s": 1.0}) for s in range(1, 6)]
        + [rl_row(6, **{"train/grad_norm": math.nan})],
    )
    # b lacks eval/accuracy and its last line was cut off mid-write
    b = write_run(tmp_path / "b", [rl_row(s) for s in range(1, 4)], tail='{"step": 4, "rol')
    out = tmp_path / "plots" / "out.png"
    assert main(["plot", str(a), str(b), str(tmp_path / "missing"), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out} (2 runs)" in captured.out
    skipped = captured.err
    assert f"skipped {tmp_path / 'missing'}: no such run directory" in skipped
    assert "b/metrics.jsonl: the last line is cut off" in skipped
    assert "skipped held-out accuracy (eval/accuracy): b has no eval/accuracy" in skipped
    assert "skipped a: 1 NaN or infinite values of train/grad_norm not plotted" in skipped
    assert_png_with_content(out)


def test_a_panel_no_run_has_is_named_and_the_rest_drawn(tmp_path: Path, capsys) -> None:
    sft = write_run(
        tmp_path / "sft",
        [
            {"step": s, "sft/loss": 1 / s, "train/grad_norm": 2.0, "eval/accuracy": 0.1 * s}
            for s in range(1, 4)
        ],
    )
    out = tmp_path / "sft.png"
    assert main(["plot", str(sft), "-o", str(out)]) == 0
    skipped = capsys.readouterr().err
    assert "skipped reward (rollout/reward_mean): no run has data for it" in skipped
    assert "skipped phase breakdown: no run has perf/*_time_s" in skipped
    assert "held-out accuracy" not in skipped
    assert_png_with_content(out)


def test_nothing_readable_is_an_error_naming_why(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    garbled = write_run(tmp_path / "garbled", [], tail="not json\n")
    code = main(["plot", str(empty), str(garbled), "-o", str(tmp_path / "x.png")])
    assert code == 2
    err = capsys.readouterr().err
    assert "verst: error: no run to plot: " in err
    assert f"{empty}: no metrics.jsonl" in err and "garbled/metrics.jsonl:1: not a JSON" in err
    assert not (tmp_path / "x.png").exists()


def test_records_keep_the_last_of_a_repeated_step_and_phases_average_over_steps(
    tmp_path: Path,
) -> None:
    run = read_run(
        write_run(
            tmp_path / "r",
            [
                rl_row(1),
                rl_row(2, **{"perf/eval_time_s": 2.0}),
                rl_row(2, **{"rollout/reward_mean": 0.9}),
            ],
        )
    )
    assert [row["step"] for row in run.rows] == [1, 2]
    assert run.series("rollout/reward_mean")[1] == [0.1, 0.9]
    # sub-phases (train_forward) are not loop phases; a phase skipped on a step counts 0 there
    assert loop_phases(run) == pytest.approx({"rollout": 0.2, "train": 0.5})
    run = read_run(write_run(tmp_path / "e", [rl_row(1), rl_row(2, **{"perf/eval_time_s": 2.0})]))
    assert loop_phases(run) == pytest.approx({"rollout": 0.2, "train": 0.5, "eval": 1.0})
