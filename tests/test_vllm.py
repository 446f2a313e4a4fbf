"""The vLLM client: SGLang `/generate` bodies to vLLM completions and back; a live server when
one is installed (VERST_VLLM_PYTHON names its environment's python), skipped otherwise."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from verst.fleet.client import EngineError
from verst.fleet.vllm import completion_body, generate_result, vllm_available

BODY = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True, "top_k": 5},
}
ANSWER = {
    "id": "cmpl-1",
    "choices": [
        {
            "text": "",
            "finish_reason": "length",
            "logprobs": {
                "tokens": ["token_id:9", "token_id:4", "token_id:9"],
                "token_logprobs": [-0.5, -1.25, -2.0],
            },
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3},
}


def test_a_generate_body_becomes_a_token_in_completion() -> None:
    body = completion_body("m", BODY)
    assert body == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 3,
        "logprobs": 0,
        "temperature": 0.0,
        "top_k": 5,
        "ignore_eos": True,
    }
    with pytest.raises(EngineError, match="cannot pass on"):
        completion_body("m", {"input_ids": [1], "sampling_params": {"stop": ["x"]}})
    with pytest.raises(EngineError, match="input_ids"):
        completion_body("m", {"text": "hi"})


def test_a_completion_comes_back_in_sglangs_shape() -> None:
    result = generate_result(completion_body("m", BODY), ANSWER)
    assert result["output_ids"] == [9, 4, 9]
    meta = result["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["output_token_logprobs"] == [[-0.5, 9, None], [-1.25, 4, None], [-2.0, 9, None]]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
    text_tokens = {**ANSWER, "choices": [{**ANSWER["choices"][0], "logprobs": {"tokens": ["a"]}}]}
    with pytest.raises(EngineError, match="return-tokens-as-token-ids"):
        generate_result(completion_body("m", BODY), text_tokens)


VLLM_PYTHON = os.environ.get("VERST_VLLM_PYTHON")


@pytest.mark.slow
@pytest.mark.skipif(
    not (VLLM_PYTHON or vllm_available()), reason="vLLM is not installed (set VERST_VLLM_PYTHON)"
)
def test_a_live_vllm_server_generates_through_the_client(tmp_path: Path) -> None:
    from tests.servers import tiny_model
    from verst.fleet.launcher import free_port
    from verst.fleet.vllm import VllmEngineClient, launch_vllm
    from verst.models.tiny import TinyModelConfig

    # head_dim 64: vLLM's CPU attention kernels take the usual head sizes only
    shape = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1)
    model_dir = tiny_model(tmp_path, config=shape)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    with launch_vllm(model_dir, free_port(), python=VLLM_PYTHON, env=env) as server:
        client = VllmEngineClient(server.url, model=str(model_dir))

        async def scenario() -> dict:
            try:
                assert await client.health()
                with pytest.raises(EngineError, match="not available"):
                    await client.pause_generation()
                return await client.generate(BODY)  # type: ignore[return-value]
            finally:
                await client.close()

        result = asyncio.run(scenario())
    assert len(result["output_ids"]) == 3
    assert all(lp <= 0 for lp, _, _ in result["meta_info"]["output_token_logprobs"])
