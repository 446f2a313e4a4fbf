"""`eval.mode: fleet`: engine processes of the evaluation's own, behind a router of their own.

Before each point the fleet is pinned to the snapshot: every engine must answer its health
check (else the point is skipped as `unhealthy`), load the snapshot from disk under the step's
weight version and then report exactly that version (else `pin_violation`: a score from any
other weights would be attributed to the wrong step), and one token must come back through the
router (else `unhealthy`). Then the evaluation sets are scored through the router.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from verst.engine import GenerateRequest, SamplingParams
from verst.eval.evaluate import Evaluator, SetEvaluators
from verst.fleet.fleet import Fleet
from verst.fleet.health import FaultToleranceConfig
from verst.fleet.placement import PlacementConfig
from verst.plugins import EvalSkip

PROBE_TIMEOUT_S = 180.0
EVAL_INIT_DIR = "eval_init"


class FleetScorer:
    def __init__(
        self,
        fleet: Fleet,
        evaluator: Evaluator | SetEvaluators,
        probe_ids: list[int],
        *,
        pin_timeout_s: float,
    ) -> None:
        self.fleet = fleet
        self.evaluator = evaluator
        self.probe_ids = probe_ids
        self.pin_timeout_s = pin_timeout_s

    def __call__(self, snapshot: Path, step: int, version: int) -> dict[str, float]:
        self.fleet.wait(self._pin(snapshot, version))
        return self.evaluator.run(self.fleet, step=step)

    async def _pin(self, snapshot: Path, version: int) -> None:
        clients = self.fleet.clients
        health = await asyncio.gather(*(c.health() for c in clients), return_exceptions=True)
        if not clients or any(ok is not True for ok in health):
            raise EvalSkip("unhealthy", f"eval engines' health: {health}")
        loads = [
            c.update_weights_from_disk(str(snapshot), weight_version=str(version)) for c in clients
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*loads), self.pin_timeout_s)
        except Exception as error:
            raise EvalSkip("pin_violation", f"loading {snapshot}: {error!r}") from error
        reported = await asyncio.gather(*(c.get_weight_version() for c in clients))
        if any(str(v) != str(version) for v in reported):
            raise EvalSkip(
                "pin_violation", f"eval engines report versions {reported}, expected {version}"
            )
        probe = GenerateRequest(
            input_ids=self.probe_ids, sampling_params=SamplingParams(max_new_tokens=1)
        )
        try:
            await asyncio.wait_for(self.fleet.agenerate(probe, key=None), PROBE_TIMEOUT_S)
        except Exception as error:
            raise EvalSkip("unhealthy", f"one-token probe through the router: {error!r}") from error

    def close(self) -> None:
        self.fleet.close()


def start_eval_fleet(
    cfg: Any,
    run_dir: Path,
    shell: torch.nn.Module,
    tokenizer: Any,
    device: torch.device,
    dtype: torch.dtype,
) -> Fleet:
    """`eval.num_engines` `verst serve` processes on `eval.engine_devices`, with the rollout
    engines' options (`placement.*`) unless `eval.*` overrides them. They start from the
    initial policy; every point loads its snapshot."""
    ev = cfg.eval
    placement: PlacementConfig = cfg.placement.model_copy(
        update={
            "engines": "processes",
            "mode": "disaggregated",
            "num_engines": ev.num_engines,
            "engine_devices": list(ev.engine_devices),
            "engine_threads": ev.engine_threads or cfg.placement.engine_threads,
            "engine_nice": ev.nice,
        }
    )
    model_dir = run_dir / EVAL_INIT_DIR
    shell.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return Fleet.start(
        placement,
        model=shell,
        tokenizer=tokenizer,
        model_dir=model_dir,
        trainer_device=device,
        dtype=dtype,
        seed=cfg.seed + 7919,  # apart from the rollout engines' seeds
        fault_tolerance=FaultToleranceConfig(enabled=False),
    )
