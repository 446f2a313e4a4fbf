"""The engine called in-process (`Scheduler.generate`, the embedded engine): greedy parity with
HF generate, exact log-probs, sampling params, stopping, reproducibility, weight updates."""

from __future__ import annotations

import pytest
import torch

from verst.engine import GenerateRequest, SamplingParams, Scheduler, sample_next_tokens

EOS = 63
PAD = 0
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12], [20, 21, 22, 23, 24]]


def make_engine(model, seed: int = 0, max_running: int = 256) -> Scheduler:
    return Scheduler.for_model(
        model,
        eos_token_ids=[EOS],
        pad_token_id=PAD,
        seed=seed,
        max_running=max_running,
        kv_cache_bytes=4 << 20,
        page_size=4,
    )


def requests(**params) -> list[GenerateRequest]:
    return [GenerateRequest(list(p), SamplingParams(**params)) for p in PROMPTS]


def full_forward_logprobs(model, prompt, output_ids, temperature: float) -> torch.Tensor:
    """Log-probs of output_ids from one unpadded, uncached forward over prompt + output."""
    ids = torch.tensor([prompt + output_ids[:-1]])
    with torch.no_grad():
        logits_T_V = model(ids).logits[0, len(prompt) - 1 :].float()
    logprobs_T_V = torch.log_softmax(logits_T_V / temperature, dim=-1)
    return logprobs_T_V.gather(-1, torch.tensor(output_ids).unsqueeze(-1)).squeeze(-1)


def test_greedy_matches_hf_generate_with_mixed_lengths(model):
    outs = make_engine(model).generate(requests(max_new_tokens=10, temperature=0.0))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        hf = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )[0, len(prompt) :].tolist()
        if EOS in hf:
            hf = hf[: hf.index(EOS) + 1]
        assert out.output_ids == hf
        assert out.prompt_tokens == len(prompt)
        assert out.completion_tokens == len(out.output_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_full_forward(model, temperature):
    outs = make_engine(model).generate(requests(max_new_tokens=12, temperature=temperature))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert len(out.output_token_logprobs) == len(out.output_ids) > 0
        expected = full_forward_logprobs(model, prompt, out.output_ids, temperature or 1.0)
        torch.testing.assert_close(
            torch.tensor(out.output_token_logprobs), expected, atol=1e-5, rtol=0
        )


def test_top_k_one_and_tiny_top_p_equal_greedy(model):
    engine = make_engine(model)
    greedy = [o.output_ids for o in engine.generate(requests(max_new_tokens=12, temperature=0))]
    top_k = engine.generate(requests(max_new_tokens=12, temperature=1.0, top_k=1))
    top_p = engine.generate(requests(max_new_tokens=12, temperature=1.0, top_p=1e-6))
    assert [o.output_ids for o in top_k] == greedy
    assert [o.output_ids for o in top_p] == greedy


def test_stop_token_included_and_length_finish(model):
    engine = make_engine(model)
    first = engine.generate(requests(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    for out in first:
        assert out.finish_reason == "length" and len(out.output_ids) == 6
    # Stop on the third greedy token of each prompt: it is included and ends the output.
    stops = [o.output_ids[2] for o in first]
    reqs = [
        GenerateRequest(list(p), SamplingParams(20, temperature=0.0, stop_token_ids=[s]))
        for p, s in zip(PROMPTS, stops, strict=True)
    ]
    for out, s in zip(engine.generate(reqs), stops, strict=True):
        assert out.finish_reason == "stop"
        assert out.output_ids[-1] == s and s not in out.output_ids[:-1]
    zero = engine.generate(requests(max_new_tokens=0))
    assert all(o.output_ids == [] and o.finish_reason == "length" for o in zero)


def test_eos_stops_unless_ignored(model):
    engine = make_engine(model)
    first = engine.generate(requests(max_new_tokens=4, temperature=0.0))
    ids = first[0].output_ids
    eos = ids[1]
    engine.eos_token_ids = [eos]
    out = engine.generate([GenerateRequest(PROMPTS[0], SamplingParams(20, temperature=0.0))])[0]
    assert out.output_ids == ids[: ids.index(eos) + 1] and out.finish_reason == "stop"
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    out = engine.generate([GenerateRequest(PROMPTS[0], params)])[0]
    assert out.output_ids == first[0].output_ids and out.finish_reason == "length"


def test_per_row_params_in_one_batch(model):
    engine = make_engine(model)
    greedy_3 = SamplingParams(max_new_tokens=3, temperature=0)
    alone = [
        engine.generate([GenerateRequest(PROMPTS[0], greedy_3)]),
        engine.generate([GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=9, top_k=1))]),
    ]
    mixed = engine.generate(
        [
            GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=3, temperature=0)),
            GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=9, top_k=1)),
            GenerateRequest(PROMPTS[2], SamplingParams(max_new_tokens=5, temperature=0.7)),
            GenerateRequest(PROMPTS[3], SamplingParams(max_new_tokens=0), return_logprob=False),
        ]
    )
    assert mixed[0].output_ids == alone[0][0].output_ids and len(mixed[0].output_ids) == 3
    assert mixed[1].output_ids == alone[1][0].output_ids and len(mixed[1].output_ids) == 9
    assert len(mixed[2].output_ids) == 5
    assert mixed[3].output_ids == [] and mixed[3].output_token_logprobs == []


def test_same_seed_same_outputs_and_batches_chunk(model):
    def run(seed: int, max_batch_size: int = 256) -> list[list[int]]:
        engine = make_engine(model, seed=seed, max_running=max_batch_size)
        return [o.output_ids for o in engine.generate(requests(max_new_tokens=12))]

    assert run(0) == run(0)
    assert run(0) != run(1)
    chunked = make_engine(model, max_running=3)
    reqs = requests(max_new_tokens=5, temperature=0.0)
    assert [o.rid for o in chunked.generate(reqs)] == [r.rid for r in reqs]


def test_update_weights_changes_outputs_and_stamps_version(model):
    engine = make_engine(model)
    before = engine.generate(requests(max_new_tokens=8, temperature=0.0))
    assert all(o.weight_version == 0 for o in before)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        torch.manual_seed(1)
        new = [(n, torch.randn_like(p) * 0.2) for n, p in model.named_parameters()]
        engine.update_weights_from_tensors(new, version=3)
        after = engine.generate(requests(max_new_tokens=8, temperature=0.0))
        assert all(o.weight_version == 3 for o in after)
        assert [o.output_ids for o in after] != [o.output_ids for o in before]
        with pytest.raises(KeyError, match="no.such"):
            engine.update_weights_from_tensors([("no.such", torch.zeros(1))], version=4)
        with pytest.raises(ValueError, match="model.norm.weight"):
            engine.update_weights_from_tensors([("model.norm.weight", torch.zeros(3))], version=4)
        assert engine.weight_version == 3
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_sampling_params_validate_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()
    SamplingParams().validate()


def test_sampler_rows_differ_and_truncation_holds():
    torch.manual_seed(0)
    logits_B_V = torch.randn(4, 50).repeat(64, 1)
    temperature_B = torch.tensor([0.0, 1.0, 1.0, 1.0]).repeat(64)
    top_k_B = torch.tensor([-1, 3, -1, -1]).repeat(64)
    top_p_B = torch.tensor([1.0, 1.0, 0.5, 1.0]).repeat(64)
    gen = torch.Generator().manual_seed(0)
    tokens_B, logprobs_B = sample_next_tokens(logits_B_V, temperature_B, top_p_B, top_k_B, gen)
    rows = tokens_B.view(64, 4)
    assert (rows[:, 0] == logits_B_V[0].argmax()).all()
    assert set(rows[:, 1].tolist()) <= set(logits_B_V[1].topk(3).indices.tolist())
    probs_sorted, idx = logits_B_V[2].softmax(-1).sort(descending=True)
    nucleus = idx[: int((probs_sorted.cumsum(-1) < 0.5).sum()) + 1].tolist()
    assert set(rows[:, 2].tolist()) <= set(nucleus)
    expected = torch.log_softmax(logits_B_V, -1).gather(-1, tokens_B[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs_B, expected)


def test_skipping_the_argmax_when_no_row_is_greedy_draws_the_same_tokens():
    logits_B_V = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    temperature_B = torch.full((16,), 0.7)
    draws = [
        sample_next_tokens(
            logits_B_V, temperature_B, None, None, torch.Generator().manual_seed(5), any_greedy=g
        )
        for g in (True, False)
    ]
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)


def test_group_samples_share_one_prefill_and_stay_exact(model):
    """n samples of one prompt (plus another prompt) in one batch: sampled outputs keep exact
    log-probs, and greedy outputs equal each prompt generated alone."""
    engine = make_engine(model, seed=3)
    group = [PROMPTS[1]] * 5 + [PROMPTS[0]] * 3
    sampled = engine.generate(
        [
            GenerateRequest(input_ids=p, sampling_params=SamplingParams(max_new_tokens=6))
            for p in group
        ]
    )
    assert len({tuple(o.output_ids) for o in sampled[:5]}) > 1  # samples differ
    for prompt, out in zip(group, sampled, strict=True):
        expected = full_forward_logprobs(model, prompt, out.output_ids, 1.0)
        torch.testing.assert_close(
            torch.tensor(out.output_token_logprobs), expected, atol=1e-5, rtol=0
        )
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    together = engine.generate(
        [GenerateRequest(input_ids=p, sampling_params=greedy) for p in group]
    )
    for prompt, out in zip(group, together, strict=True):
        alone = engine.generate([GenerateRequest(input_ids=prompt, sampling_params=greedy)])[0]
        assert out.output_ids == alone.output_ids
