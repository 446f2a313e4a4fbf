"""A `verst serve-diffusion` subprocess for `diffusion.engine: http`, and the disk weight push.

The trainer writes its weights with `save_pretrained` into `RUN_DIR/sync/transformer`, then the
engine loads them through `/update_weights_from_disk` and stamps the new weight version.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from verst.diffusion.server import DiffusionClient
from verst.fleet.launcher import LocalEngine, free_port, wait_healthy

START_TIMEOUT_S = 300.0


def launch(
    model_dir: str, run_dir: Path, device: torch.device
) -> tuple[LocalEngine, DiffusionClient]:
    port = free_port()
    log_path = run_dir / "diffusion-engine.log"
    log = log_path.open("wb")
    cmd = [
        sys.executable,
        "-m",
        "verst",
        "serve-diffusion",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--device",
        str(device),
    ]
    # its own session, so stopping it never signals the trainer's process group
    process = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )
    engine = LocalEngine(process=process, port=port, log_path=log_path, _log=log)
    try:
        wait_healthy(engine, START_TIMEOUT_S, "verst serve-diffusion")
    except RuntimeError:
        engine.stop()
        raise
    return engine, DiffusionClient(engine.url)


def push(model: torch.nn.Module, client: DiffusionClient, run_dir: Path, version: int) -> None:
    """Full weights to the served engine through the disk."""
    target = run_dir / "sync"
    model.save_pretrained(target / "transformer")
    client.update_weights_from_disk(target, version)
