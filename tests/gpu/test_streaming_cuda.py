"""Streaming by token on CUDA (decode CUDA graphs, the Triton kernel): the streamed chunks of a
greedy request with top-k log-probs add up to exactly the non-streamed result."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.servers import tiny_model
from verst.engine import GenerateRequest, SamplingParams
from verst.engine.results import DetokenizeParams
from verst.engine.serving import ServingEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_streamed_chunks_match_the_whole_result_on_cuda(tmp_path: Path) -> None:
    serving = ServingEngine.from_model_dir(
        str(tiny_model(tmp_path)), device="cuda", dtype=torch.bfloat16, batch_wait_s=0.005
    )
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

    def request(rid: str) -> GenerateRequest:
        return GenerateRequest([40, 41, 42], params, rid=rid, top_logprobs_num=3)

    async def both() -> tuple[list, object]:
        await serving.start()
        chunks = [c async for c in serving.generate_stream(request("s"), DetokenizeParams())]
        whole = await serving.generate(
            [40, 41, 42], params, rid="w", return_logprob=True, top_logprobs_num=3
        )
        await serving.stop()
        return chunks, whole

    chunks, whole = asyncio.run(both())
    assert len(chunks) > 2 and chunks[0].meta_info["finish_reason"] is None
    last = chunks[-1]
    assert last.output_ids == whole.output_ids and last.text == whole.text
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert last.meta_info[key] == whole.meta_info[key]
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after.output_ids[: len(before.output_ids)] == before.output_ids
