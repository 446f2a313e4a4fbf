"""`verst dashboard`: what it reads of run directories (records after a cursor, NaN, cut-off
lines, missing runs, late evaluations, the advisor replayed, samples), its HTTP routes, and the
page itself in headless Chromium on a real run and on one still being written."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, Browser
from tests.test_loop import SMALL
from verst.cli import main
from verst.monitor.dashboard.data import RunSource, advice_episodes
from verst.monitor.dashboard.server import build_app, run_labels
from verst.monitor.records import merge_records
from verst.monitor.samples import pick, read_samples
from verst.types import Sample

ROOT = Path(__file__).resolve().parents[1]


def write_lines(path: Path, rows: list[dict], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_poll_sends_what_is_new_and_resets_when_the_file_shrinks(tmp_path: Path) -> None:
    metrics = tmp_path / "run" / "metrics.jsonl"
    write_lines(metrics, [{"step": s, "rollout/reward_mean": s / 10} for s in range(3)])
    run = RunSource(metrics.parent, "run")
    first = run.poll(0)
    assert [r["step"] for r in first["records"]] == [0, 1, 2] and first["cursor"] == 3
    assert run.poll(3)["records"] == []
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 3, "rollout/reward_mean": 0.3}) + "\n")
    assert [r["step"] for r in run.poll(3)["records"]] == [3]
    write_lines(metrics, [{"step": 0}])  # a resume trimmed the file
    again = run.poll(4)
    assert again["reset"] and [r["step"] for r in again["records"]] == [0]


def test_nan_cut_off_lines_and_missing_runs_are_said(tmp_path: Path) -> None:
    rows = [{"step": 1, "train/grad_norm": math.nan, "rollout/reward_mean": 0.5, "note": "x"}]
    write_lines(tmp_path / "a" / "metrics.jsonl", rows, tail='{"step": 2, "rol')
    update = RunSource(tmp_path / "a", "a").poll(0)
    assert update["records"] == [{"step": 1, "train/grad_norm": None, "rollout/reward_mean": 0.5}]
    json.dumps(update, allow_nan=False)  # what the browser parses has no NaN
    skipped = " | ".join(update["skipped"])
    assert "a: 1 NaN or infinite values of train/grad_norm not plotted" in skipped
    assert "the last line is cut off" in skipped and "no samples.jsonl" in skipped
    missing = RunSource(tmp_path / "gone", "gone").poll(0)
    assert missing["records"] == [] and missing["skipped"] == [
        f"{tmp_path / 'gone'}: no such run directory"
    ]
    (tmp_path / "empty").mkdir()
    assert "no metrics.jsonl yet" in RunSource(tmp_path / "empty", "e").poll(0)["skipped"][0]


def test_a_late_evaluation_joins_its_step_and_a_rewritten_step_replaces_it() -> None:
    rows = merge_records(
        [
            {"step": 1, "rollout/reward_mean": 0.1},
            {"step": 2, "rollout/reward_mean": 0.2},
            {"step": 1, "record": "eval", "eval/accuracy": 0.7},
            {"step": 2, "rollout/reward_mean": 0.3},
        ]
    )
    assert rows == [
        {"step": 1, "rollout/reward_mean": 0.1, "eval/accuracy": 0.7},
        {"step": 2, "rollout/reward_mean": 0.3},
    ]


def test_advice_is_replayed_as_episodes_with_the_runs_facts(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("mode: fully_async\nmonitor: {advisor_window_steps: 1}\n")
    rows = [{"step": s, "buffer/rollout_bound": float(s in (2, 3, 5))} for s in range(1, 6)]
    episodes = advice_episodes(rows, tmp_path)
    assert [(e["rule"], e["first_step"], e["last_step"]) for e in episodes] == [
        ("rollout_bound", 5, 5),
        ("rollout_bound", 2, 3),
    ]
    (tmp_path / "config.yaml").write_text("mode: sync\n")
    assert advice_episodes(rows, tmp_path) == []


def test_samples_come_from_different_groups_and_a_rewritten_step_replaces_its_lines(
    tmp_path: Path,
) -> None:
    groups = [[Sample(reward=r, group_index=g, index=i) for i, r in enumerate((0.0, 1.0))]
              for g in range(3)]  # fmt: skip
    picked = pick(groups, 4)
    assert [(s.group_index, s.reward) for s in picked] == [(0, 1.0), (1, 0.0), (2, 1.0), (0, 0.0)]
    assert len(pick(groups, 10)) == 6
    lines = [{"step": 1, "i": 0}, {"step": 2, "i": 0}, {"step": 1, "i": 1}, {"step": 1, "i": 2}]
    write_lines(tmp_path / "samples.jsonl", lines, tail="{cut")
    by_step, skipped = read_samples(tmp_path)
    assert by_step == {1: [{"step": 1, "i": 1}, {"step": 1, "i": 2}], 2: [{"step": 2, "i": 0}]}
    assert skipped == [f"{tmp_path / 'samples.jsonl'}: 1 unreadable lines left out"]


def test_runs_with_one_name_are_labelled_by_path(tmp_path: Path) -> None:
    dirs = [tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c"]
    assert run_labels(dirs) == [str(dirs[0]), str(dirs[1]), "c"]


def test_routes_serve_the_page_the_runs_and_their_samples(tmp_path: Path) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    write_lines(tmp_path / "r" / "metrics.jsonl", [{"step": 1, "rollout/reward_mean": 1.0}])
    sample = {"step": 1, "logprobs": [-0.5, math.nan], "reward": math.inf, "response_tokens": []}
    write_lines(tmp_path / "r" / "samples.jsonl", [sample])

    async def check() -> None:
        async with TestClient(TestServer(build_app([tmp_path / "r"]))) as client:
            page = await client.get("/")
            assert page.status == 200 and "uPlot.iife.min.js" in await page.text()
            script = await client.get("/static/uPlot.iife.min.js")
            assert script.status == 200 and len(await script.read()) > 40_000
            assert (await client.get("/static/..%2Fserver.py")).status == 404
            assert await (await client.get("/api/runs")).json() == [
                {"id": 0, "label": "r", "run_dir": str(tmp_path / "r")}
            ]
            update = await (await client.get("/api/run/0?cursor=0")).json()
            assert update["sample_steps"] == [1] and update["records"][0]["step"] == 1
            answer = await (await client.get("/api/samples/0?step=1")).text()
            assert json.loads(answer)["samples"][0]["logprobs"] == [-0.5, None]
            assert "NaN" not in answer and "Infinity" not in answer
            assert (await client.get("/api/run/3")).status == 404
            assert (await client.get("/api/run/0?cursor=x")).status == 400

    asyncio.run(check())


# -- through `verst train`, `verst dashboard` and a browser -----------------------------------

TINY = [a for a in SMALL if not a.startswith("warm_start")] + ["rollout.max_new_tokens=1"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real 4-step run whose responses are cut at 1 token; (run dir, console)."""
    run_dir = tmp_path_factory.mktemp("dash") / "finished"
    console = io.StringIO()
    with contextlib.redirect_stderr(console):
        assert main(["train", *TINY, "--run-dir", str(run_dir)]) == 0
    return run_dir, console.getvalue()


@pytest.mark.slow
def test_train_flags_truncation_on_the_console_and_in_the_metrics(
    finished_run: tuple[Path, str],
) -> None:
    run_dir, console = finished_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1 and "record" not in r]
    assert steps and all(r["advisor/truncation"] == 1.0 for r in steps)
    assert all(r["advisor/stall"] in (0.0, 1.0) for r in steps)
    step_lines = [line for line in console.splitlines() if line.startswith("step 2 |")]
    assert re.search(r"\| tok/s [\d.]+ \| eta \d+:\d\d:\d\d \| advisor ", step_lines[0])
    assert "truncation" in step_lines[0].split("| advisor ")[1]
    advice = [line for line in console.splitlines() if line.startswith("  advisor: ")]
    assert len(advice) == 1, console  # once in monitor.advisor_interval_steps (10) steps
    assert "rollout.max_new_tokens" in advice[0] or "also: " in advice[0]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2, 3, 4} and len(samples) == 4 * 4
    assert all(len(s["response_tokens"]) == len(s["logprobs"]) == 1 for s in samples)


def start_dashboard(run_dirs: list[Path]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "verst", "dashboard", *map(str, run_dirs), "--port", "0"]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    assert "verst dashboard: 2 run(s) at http://" in line, line
    return server, line.split(" at ")[1].strip()


INKED = """(() => {{
  const c = document.querySelector('#panel-{} canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
  return n;
}})()"""
PANEL_POINTS = "Number(document.querySelector('#panel-{}')?.dataset.points || 0)"


async def check_page(url: str, in_progress: Path, rest: list[str], shot: Path) -> list[str]:
    async with Browser() as page:
        await page.goto(f"{url}?poll_ms=300")
        await page.wait_for(f"{PANEL_POINTS.format('reward')} > 0")
        for panel in ("reward", "eval", "length", "kl", "gnorm", "throughput", "cache"):
            assert await page.evaluate(PANEL_POINTS.format(panel)) > 0, panel
        assert await page.evaluate(PANEL_POINTS.format("phases-0")) > 0
        assert await page.evaluate(INKED.format("reward")) > 500  # the canvas holds a curve
        assert await page.evaluate(PANEL_POINTS.format("phases-1")) > 0
        await page.wait_for("!!document.querySelector('#advice li[data-rule=truncation]')")
        skipped = await page.evaluate("document.getElementById('skipped').textContent")
        assert "the last line is cut off" in skipped
        await page.wait_for("document.querySelectorAll('#sample-list .tok').length > 0")
        shown = await page.evaluate(PANEL_POINTS.format("reward"))
        label = "document.querySelector('.run-step[data-run=\"1\"]').textContent"
        assert (await page.evaluate(label)).endswith("step 2")
        with in_progress.open("a") as f:  # the run writes on: the cut line ends, a step follows
            f.write("".join(rest))
        await page.wait_for(f"{label}.endsWith('step 4')")
        assert await page.evaluate(PANEL_POINTS.format("reward")) > shown
        await page.screenshot(shot)
        return page.errors


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)")
def test_the_page_draws_a_finished_run_and_follows_one_in_progress(
    finished_run: tuple[Path, str], tmp_path: Path
) -> None:
    run_dir, _ = finished_run
    growing = tmp_path / "in_progress"
    growing.mkdir()
    shutil.copy(run_dir / "config.yaml", growing / "config.yaml")
    shutil.copy(run_dir / "samples.jsonl", growing / "samples.jsonl")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    steps = [line for line in lines if '"record"' not in line]  # steps 0-4
    cut = len(steps[3]) // 2
    (growing / "metrics.jsonl").write_text("".join(steps[:3]) + steps[3][:cut])
    server, url = start_dashboard([run_dir, growing])
    try:
        shot = tmp_path / "dashboard.png"
        rest = [steps[3][cut:], steps[4]]
        errors = asyncio.run(check_page(url, growing / "metrics.jsonl", rest, shot))
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert errors == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
