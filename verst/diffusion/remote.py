"""A `verst serve-diffusion` subprocess for `diffusion.engine: http`, and its weight pushes.

Through the disk (`sync.transport: disk` or `auto`): the trainer writes its weights with
`save_pretrained` into `RUN_DIR/sync/transformer`, then the engine loads them through
`/update_weights_from_disk` and stamps the new weight version. With LoRA it writes the adapters
alone in peft's format to `RUN_DIR/sync/adapter`, which the engine applies to its frozen base
through `/load_lora_adapter` (as the adapter `policy`).

Through a broadcast group (`sync.transport: broadcast`, `BroadcastPush`): the LM's transport and
update protocol unchanged (`verst.sync.broadcast`, `verst.sync.protocol`), over the LM's HTTP
engine client: the engine joins a torch.distributed group with the trainer, each push pauses
it, broadcasts the parameters bucket by bucket (or the adapters, in one bucket), stamps the
version, continues, and confirms that the engine reports the version.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from verst.diffusion import adapters
from verst.diffusion.server import DiffusionClient
from verst.fleet.client import HttpEngineClient
from verst.fleet.launcher import LocalEngine, free_port, wait_healthy
from verst.fleet.loop_thread import LoopThread
from verst.models.lora import POLICY_ADAPTER, LoraConfig
from verst.plugins import AdapterUpdate
from verst.sync.broadcast import BroadcastTransport
from verst.sync.buckets import AdapterTensors, full_parameters
from verst.sync.protocol import Weights, WeightSync

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


def group_backend(trainer: torch.device, engine: torch.device) -> str:
    """NCCL between two GPUs; gloo otherwise: NCCL cannot join two ranks on one GPU, and gloo
    carries CUDA tensors through the host."""
    on_gpus = trainer.type == engine.type == "cuda"
    return "nccl" if on_gpus and (trainer.index or 0) != (engine.index or 0) else "gloo"


class BroadcastPush:
    """The trainer's side of `sync.transport: broadcast` for one served diffusion engine."""

    def __init__(
        self,
        client: DiffusionClient,
        *,
        bucket_bytes: int,
        max_resends: int,
        backend: str = "gloo",
        lora: LoraConfig | None = None,
    ) -> None:
        self.client, self.lora = client, lora
        self.loop = LoopThread("verst-diffusion-sync")  # aiohttp's session belongs to one loop
        self.engine = HttpEngineClient(client.base_url)
        self.transport = BroadcastTransport(
            master_port=free_port(), bucket_bytes=bucket_bytes, backend=backend
        )
        self.protocol = WeightSync(
            [self.engine], self.transport, pause_mode="in_place", max_resends=max_resends
        )
        self.loop.run(self.transport.connect([self.engine]))

    def push(self, model: torch.nn.Module, version: int) -> int:
        """The model's parameters (with `lora`, its adapters alone) as `version`; returns the
        bytes broadcast."""
        weights: Weights
        if self.lora is None:
            weights = lambda: full_parameters(model)  # noqa: E731
        else:
            tensors = AdapterTensors(model.named_parameters(), next(model.parameters()).dtype)
            weights = [AdapterUpdate(POLICY_ADAPTER, self.lora.wire_config(), tensors)]
        self.loop.run(self.protocol.push(weights, version))
        self.client.weight_version = version
        return sum(self.transport.buckets_sent)

    def close(self) -> None:
        self.loop.run(self.engine.close())
        self.loop.close()
