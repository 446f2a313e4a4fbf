"""`verst serve-diffusion`: the diffusion engine over HTTP, and the client the loop drives it with.

Routes: `POST /rollout/generate` with `{"requests": [DiffusionRequest fields...]}` answers
`{"trajectories": [...]}`, each with the latents, the recorded steps, their log-probs (tensors
as base64 float32 with a shape, so the trainer's replay sees the engine's exact bits), the
image, the class ids of the conditioning and the weight version; `GET /health`. The weight
routes (disk, LoRA directory, broadcast group, pause, version) are SGLang's
(`verst.diffusion.server_weights`). Bad requests answer 400 with the field in the message.
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from verst.diffusion.engine import DiffusionEngine, DiffusionRequest, Trajectory
from verst.diffusion.server_weights import ServedEngine, add_weight_routes

REQUEST_FIELDS = {f.name for f in fields(DiffusionRequest)}


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    data = tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return {"shape": list(tensor.shape), "data": base64.b64encode(data).decode()}


def decode_tensor(body: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(body["data"]))
    if not raw:  # an ODE trajectory records no log-probs; frombuffer refuses empty buffers
        return torch.zeros(body["shape"], dtype=torch.float32)
    return torch.frombuffer(raw, dtype=torch.float32).reshape(body["shape"]).clone()


def trajectory_to_json(t: Trajectory) -> dict[str, Any]:
    return {
        "request": asdict(t.request),
        "latents": encode_tensor(t.latents),
        "image": encode_tensor(t.image),
        "record_steps": t.record_steps,
        "log_probs": encode_tensor(t.log_probs),
        "label": t.label,
        "negative_label": t.negative_label,
        "weight_version": t.weight_version,
    }


def trajectory_from_json(body: dict[str, Any]) -> Trajectory:
    return Trajectory(
        DiffusionRequest(**body["request"]),
        decode_tensor(body["latents"]),
        list(body["record_steps"]),
        decode_tensor(body["log_probs"]),
        int(body["label"]),
        int(body["negative_label"]),
        int(body["weight_version"]),
    )


def parse_requests(body: Any) -> list[DiffusionRequest]:
    """`DiffusionRequest`s from a JSON body; ValueError naming the bad field."""
    items = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError("requests: give a non-empty list of generation requests")
    parsed = []
    for n, item in enumerate(items):
        unknown = set(item) - REQUEST_FIELDS if isinstance(item, dict) else {"(not an object)"}
        if unknown:
            raise ValueError(f"requests[{n}]: unknown fields {sorted(unknown)}")
        request = DiffusionRequest(**item)
        try:
            request.recorded()
        except ValueError as error:
            raise ValueError(f"requests[{n}].{error}") from None
        parsed.append(request)
    return parsed


def make_app(engine: DiffusionEngine, model_path: str = ""):  # -> aiohttp.web.Application
    from aiohttp import web

    served = ServedEngine(engine, model_path)

    def bad(error: Exception) -> web.Response:
        return web.json_response({"error": {"message": str(error), "code": 400}}, status=400)

    async def generate(request: web.Request) -> web.Response:
        try:
            requests = parse_requests(await request.json())
        except (ValueError, TypeError, json.JSONDecodeError) as error:
            return bad(error)
        async with served.batch():  # one batch at a time: the model is not re-entrant
            try:
                trajectories = await asyncio.to_thread(engine.generate, requests)
            except ValueError as error:
                return bad(error)
        return web.json_response({"trajectories": [trajectory_to_json(t) for t in trajectories]})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/rollout/generate", generate)
    app.router.add_get("/health", health)
    add_weight_routes(app, served)
    return app


def run_diffusion_server(model_dir: str, *, host: str, port: int, device: str) -> None:
    from aiohttp import web

    from verst.diffusion.model import load

    model, meta = load(model_dir, device)
    engine = DiffusionEngine(model, meta["image_size"], device)
    web.run_app(make_app(engine, model_dir), host=host, port=port)


class DiffusionClient:
    """The engine's `generate` / `set_weight_version` over HTTP, for the loop and tests."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.weight_version = 0

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            message = json.loads(error.read()).get("error", {}).get("message", str(error))
            raise ValueError(f"{self.base_url}{path}: {message}") from None

    def generate(self, requests: list[DiffusionRequest]) -> list[Trajectory]:
        body = self._post("/rollout/generate", {"requests": [asdict(r) for r in requests]})
        return [trajectory_from_json(t) for t in body["trajectories"]]

    def update_weights_from_disk(self, model_path: Path, version: int) -> None:
        self._post(
            "/update_weights_from_disk", {"model_path": str(model_path), "weight_version": version}
        )
        self.weight_version = version

    def load_lora_adapter(self, lora_path: Path, version: int, *, name: str) -> None:
        self._post(
            "/load_lora_adapter",
            {"lora_name": name, "lora_path": str(lora_path), "weight_version": version},
        )
        self.weight_version = version
