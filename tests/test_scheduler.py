"""Continuous batching over paged KV with a radix prefix cache: exact, and it behaves."""

from __future__ import annotations

import pytest
import torch
import transformers

from verst.engine import GenerateRequest, SamplingParams
from verst.engine.kv_pool import KVPool
from verst.engine.scheduler import Scheduler

EOS = 63


def scheduler(model, *, num_pages: int = 64, page_size: int = 4, **kw) -> Scheduler:
    pool = KVPool(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=page_size,
        num_pages=num_pages,
        dtype=torch.float32,
        device="cpu",
    )
    return Scheduler(model, pool, eos_token_ids=[EOS], pad_token_id=0, **kw)


def greedy(max_new: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)


def prompt(i: int, length: int = 7) -> list[int]:
    return [(i * 7 + j * 3) % 60 + 1 for j in range(length)]


def test_greedy_equals_hf_generate(model) -> None:
    prompts = [prompt(0, 5), prompt(1, 11), prompt(2, 2)]
    outs = scheduler(model).generate(
        [GenerateRequest(input_ids=p, sampling_params=greedy(ignore_eos=True)) for p in prompts]
    )
    for p, out in zip(prompts, outs, strict=True):
        expected = model.generate(
            torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        assert out.output_ids == expected


def test_logprobs_equal_full_forward(model) -> None:
    p = prompt(3, 9)
    out = scheduler(model, seed=1).generate(
        [
            GenerateRequest(
                input_ids=p, sampling_params=SamplingParams(max_new_tokens=6, ignore_eos=True)
            )
        ]
    )[0]
    with torch.no_grad():
        logits = model(torch.tensor([p + out.output_ids])).logits[0, len(p) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(
        -1, torch.tensor(out.output_ids)[:, None]
    )[:, 0]
    torch.testing.assert_close(torch.tensor(out.output_token_logprobs), expected, atol=1e-5, rtol=0)


def test_prefix_cache_hit_returns_the_same_output_as_a_miss(model) -> None:
    sched = scheduler(model)
    shared = prompt(4, 13)
    first = sched.generate([GenerateRequest(input_ids=shared, sampling_params=greedy())])[0]
    assert first.cached_tokens == 0
    again = sched.generate([GenerateRequest(input_ids=shared, sampling_params=greedy())])[0]
    assert again.cached_tokens == 12  # whole pages of the first 12 tokens (the last is recomputed)
    assert again.output_ids == first.output_ids
    longer = shared + first.output_ids + [5, 6]
    turn2 = sched.generate([GenerateRequest(input_ids=longer, sampling_params=greedy())])[0]
    cold = scheduler(model, enable_prefix_cache=False).generate(
        [GenerateRequest(input_ids=longer, sampling_params=greedy())]
    )[0]
    assert turn2.cached_tokens >= 16 and turn2.output_ids == cold.output_ids
    assert sched.cache_stats()["hit_rate"] > 0


def test_a_groups_samples_share_one_prefill_of_their_prompt(model) -> None:
    """Requests with one prompt arriving together (a GRPO group): the first prefills it; the
    rest start from a copy of its KV (whole pages shared through the cache) and its logits."""
    shared = prompt(2, 21)
    group = [GenerateRequest(input_ids=shared, sampling_params=greedy()) for _ in range(8)]
    sched = scheduler(model)
    outs = sched.generate(group)
    assert sorted(o.cached_tokens for o in outs) == [0] + [21] * 7  # nothing computed again
    stats = sched.cache_stats()
    assert sched.pool.num_free() + stats["cached_pages"] == sched.pool.num_pages
    cold = scheduler(model, enable_prefix_cache=False).generate(
        [GenerateRequest(input_ids=shared, sampling_params=greedy())]
    )[0]
    assert all(o.output_ids == cold.output_ids for o in outs)


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("chunk_tokens", [4096, 5])
def test_followers_of_a_prefill_sample_what_a_full_forward_gives(
    model, prefix_cache: bool, chunk_tokens: int
) -> None:
    """A group's samples start from their leader's KV and logits: each one's log-probs are
    those of a full forward over its own tokens, and greedy ones all agree with a lone run."""
    p = prompt(5, 10)
    sampled = SamplingParams(max_new_tokens=5, ignore_eos=True)
    sched = scheduler(model, enable_prefix_cache=prefix_cache, chunk_tokens=chunk_tokens, seed=3)
    outs = sched.generate([GenerateRequest(input_ids=p, sampling_params=sampled) for _ in range(6)])
    assert sum(o.cached_tokens == len(p) for o in outs) == 5
    for out in outs:
        with torch.no_grad():
            logits = model(torch.tensor([p + out.output_ids])).logits[0, len(p) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(
            -1, torch.tensor(out.output_ids)[:, None]
        )[:, 0]
        torch.testing.assert_close(
            torch.tensor(out.output_token_logprobs), expected, atol=1e-5, rtol=0
        )
    alone = scheduler(model).generate([GenerateRequest(input_ids=p, sampling_params=greedy())])
    group = sched.generate(
        [GenerateRequest(input_ids=p, sampling_params=greedy()) for _ in range(4)]
    )
    assert all(o.output_ids == alone[0].output_ids for o in group)


def test_followers_run_alone_when_their_leader_is_aborted(model) -> None:
    sched = scheduler(model, chunk_tokens=3)  # the leader's prefill spans several steps
    p = prompt(6, 9)
    requests = [
        GenerateRequest(input_ids=p, sampling_params=greedy(), rid=f"r{i}") for i in range(3)
    ]
    for request in requests:
        sched.submit(request)
    sched.step()  # r0 leads, r1 and r2 follow
    assert [o.rid for o in sched.abort("r0")] == ["r0"]
    done = []
    while sched.has_work():
        done += sched.step()
    alone = scheduler(model).generate([GenerateRequest(input_ids=p, sampling_params=greedy())])
    assert sorted(o.rid for o in done) == ["r1", "r2"]
    assert all(o.output_ids == alone[0].output_ids for o in done)


def test_200_concurrent_requests_complete_under_memory_pressure(model) -> None:
    sched = scheduler(model, num_pages=40, page_size=4, chunk_tokens=64)
    requests = [
        GenerateRequest(
            input_ids=prompt(i % 13, 3 + i % 9),
            sampling_params=SamplingParams(max_new_tokens=1 + i % 7),
        )
        for i in range(200)
    ]
    outs = sched.generate(requests)
    assert len(outs) == 200 and all(o.finish_reason in ("stop", "length") for o in outs)
    assert all(1 <= o.completion_tokens <= 1 + i % 7 for i, o in enumerate(outs))
    # every page is either free or held by the prefix cache
    stats = sched.cache_stats()
    assert sched.pool.num_free() + stats["cached_pages"] == sched.pool.num_pages


def test_greedy_outputs_do_not_depend_on_batch_mates_joining_and_leaving(model) -> None:
    """Greedy outputs do not depend on which other requests share the steps."""
    requests = [
        GenerateRequest(input_ids=prompt(i, 4 + i), sampling_params=greedy(3 + 2 * i))
        for i in range(6)
    ]
    alone = [scheduler(model).generate([r])[0].output_ids for r in requests]
    sched = scheduler(model, chunk_tokens=5)  # small chunks: prefill spans several steps
    assert [o.output_ids for o in sched.generate(requests)] == alone


def test_abort_and_pause_modes(model) -> None:
    sched = scheduler(model)
    long = SamplingParams(max_new_tokens=50, ignore_eos=True, temperature=0.0)
    for rid in ("keep", "drop_0", "drop_1"):
        sched.submit(GenerateRequest(input_ids=prompt(5), sampling_params=long, rid=rid))
    sched.step()
    aborted = sched.abort("drop")
    assert sorted(o.rid for o in aborted) == ["drop_0", "drop_1"]
    assert all(o.finish_reason == "abort" for o in aborted)
    assert [r.request.rid for r in sched.running] == ["keep"]

    sched.step()
    progress = len(sched.running[0].output_ids)
    assert sched.pause("in_place") == []
    assert sched.step() == [] and len(sched.running[0].output_ids) == progress  # frozen, KV kept
    sched.resume()
    sched.pause("retract")
    assert not sched.running and sched.waiting[0].retractions == 1  # requeued, KV to cache
    sched.resume()
    finished = []
    while not finished:
        finished = sched.step()
    reference = scheduler(model).generate(
        [GenerateRequest(input_ids=prompt(5), sampling_params=long)]
    )[0]
    assert finished[0].output_ids == reference.output_ids  # recomputation changed nothing

    sched.submit(GenerateRequest(input_ids=prompt(6), sampling_params=long, rid="x"))
    sched.step()
    out = sched.pause("abort")
    assert [o.finish_reason for o in out] == ["abort"] and not sched.running
    sched.resume()
    assert sched.flush_cache() and sched.cache_stats()["cached_pages"] == 0


def test_weight_update_switches_outputs_and_stamps_the_version(model) -> None:
    import copy

    sched = scheduler(copy.deepcopy(model))
    req = GenerateRequest(input_ids=prompt(7), sampling_params=greedy(ignore_eos=True))
    before = sched.generate([req])[0]
    other = transformers.Qwen3ForCausalLM(model.config)
    torch.manual_seed(1)
    other = transformers.Qwen3ForCausalLM(model.config).float()
    sched.update_weights_from_tensors(other.state_dict().items(), version=3)
    after = sched.generate(
        [GenerateRequest(input_ids=prompt(7), sampling_params=greedy(ignore_eos=True))]
    )[0]
    expected = other.generate(
        torch.tensor([prompt(7)]),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, 7:].tolist()
    assert after.output_ids == expected != before.output_ids
    assert after.weight_version == 3 and after.cached_tokens == 0  # old-weight KV was dropped


def test_a_bad_weight_update_changes_nothing(model) -> None:
    import copy

    sched = scheduler(copy.deepcopy(model))
    before = {n: p.clone() for n, p in sched.model.named_parameters()}
    good = [(n, torch.zeros_like(p)) for n, p in before.items()]
    with pytest.raises(KeyError, match="unknown parameter name"):
        sched.update_weights_from_tensors([*good, ("no.such.weight", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="shape mismatch"):
        sched.update_weights_from_tensors([*good[:-1], (good[-1][0], torch.zeros(1))], version=1)
    for name, param in sched.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert sched.weight_version == 0


def test_teacher_scoring_of_a_prompt(model) -> None:
    """max_new_tokens=0 with logprob_start_len: the input log-probs of a full forward."""
    tokens = prompt(8, 12)
    sched = scheduler(model, chunk_tokens=5)  # the prompt is scored across three chunks
    out = sched.generate(
        [
            GenerateRequest(
                input_ids=tokens,
                logprob_start_len=0,
                sampling_params=SamplingParams(max_new_tokens=0),
            )
        ]
    )[0]
    assert out.output_ids == [] and out.finish_reason == "length"
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[1:])[:, None])
    assert out.input_token_logprobs[0] is None and len(out.input_token_logprobs) == 12
    torch.testing.assert_close(
        torch.tensor(out.input_token_logprobs[1:]), expected[:, 0], atol=1e-5, rtol=0
    )
    later = sched.generate(
        [
            GenerateRequest(
                input_ids=tokens,
                logprob_start_len=4,
                sampling_params=SamplingParams(max_new_tokens=0),
            )
        ]
    )[0]
    assert later.input_token_logprobs[0] is None
    assert later.input_token_logprobs[1:] == pytest.approx(out.input_token_logprobs[5:], abs=1e-6)
    with pytest.raises(ValueError, match="logprob_start_len"):
        sched.submit(
            GenerateRequest(
                input_ids=tokens,
                logprob_start_len=12,
                sampling_params=SamplingParams(max_new_tokens=0),
            )
        )


def test_seeded_requests_do_not_depend_on_their_batch_mates(model) -> None:
    seeded = SamplingParams(max_new_tokens=6, ignore_eos=True, sampling_seed=11)
    alone = scheduler(model, seed=1).generate(
        [GenerateRequest(input_ids=prompt(9), sampling_params=seeded)]
    )[0]
    crowd = scheduler(model, seed=2).generate(
        [
            GenerateRequest(input_ids=prompt(i), sampling_params=SamplingParams(max_new_tokens=6))
            for i in range(4)
        ]
        + [GenerateRequest(input_ids=prompt(9), sampling_params=seeded)]
    )[-1]
    assert crowd.output_ids == alone.output_ids


def test_min_p_keeps_only_likely_tokens(model) -> None:
    strict = SamplingParams(max_new_tokens=6, ignore_eos=True, min_p=1.0)  # only the argmax
    sampled = scheduler(model, seed=5).generate(
        [GenerateRequest(input_ids=prompt(10), sampling_params=strict)]
    )[0]
    greedy_out = scheduler(model).generate(
        [GenerateRequest(input_ids=prompt(10), sampling_params=greedy(6, ignore_eos=True))]
    )[0]
    assert sampled.output_ids == greedy_out.output_ids


def test_a_request_running_across_a_weight_update_carries_both_versions(model) -> None:
    import copy

    sched = scheduler(copy.deepcopy(model))
    sched.submit(
        GenerateRequest(input_ids=prompt(11), rid="r", sampling_params=greedy(8, ignore_eos=True))
    )
    for _ in range(4):
        sched.step()
    sched.update_weights_from_tensors(model.state_dict().items(), version=1)
    finished = []
    while not finished:
        finished = sched.step()
    versions = finished[0].token_weight_versions
    assert versions[0] == 0 and versions[-1] == 1 and len(versions) == 8
    assert finished[0].weight_version == 1
