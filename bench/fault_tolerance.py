"""What an engine failure costs a run: time to return to service, throughput lost during the
outage, and groups retried, lost or trained twice, in sync and fully async modes.

For each mode, two runs of the same config and seed on engine processes: one uninterrupted (the
baseline), and one whose engine processes are SIGKILLed `--kills` times, each at a random moment
of a step once the previous outage is over. The bench watches `metrics.jsonl` as the run writes
it and stamps each step's record with the time it appeared.

- outage: from the kill to the first record showing every engine serving again
  (`fault/engines_down` = 0), as the bench sees it; `fault/engine_down_s` is the fleet's own
  count (from finding the failure to the restarted engine's first push);
- throughput: trajectories a second during the outages, against the baseline run's over its
  whole length (both after `--skip` warm-up steps); the ratio is what an outage keeps;
- groups: `fault/retried_groups` (requests sent again to another engine), and from the prompt
  ledger, groups retried, lost and trained twice (lost and twice must be 0).

    python bench/fault_tolerance.py                      # CPU: 2 engine processes + trainer
    python bench/fault_tolerance.py --device cuda --engine-devices cuda:0 --transport colocated

Writes bench/results/fault_tolerance_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults import engine_pids  # noqa: E402
from verst.config import load_config  # noqa: E402
from verst.data.source import load_rows  # noqa: E402
from verst.rollout.ledger import LEDGER_FILE, check_exactly_once, read_ledger  # noqa: E402


def overrides_for(mode: str, args: argparse.Namespace) -> list[str]:
    tiny = (
        f"{{hidden_size: {args.hidden}, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
        f"intermediate_size: {4 * args.hidden}, max_position_embeddings: 64}}"
    )
    overrides = [
        f"mode={mode}",
        f"num_steps={args.steps if mode == 'sync' else args.async_steps}",
        f"seed={args.seed}",
        f"trainer.device={args.device}",
        f"model.tiny={tiny}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "placement.engines=processes",
        f"placement.num_engines={args.engines}",
        f"placement.engine_threads={args.engine_threads}",
        f"sync.transport={args.transport}",
        f"fault_tolerance.interval_s={args.interval_s}",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=0",
        "warm_start.enabled=false",
        f"num_threads={args.trainer_threads}",
    ]
    if args.engine_devices:
        overrides.append(f"placement.engine_devices={json.dumps(args.engine_devices)}")
    if mode == "fully_async":
        overrides.append("placement.mode=disaggregated")
    return overrides


class Watched:
    """A `verst train` subprocess whose metrics records are stamped as they appear."""

    def __init__(self, overrides: list[str], run_dir: Path) -> None:
        cmd = [sys.executable, "-m", "verst", "train", *overrides, "--run-dir", str(run_dir)]
        self.run_dir = run_dir
        self.log = run_dir.with_suffix(".log")
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.rows: list[dict] = []
        self.seen: list[float] = []  # time.monotonic() when each row appeared
        self._offset = 0

    def poll(self) -> bool:
        """Read new records; False once the process has exited and everything is read."""
        running = self.process.poll() is None
        path = self.run_dir / "metrics.jsonl"
        if path.is_file():
            with path.open() as f:
                f.seek(self._offset)
                text = f.read()
            complete = text[: text.rfind("\n") + 1]
            self._offset += len(complete)
            now = time.monotonic()
            for line in complete.splitlines():
                if line.strip():
                    self.rows.append(json.loads(line))
                    self.seen.append(now)
        return running

    def wait_for(self, ready, what: str) -> None:  # noqa: ANN001
        while not (self.rows and ready(self.rows[-1])):
            if not self.poll():
                raise RuntimeError(f"the run ended before {what}: see {self.log}")
            time.sleep(0.01)


def run_once(
    overrides: list[str], run_dir: Path, kills: int, rng: random.Random, within_s: float
) -> dict:
    run = Watched(overrides, run_dir)
    outages = []
    for k in range(1, kills + 1):
        run.wait_for(lambda r: r["step"] >= 3 and r.get("fault/engines_down", 0) == 0, "a kill")
        time.sleep(rng.uniform(0.0, within_s))
        os.kill(rng.choice(sorted(engine_pids(run.process.pid))), signal.SIGKILL)
        killed_at, killed_index = time.monotonic(), len(run.rows)

        def back(row: dict, k: int = k) -> bool:  # the k-th restart done and rejoined
            return row["fault/engine_restarts"] >= k and row["fault/engines_down"] == 0

        run.wait_for(back, "the engine's return")
        outages.append((killed_at, run.seen[-1], killed_index, len(run.rows) - 1))
    while run.poll():
        time.sleep(0.01)
    if run.process.returncode != 0:
        raise RuntimeError(f"the run failed with {run.process.returncode}: see {run.log}")
    return {"rows": run.rows, "seen": run.seen, "outages": outages}


def trajectories_per_s(result: dict, first: int, last: int, per_step: int) -> float:
    seen = result["seen"]
    steps = last - first
    return steps * per_step / (seen[last] - seen[first]) if steps > 0 else float("nan")


def measure(mode: str, args: argparse.Namespace, root: Path) -> dict:
    overrides = overrides_for(mode, args)
    per_step = args.prompts * args.n
    base = run_once(overrides, root / f"{mode}_base", 0, random.Random(args.seed), 0.0)
    base_rate = trajectories_per_s(base, args.skip, len(base["rows"]) - 1, per_step)
    rng = random.Random(args.seed + 1)
    faulty = run_once(overrides, root / f"{mode}_faults", args.kills, rng, args.within_s)
    rows = faulty["rows"]
    outage_s = [back_t - kill_t for kill_t, back_t, _, _ in faulty["outages"]]
    during = [
        trajectories_per_s(faulty, max(i - 1, 0), j, per_step) for _, _, i, j in faulty["outages"]
    ]
    cfg = load_config(None, overrides)
    report = check_exactly_once(faulty_dir(root, mode) / LEDGER_FILE, len(load_rows(cfg.data)))
    retried = retried_by_reason(faulty_dir(root, mode))
    baseline_retried = retried_by_reason(root / f"{mode}_base")
    last = rows[-1]
    lengths = [r["rollout/response_len_mean"] for r in rows[1:]]
    return {
        "mode": mode,
        "overrides": overrides,
        "baseline_trajectories_per_s": base_rate,
        "outage_s": outage_s,
        "outage_s_median": statistics.median(outage_s),
        "fleet_engine_down_s_total": last["fault/engine_down_s"],
        "engine_restarts": last["fault/engine_restarts"],
        "trajectories_per_s_during_outages": during,
        "throughput_kept_during_outage": statistics.median(during) / base_rate,
        "retried_requests_groups": last["fault/retried_groups"],
        "ledger_retried_groups": sum(retried.values()),
        "ledger_retried_by_reason": retried,
        "baseline_ledger_retried_by_reason": baseline_retried,
        "lost_groups": sum(map(len, report.lost.values())),
        "trained_twice_groups": sum(map(len, report.trained_twice.values())),
        "response_len_mean": statistics.mean(lengths),
        "response_len_min_max": [min(lengths), max(lengths)],
    }


def retried_by_reason(run_dir: Path) -> dict[str, int]:
    """Groups the ledger says were served again, by reason (stale groups are retried in fully
    async mode with or without failures: compare with the baseline's)."""
    counts = Counter(
        line["reason"]
        for line in read_ledger(run_dir / LEDGER_FILE)
        if line["outcome"] == "retried"
    )
    return dict(sorted(counts.items()))


def faulty_dir(root: Path, mode: str) -> Path:
    return root / f"{mode}_faults"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["sync", "fully_async"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine-devices", nargs="*", default=[])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--transport", default="broadcast")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--async-steps", type=int, default=3000)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--within-s", type=float, default=0.3, help="random moment of a step")
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            result = measure(mode, args, Path(tmp))
            results.append(result)
            print(
                f"{mode}: outage median {result['outage_s_median']:.2f} s "
                f"(all {', '.join(f'{s:.2f}' for s in result['outage_s'])}); throughput during "
                f"an outage {result['throughput_kept_during_outage']:.2f}x the baseline "
                f"({result['baseline_trajectories_per_s']:.0f} trajectories/s); groups: "
                f"retried {result['ledger_retried_by_reason']} (baseline "
                f"{result['baseline_ledger_retried_by_reason']}; requests rerouted for "
                f"{result['retried_requests_groups']:.0f}), lost {result['lost_groups']}, "
                f"trained twice {result['trained_twice_groups']}",
                flush=True,
            )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    out = args.out or Path(__file__).parent / "results" / f"fault_tolerance_{args.device}.json"
    out.write_text(
        json.dumps(
            {
                "bench": "fault_tolerance",
                "commit": commit,
                "machine": platform.platform(),
                "cpu_count": os.cpu_count(),
                "args": {
                    k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()
                },
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
