"""Overlapped decode steps on CUDA (`verst.engine.overlap`): step N+1's CUDA graph replays on
step N's sampled tokens, gathered on the device, before the host reads them. Greedy and seeded
outputs equal the synchronous scheduler's, through the scheduler and a served engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_qwen3
from tests.test_overlap import assert_same, counting, mixed_requests
from verst.engine import SamplingParams
from verst.engine.kv_pool import KVPool
from verst.engine.paged_attention import triton
from verst.engine.scheduler import Scheduler

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton"
)

# float32 on the default path (lean forward, Triton kernels, decode graphs); bf16 through the
# batch-invariant forward, whose rows do not depend on the batch's size (an overlapped step
# carries rows that finished one step before, so its graph bucket can differ from the
# synchronous step's, and bf16 GEMMs of other sizes may round a near-tie the other way)
CONFIGS = {
    "fp32": (torch.float32, {}),
    "fp32_eager": (torch.float32, {"cuda_graphs": False}),
    "bf16_invariant": (torch.bfloat16, {"true_on_policy": True}),
}


def scheduler(dtype: torch.dtype, overlap: bool | None, **options) -> Scheduler:
    model = tiny_qwen3().to("cuda", dtype)
    pool = KVPool(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        num_pages=1024,
        dtype=dtype,
        device="cuda",
    )
    return Scheduler(model, pool, eos_token_ids=[63], pad_token_id=0, overlap=overlap, **options)


def test_overlap_none_means_on_cuda() -> None:
    assert scheduler(torch.float32, overlap=None).overlap


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_overlap_gives_the_synchronous_outputs_on_cuda(config: str, batch: int) -> None:
    dtype, options = CONFIGS[config]
    sync = scheduler(dtype, overlap=False, **options)
    plain = sync.generate(mixed_requests(batch))
    # per row a token its unstopped output holds midway: those rows stop early (as on EOS)
    stops = {i: o.output_ids[len(o.output_ids) // 2] for i, o in enumerate(plain) if i % 2}
    assert sync.flush_cache()  # both runs start on an empty prefix cache
    expected = sync.generate(mixed_requests(batch, stops))
    overlapped = scheduler(dtype, overlap=True, **options)
    counts = counting(overlapped)
    got = overlapped.generate(mixed_requests(batch, stops))
    assert_same(expected, got)
    assert counts["overlapped"] > 0
    assert overlapped._pending is None and not overlapped.running
    graphs = options.get("cuda_graphs", True)
    assert (len(overlapped.runner._graphs) > 0) == graphs
    for sched in (sync, overlapped):
        assert sched.pool.num_free() + sched.cache_stats()["cached_pages"] == 1024


def test_overlapped_graph_steps_across_buckets_and_weight_updates() -> None:
    """Batch sizes that shrink across graph buckets while steps overlap, and a weight update
    (a drain) in the middle: the same tokens and versions as synchronous steps."""
    outs = {}
    for overlap in (False, True):
        sched = scheduler(torch.float32, overlap=overlap)
        for request in mixed_requests(40):
            sched.submit(request)
        done = []
        for _ in range(8):
            done += sched.step()
        params = {n: p.clone() for n, p in sched.model.named_parameters()}
        torch.manual_seed(3)
        noisy = [(n, p + 0.05 * torch.randn_like(p)) for n, p in params.items()]
        sched.update_weights_from_tensors(noisy, version=1)
        while sched.has_work():
            done += sched.step()
        outs[overlap] = sorted(done, key=lambda o: o.rid)
    assert_same(outs[False], outs[True])


def test_served_engines_give_the_same_outputs_overlapped_on_cuda(tmp_path: Path) -> None:
    from tests.servers import tiny_model
    from verst.engine.serving import ServingEngine

    model_dir = str(tiny_model(tmp_path))

    async def serve(overlap: bool) -> list[list[int]]:
        serving = ServingEngine.from_model_dir(
            model_dir,
            device="cuda",
            dtype=torch.float32,
            kv_cache_bytes=64 << 20,
            batch_wait_s=0.001,
            overlap=overlap,
        )
        await serving.start()
        try:
            calls = [
                serving.generate(
                    [40 + i % 50, 41, 42 + i % 3],
                    SamplingParams(
                        max_new_tokens=4 + (7 * i) % 40,
                        temperature=0.0 if i % 2 else 1.0,
                        sampling_seed=None if i % 2 else 7 + i,
                    ),
                    rid=f"s{i}",
                    return_logprob=False,
                )
                for i in range(64)
            ]
            results = await asyncio.gather(*calls)
            assert serving.scheduler.overlap is overlap
            return [r.to_dict()["output_ids"] for r in results]
        finally:
            await serving.stop()

    assert asyncio.run(serve(True)) == asyncio.run(serve(False))


def test_the_staging_ring_never_rewrites_a_buffer_before_its_copy_ran() -> None:
    """The copies queue behind device work; the host stages the next ones at once."""
    from verst.engine.staging import StagingRing

    ring = StagingRing((4, 8), torch.long, torch.device("cuda"))
    meta = torch.zeros((5, 4, 16), dtype=torch.long, device="cuda")
    torch.cuda._sleep(100_000_000)  # tens of ms of device work in front of the copies
    for k in range(5):
        ring.copy_to(meta[k, :, :8], torch.full((4, 8), k))  # a strided target, as `_meta`'s
    torch.cuda.synchronize()
    for k in range(5):
        assert (meta[k, :, :8] == k).all() and (meta[k, :, 8:] == 0).all()
