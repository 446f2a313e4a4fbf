"""A `verst serve-diffusion` subprocess for `diffusion.engine: http`, and the disk weight push.

The trainer writes its weights with `save_pretrained` into `RUN_DIR/sync/transformer`, then the
engine loads them through `/update_weights_from_disk` and stamps the new weight version. With
LoRA it writes the adapters alone in peft's format to `RUN_DIR/sync/adapter`, which the engine
applies to its frozen base through `/load_lora_adapter` (as the adapter `policy`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from verst.diffusion import adapters
from verst.diffusion.server import DiffusionClient
from verst.fleet.launcher import LocalEngine, free_port, wait_healthy
from verst.models.lora import POLICY_ADAPTER, LoraConfig

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


def push(
    model: torch.nn.Module,
    client: DiffusionClient,
    run_dir: Path,
    version: int,
    lora: LoraConfig | None = None,
) -> int:
    """The weights to the served engine through the disk: the full transformer, or with
    `lora` the adapters alone (a peft directory). Returns the bytes written."""
    target = run_dir / "sync"
    if lora is not None:
        written = adapters.save(target / adapters.ADAPTER_DIR, model, lora)
        client.load_lora_adapter(target / adapters.ADAPTER_DIR, version, name=POLICY_ADAPTER)
        return written
    model.save_pretrained(target / "transformer")
    client.update_weights_from_disk(target, version)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())
