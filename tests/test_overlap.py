"""Overlapped decode steps (`verst.engine.overlap`) on the CPU: the same outputs as synchronous
steps, one step late; the extra token of a request fed after it finished is never returned and
its pages go back; anything outside the boundary drains the pending step first."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.test_scheduler import EOS, greedy, prompt, scheduler
from verst.engine import GenerateRequest, SamplingParams
from verst.engine.requests import GenerateOutput
from verst.engine.scheduler import Scheduler
from verst.engine.staging import StagingRing

COMPARED = (
    "rid",
    "output_ids",
    "finish_reason",
    "matched_stop",
    "completion_tokens",
    "token_weight_versions",
    "cached_tokens",
    "weight_version",
)


def fields(out: GenerateOutput) -> tuple:
    return tuple(getattr(out, name) for name in COMPARED)


def summary(outs: list[GenerateOutput]) -> list[tuple]:
    """What must not change with overlap (log-probs compared apart, to a tolerance), by rid."""
    return sorted(fields(o) for o in outs)


def assert_same(sync: list[GenerateOutput], overlapped: list[GenerateOutput]) -> None:
    """The outputs of the same requests, in the same order, agree (their rids aside)."""
    for a, b in zip(sync, overlapped, strict=True):
        assert fields(b)[1:] == fields(a)[1:]
        assert b.output_token_logprobs == pytest.approx(a.output_token_logprobs, abs=1e-5)


def counting(sched: Scheduler) -> dict[str, int]:
    """Count the runner's forwards, and those launched on a pending step's tokens."""
    counts = {"forwards": 0, "overlapped": 0}
    forward = sched.runner.forward

    def counted(rows, sampled_B=None):
        counts["forwards"] += 1
        counts["overlapped"] += sampled_B is not None
        return forward(rows, sampled_B)

    sched.runner.forward = counted  # type: ignore[method-assign]
    return counts


def repeated_pair(ids: list[int]) -> str | None:
    return "pair" if len(ids) >= 2 and ids[-1] == ids[-2] else None


def mixed_requests(n: int, stops: dict[int, int] | None = None) -> list[GenerateRequest]:
    """Greedy and seeded rows of mixed lengths, with penalties, a stop string check and
    per-request stop tokens (`stops`: row -> token)."""
    out = []
    for i in range(n):
        params = SamplingParams(
            max_new_tokens=3 + (5 * i) % 17,
            temperature=0.0 if i % 3 == 0 else 0.9,
            sampling_seed=None if i % 3 == 0 else 1000 + i,
            top_p=0.9 if i % 3 == 2 else 1.0,
            stop_token_ids=[stops[i]] if stops and i in stops else [],
            frequency_penalty=0.5 if i % 4 == 1 else 0.0,
            min_new_tokens=2 if i % 5 == 3 else 0,
            logit_bias={7: 1.5} if i % 6 == 5 else {},
        )
        check = repeated_pair if i % 7 == 4 else None
        out.append(
            GenerateRequest(
                input_ids=prompt(i, 2 + (3 * i) % 11),
                sampling_params=params,
                rid=f"r{i:03d}",
                stop_check=check,
            )
        )
    return out


def stop_tokens(model, n: int) -> dict[int, int]:
    """Per row, a token its unstopped output holds midway: those rows then stop early."""
    outs = scheduler(model, overlap=False).generate(mixed_requests(n))
    return {i: o.output_ids[len(o.output_ids) // 2] for i, o in enumerate(outs) if i % 2}


@pytest.mark.parametrize(("n", "max_running"), [(1, 256), (8, 256), (24, 256), (24, 5)])
def test_overlap_gives_the_synchronous_outputs(model, n: int, max_running: int) -> None:
    stops = stop_tokens(model, n)
    sync = scheduler(model, overlap=False, max_running=max_running)
    overlapped = scheduler(model, overlap=True, max_running=max_running)
    counts = counting(overlapped)
    expected = sync.generate(mixed_requests(n, stops))
    got = overlapped.generate(mixed_requests(n, stops))
    assert_same(expected, got)
    assert counts["overlapped"] > 0  # the steady state ran overlapped
    assert overlapped.stats.generated_tokens == sync.stats.generated_tokens
    assert overlapped._pending is None and not overlapped.running
    for sched in (sync, overlapped):  # every page free or in the prefix cache
        assert sched.pool.num_free() + sched.cache_stats()["cached_pages"] == 64
    assert overlapped.cache_stats()["cached_pages"] == sync.cache_stats()["cached_pages"]


def test_a_seeded_request_does_not_depend_on_its_batch_mates_truncation(model) -> None:
    """Overlap changes batch mates (a finished row is fed once more): a seeded row's draw must
    not depend on whether a mate truncates (top-p makes the batch's draw a sorted one)."""
    seeded = SamplingParams(max_new_tokens=6, ignore_eos=True, sampling_seed=11)
    alone = scheduler(model).generate([GenerateRequest(prompt(9), seeded)])[0]
    mate = GenerateRequest(prompt(1), SamplingParams(max_new_tokens=6, top_p=0.9, top_k=5))
    crowd = scheduler(model).generate([mate, GenerateRequest(prompt(9), seeded)])[-1]
    assert crowd.output_ids == alone.output_ids


def test_a_request_fed_after_its_stop_returns_no_extra_token_and_caches_only_its_own(
    model,
) -> None:
    reference = scheduler(model, overlap=False).generate(
        [GenerateRequest(input_ids=prompt(1, 6), sampling_params=greedy(12, ignore_eos=True))]
    )[0]
    stop = reference.output_ids[5]
    runs = {}
    for overlap in (False, True):
        sched = scheduler(model, overlap=overlap)
        counts = counting(sched)
        params = greedy(12, stop_token_ids=[stop], ignore_eos=True)
        request = GenerateRequest(input_ids=prompt(1, 6), sampling_params=params)
        out = sched.generate([request])[0]
        # the cache holds the pages of its tokens only: a longer sequence matches no further
        tokens = prompt(1, 6) + out.output_ids
        assert sched.cache is not None
        match = sched.cache.match_prefix([*tokens, 5, 5, 5, 5, 5], record_stats=False)
        runs[overlap] = (out.output_ids, out.finish_reason, match.length, counts["forwards"])
        assert sched.pool.num_free() + sched.cache_stats()["cached_pages"] == 64
    assert runs[True][:3] == runs[False][:3]
    assert (
        runs[False][0][-1] == stop and len(runs[False][0]) == reference.output_ids.index(stop) + 1
    )
    assert runs[True][3] == runs[False][3] + 1  # one step fed it after its stop, then dropped


def test_a_request_at_its_token_limit_is_not_fed_again(model) -> None:
    forwards = {}
    for overlap in (False, True):
        sched = scheduler(model, overlap=overlap)
        counts = counting(sched)
        out = sched.generate(
            [GenerateRequest(input_ids=prompt(2), sampling_params=greedy(9, ignore_eos=True))]
        )[0]
        assert out.completion_tokens == 9
        forwards[overlap] = counts["forwards"]
    assert forwards[True] == forwards[False]


def drive(model, overlap: bool, script: Callable[[Scheduler], list[GenerateOutput]]) -> list:
    sched = scheduler(copy.deepcopy(model), overlap=overlap)
    counts = counting(sched)
    outs = script(sched)
    assert (counts["overlapped"] > 0) == overlap  # the script passed through overlapped steps
    return outs


def steps(sched: Scheduler, n: int) -> list[GenerateOutput]:
    done: list[GenerateOutput] = []
    for _ in range(n):
        done += sched.step()
    return done


def until_idle(sched: Scheduler) -> list[GenerateOutput]:
    done: list[GenerateOutput] = []
    while sched.has_work():
        done += sched.step()
    return done


def long_request(i: int, rid: str, new: int = 20) -> GenerateRequest:
    return GenerateRequest(
        input_ids=prompt(i), sampling_params=greedy(new, ignore_eos=True), rid=rid
    )


def arrival(sched: Scheduler) -> list[GenerateOutput]:
    sched.submit(long_request(0, "a"))
    done = steps(sched, 5)
    pending = sched._pending is not None
    sched.submit(long_request(1, "b"))
    done += sched.step()  # the arrival's prefill: the pending step is read first
    assert sched.overlap is False or (pending and sched._pending is None)
    return done + until_idle(sched)


def abort_mid_run(sched: Scheduler) -> list[GenerateOutput]:
    for i, rid in enumerate(("keep", "drop")):
        sched.submit(long_request(i, rid))
    done = steps(sched, 6)
    done += sched.abort("drop")  # the pending step's token is its too
    return done + until_idle(sched)


def pauses(sched: Scheduler) -> list[GenerateOutput]:
    for i in range(3):
        sched.submit(long_request(i, f"p{i}", new=6 + 4 * i))
    done = steps(sched, 4)
    done += sched.pause("in_place")
    assert sched.step() == [] and sched._pending is None
    sched.resume()
    done += steps(sched, 3)
    done += sched.pause("retract")
    sched.resume()
    done += steps(sched, 4)
    done += sched.pause("abort")
    return done


def weight_update(sched: Scheduler) -> list[GenerateOutput]:
    sched.submit(long_request(3, "w", new=10))
    steps(sched, 4)
    params = {n: p.clone() for n, p in sched.model.named_parameters()}
    torch.manual_seed(3)
    noisy = [(n, p + 0.05 * torch.randn_like(p)) for n, p in params.items()]
    sched.update_weights_from_tensors(noisy, version=1)
    done = steps(sched, 3)
    sched.set_weight_version(2)
    return done + until_idle(sched)


@pytest.mark.parametrize("script", [arrival, abort_mid_run, pauses, weight_update])
def test_anything_outside_the_boundary_reads_the_pending_step_first(model, script) -> None:
    sync, overlapped = drive(model, False, script), drive(model, True, script)
    assert summary(overlapped) == summary(sync) and sync


def test_drain_returns_what_the_pending_step_finished(model) -> None:
    """What serving calls before a version bump: the pending step's finished requests, now."""
    sched = scheduler(model, overlap=True)
    sched.submit(long_request(4, "last", new=3))
    assert steps(sched, 3) == [] and sched._pending is not None  # its last token is pending
    out = sched.drain()
    assert [o.rid for o in out] == ["last"] and out[0].completion_tokens == 3
    assert sched._pending is None and not sched.has_work()


def test_rows_that_need_host_tokens_never_stay_pending(model) -> None:
    sched = scheduler(model, overlap=True)
    sched.submit(long_request(0, "plain", new=8))
    sched.submit(
        GenerateRequest(
            input_ids=prompt(1), sampling_params=greedy(8), top_logprobs_num=2, rid="extras"
        )
    )
    while sched.has_work():
        sched.step()
        assert sched._pending is None  # a step with a top-k row is read at once


def test_staging_ring_stages_each_copy_in_turn() -> None:
    ring = StagingRing((4, 3), torch.long, torch.device("cpu"))
    target = torch.zeros((4, 3), dtype=torch.long)
    for k in range(5):
        values = torch.arange(6).view(2, 3) + 10 * k
        ring.copy_to(target[:2], values)
        assert torch.equal(target[:2], values)


def test_the_runner_feeds_sampled_tokens_only_to_decode_rows(model) -> None:
    from verst.engine.model_runner import Row

    sched = scheduler(model)
    with pytest.raises(ValueError, match="one token a row"):
        sched.runner.forward([Row(tokens=[1, 2], past=0, pages=[0])], torch.tensor([3]))


def test_served_engines_give_the_same_outputs_overlapped(tmp_path: Path) -> None:
    from tests.servers import tiny_model
    from verst.engine.serving import ServingEngine

    model_dir = str(tiny_model(tmp_path))

    async def serve(overlap: bool) -> list[list[int]]:
        serving = ServingEngine.from_model_dir(model_dir, batch_wait_s=0.001, overlap=overlap)
        await serving.start()
        try:
            calls = [
                serving.generate(
                    [40 + i, 41, 42 + i % 3],
                    SamplingParams(
                        max_new_tokens=4 + 3 * i,
                        temperature=0.0 if i % 2 else 1.0,
                        sampling_seed=None if i % 2 else 7 + i,
                        stop_token_ids=[EOS],
                    ),
                    rid=f"s{i}",
                    return_logprob=False,
                )
                for i in range(10)
            ]
            results = await asyncio.gather(*calls)
            assert serving.scheduler._pending is None
            return [r.to_dict()["output_ids"] for r in results]
        finally:
            await serving.stop()

    assert asyncio.run(serve(True)) == asyncio.run(serve(False))


@pytest.mark.parametrize("seed", range(3))
def test_random_interleavings_end_every_request_once_overlapped(tmp_path: Path, seed) -> None:
    pytest.importorskip("aiohttp")
    from tests.servers import tiny_model
    from tests.test_engine_races import interleave

    asyncio.run(interleave(tiny_model(tmp_path), seed, overlap=True))


def test_adapter_rows_run_overlapped_as_they_run_synchronously(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from tests.test_engine_adapters import SHAPE, adapter, load_base, request
    from verst.models.tiny import create_tiny

    create_tiny(tmp_path / "base", SHAPE)
    base = load_base(tmp_path / "base")
    _, cfg, tensors = adapter(base, 4, seed=1)
    outs = {}
    for overlap in (False, True):
        engine = Scheduler.for_model(base, eos_token_ids=[], pad_token_id=0, overlap=overlap)
        counts = counting(engine)
        engine.load_adapter("a", cfg.wire_config(), tensors, "tensors")
        outs[overlap] = engine.generate([request(name) for name in ("a", None, "a")])
        assert (counts["overlapped"] > 0) == overlap
    assert_same(outs[False], outs[True])


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_routed_experts_of_a_request_fed_after_its_stop_are_its_own(family: str) -> None:
    from tests.test_moe_engine import engine, tiny

    model = tiny(family)
    prompts = [[5, 9, 14, 3, 77, 21, 8, 30, 31], [7, 8]]
    first = engine(model, overlap=False).generate(
        [GenerateRequest(p, greedy(9, ignore_eos=True)) for p in prompts]
    )
    stops = [out.output_ids[4] for out in first]  # they stop midway
    outs = {}
    for overlap in (False, True):
        requests = [
            GenerateRequest(p, greedy(9, stop_token_ids=[s]), return_routed_experts=True)
            for p, s in zip(prompts, stops, strict=True)
        ]
        outs[overlap] = engine(model, overlap=overlap).generate(requests)
    assert_same(outs[False], outs[True])
    for p, a, b in zip(prompts, outs[False], outs[True], strict=True):
        assert a.routed_experts is not None and b.routed_experts is not None
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert b.routed_experts.shape[0] == len(p) + len(b.output_ids) - 1


def test_engine_overlap_setting_reaches_engine_processes(tmp_path: Path) -> None:
    from verst.auth import ApiKeys
    from verst.config import load_config
    from verst.fleet.fleet import _engine_processes

    assert load_config(None, []).engine.scheduler_overlap() is None  # on CUDA engines, default
    cfg = load_config(None, ["engine.overlap=false", "placement.engines=processes"])
    overlap = cfg.engine.scheduler_overlap()
    assert overlap is False
    processes = _engine_processes(
        cfg.placement, tmp_path, ["cpu"], torch.float32, 0, ApiKeys(), False, "none", overlap
    )
    assert "--no-overlap" in processes.common_args
    processes = _engine_processes(
        cfg.placement, tmp_path, ["cpu"], torch.float32, 0, ApiKeys(), False, "none", None
    )
    assert "--overlap" in processes.common_args
