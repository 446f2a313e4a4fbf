"""The sampling penalties against their closed forms (SGLang's / OpenAI's formulas) on small
logits tensors, the per-request device state behind them, and the scheduler: greedy decoding
with a penalty equals a step-by-step reference over full forwards, min_new_tokens holds the
stop tokens back, stop strings and regexes end a request at the token that completes them, and
the reported log-prob is the penalized distribution's."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_qwen3_pool
from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.engine.penalties import PenaltySlots
from verst.engine.sampling import RowPenalties, apply_penalties, sample_next_tokens, sample_rows
from verst.engine.stop_strings import StopMatcher, regex_width

LOGITS = [[2.0, -1.0, 0.5, -3.0], [1.0, 1.0, 1.0, 1.0]]
COUNTS = [[3.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]]


def test_frequency_and_presence_are_subtracted_per_count_and_once() -> None:
    pen = RowPenalties(
        counts_B_V=torch.tensor(COUNTS),
        frequency_B=torch.tensor([0.5, -0.25]),
        presence_B=torch.tensor([1.0, 0.0]),
    )
    z = apply_penalties(torch.tensor(LOGITS), pen)
    # OpenAI: z - count * frequency - (count > 0) * presence
    expected = [
        [2.0 - 3 * 0.5 - 1.0, -1.0 - 0.5 - 1.0, 0.5, -3.0],
        [1.0, 1.0, 1.0 + 2 * 0.25, 1.0],
    ]
    torch.testing.assert_close(z, torch.tensor(expected))


def test_repetition_divides_positive_and_multiplies_negative_logits_of_output_tokens() -> None:
    pen = RowPenalties(counts_B_V=torch.tensor(COUNTS), repetition_B=torch.tensor([2.0, 0.5]))
    z = apply_penalties(torch.tensor(LOGITS), pen)
    expected = [[1.0, -2.0, 0.5, -3.0], [1.0, 1.0, 2.0, 1.0]]
    torch.testing.assert_close(z, torch.tensor(expected))


def test_additive_penalties_come_before_the_repetition_scaling() -> None:
    """SGLang's order: frequency / presence first, then the repetition penalty on the result."""
    pen = RowPenalties(
        counts_B_V=torch.tensor([[1.0, 0.0]]),
        presence_B=torch.tensor([3.0]),
        repetition_B=torch.tensor([2.0]),
    )
    z = apply_penalties(torch.tensor([[2.0, 0.0]]), pen)
    torch.testing.assert_close(z, torch.tensor([[(2.0 - 3.0) * 2.0, 0.0]]))


def test_blocked_tokens_are_minus_inf_and_the_bias_is_added() -> None:
    pen = RowPenalties(
        blocked_B_V=torch.tensor([[False, True, False, False], [False, False, False, False]]),
        bias_B_V=torch.tensor([[0.0, 5.0, -1.0, 0.0], [0.0, 0.0, 0.0, 100.0]]),
    )
    z = apply_penalties(torch.tensor(LOGITS), pen)
    assert z[0, 1] == -math.inf  # a bias does not lift a blocked token
    torch.testing.assert_close(z[0, [0, 2, 3]], torch.tensor([2.0, -0.5, -3.0]))
    torch.testing.assert_close(z[1], torch.tensor([1.0, 1.0, 1.0, 101.0]))


def test_the_logprob_is_of_the_penalized_distribution() -> None:
    logits = torch.tensor(LOGITS)
    pen = RowPenalties(counts_B_V=torch.tensor(COUNTS), repetition_B=torch.tensor([5.0, 1.0]))
    z = apply_penalties(logits, pen)
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=2.0)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_rows(logits, [greedy, hot], [None, None], gen, pen)
    assert tokens[0] == 2  # 0.5 beats 2.0 / 5 once token 0 was output
    expected = torch.stack([torch.log_softmax(z[0], -1), torch.log_softmax(z[1] / 2.0, -1)])
    torch.testing.assert_close(logprobs, expected[[0, 1], tokens])
    tokens, logprobs = sample_next_tokens(z, torch.zeros(2), None, None, None, any_sampled=False)
    torch.testing.assert_close(logprobs, torch.log_softmax(z, -1)[[0, 1], tokens])


def test_slots_count_outputs_on_the_device_and_keep_the_neutral_row_empty() -> None:
    slots = PenaltySlots(vocab=6, device=torch.device("cpu"))
    eos = [5]
    a = slots.claim(SamplingParams(frequency_penalty=1.0), eos)
    b = slots.claim(SamplingParams(min_new_tokens=2, logit_bias={3: 2.5}), eos)
    rows = torch.tensor([a, 0, b, a])  # a request may also appear once per row it samples
    slots.record(rows[:3], torch.tensor([1, 1, 4]))
    slots.record(torch.tensor([a]), torch.tensor([1]))
    assert slots.counts_S_V[a].tolist() == [0, 2, 0, 0, 0, 0]
    assert slots.counts_S_V[0].tolist() == [0.0] * 6
    pen = slots.gather(torch.tensor([a, 0, b]))
    assert pen.counts_B_V is not None and pen.frequency_B is not None
    assert pen.frequency_B.tolist() == [1.0, 0.0, 0.0]
    assert pen.presence_B is None and pen.repetition_B is None  # no held slot uses them
    assert pen.blocked_B_V is not None and pen.blocked_B_V.tolist()[2] == [0, 0, 0, 0, 0, 1]
    assert pen.bias_B_V is not None and pen.bias_B_V[2].tolist() == [0, 0, 0, 2.5, 0, 0]
    slots.record(torch.tensor([b]), torch.tensor([0]))  # b's second token: no longer short
    assert slots.gather(torch.tensor([b])).blocked_B_V.tolist() == [[False] * 6]
    slots.release(b)
    assert slots.gather(torch.tensor([a])).blocked_B_V is None  # min_new unused again
    reused = slots.claim(SamplingParams(presence_penalty=0.5), eos)
    assert reused == b  # the freed row comes back clean
    pen = slots.gather(torch.tensor([reused]))
    assert pen.counts_B_V.tolist() == [[0.0] * 6] and pen.bias_B_V is None


def test_slots_grow_and_keep_their_state() -> None:
    slots = PenaltySlots(vocab=4, device=torch.device("cpu"))
    held = [slots.claim(SamplingParams(repetition_penalty=1.5), []) for _ in range(20)]
    assert len(set(held)) == 20 and 0 not in held and slots.capacity == 32
    slots.record(torch.tensor(held[:1]), torch.tensor([2]))
    assert slots.counts_S_V[held[0], 2] == 1.0
    more = slots.claim(SamplingParams(logit_bias={1: -3.0}), [])
    assert slots.bias_S_V is not None and slots.bias_S_V[more, 1] == -3.0


@pytest.mark.parametrize(
    "field,value",
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.01),
        ("repetition_penalty", math.nan),
        ("min_new_tokens", -1),
        ("min_new_tokens", 200),
        ("min_new_tokens", 1.5),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"3": 1.0}),
        ("logit_bias", {3: math.inf}),
        ("logit_bias", [3]),
    ],
)
def test_bad_penalties_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_new_tokens=128, **{field: value}).validate()  # type: ignore[arg-type]


# ---- the scheduler ---------------------------------------------------------------------------

PROMPT = [1, 2, 3, 4, 5, 6]


def new_scheduler(model: torch.nn.Module, eos: list[int] | None = None) -> Scheduler:
    return Scheduler(model, tiny_qwen3_pool(torch.float32), eos_token_ids=eos or [], pad_token_id=0)


@torch.no_grad()
def reference_greedy(
    model: torch.nn.Module, prompt: list[int], n: int, params: SamplingParams
) -> tuple[list[int], list[float]]:
    """Greedy decoding with the penalties written out per step over full forwards (no cache,
    no batching): the closed form the engine's tensor ops must equal."""
    tokens = list(prompt)
    out: list[int] = []
    logprobs: list[float] = []
    for _ in range(n):
        z = model(torch.tensor([tokens])).logits[0, -1].float()
        for token in set(out):
            count = out.count(token)
            z[token] -= params.frequency_penalty * count + params.presence_penalty
            r = params.repetition_penalty
            z[token] = z[token] / r if z[token] > 0 else z[token] * r
        for token, bias in params.logit_bias.items():
            z[token] += bias
        choice = int(z.argmax())
        logprobs.append(float(torch.log_softmax(z, -1)[choice]))
        out.append(choice)
        tokens.append(choice)
    return out, logprobs


PENALIZED = [
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(frequency_penalty=1.5),
    SamplingParams(presence_penalty=2.0, repetition_penalty=1.2),
    SamplingParams(logit_bias={7: 3.0, 22: -2.0}),
]


def test_penalized_greedy_equals_the_step_by_step_reference(model: torch.nn.Module) -> None:
    scheduler = new_scheduler(model)
    plain = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    base = scheduler.generate([GenerateRequest(PROMPT, plain)])[0].output_ids
    assert len(set(base)) == 1  # the tiny model repeats one token: a penalty must change that
    requests = [GenerateRequest(PROMPT, plain)]  # a plain row batched with penalized ones
    for p in PENALIZED:
        params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, **_pen(p))
        requests.append(GenerateRequest(list(PROMPT), params))
    outs = scheduler.generate(requests)
    assert outs[0].output_ids == base
    for out, request in zip(outs[1:], requests[1:], strict=True):
        ids, logprobs = reference_greedy(model, PROMPT, 12, request.sampling_params)
        assert out.output_ids == ids, request.sampling_params
        torch.testing.assert_close(out.output_token_logprobs, logprobs, atol=1e-4, rtol=0)
        assert out.output_ids != base
    assert scheduler.penalties.held == 0 and scheduler.penalties.requests == 0


def test_top_logprobs_are_of_the_penalized_distribution(model: torch.nn.Module) -> None:
    """With penalties, `output_top_logprobs` are of the distribution sampled from (as SGLang's
    and the sampled token's own log-prob are): under greedy the top entry is the token."""
    scheduler = new_scheduler(model)
    for p in PENALIZED:
        params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, **_pen(p))
        request = GenerateRequest(list(PROMPT), params, top_logprobs_num=3, token_ids_logprob=[7])
        out = scheduler.generate([request])[0]
        _, reference = reference_greedy(model, PROMPT, 8, params)
        for j, token in enumerate(out.output_ids):
            (top_lp, top_id), *_ = out.output_top_logprobs[j]
            assert top_id == token
            assert top_lp == pytest.approx(out.output_token_logprobs[j], abs=1e-5)
            assert top_lp == pytest.approx(reference[j], abs=1e-4)
        assert out.output_token_ids_logprobs[0][0] < 0


def _pen(p: SamplingParams) -> dict[str, object]:
    names = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")
    return {name: getattr(p, name) for name in names}


def test_min_new_tokens_holds_back_eos_and_stop_tokens(model: torch.nn.Module) -> None:
    plain = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    scheduler = new_scheduler(model)
    first = scheduler.generate([GenerateRequest(PROMPT, plain)])[0].output_ids[0]
    for eos, stop_ids in (([first], []), ([], [first])):
        scheduler = new_scheduler(model, eos)
        greedy = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=stop_ids)
        assert scheduler.generate([GenerateRequest(PROMPT, greedy)])[0].output_ids == [first]
        held = SamplingParams(
            max_new_tokens=12, temperature=0, stop_token_ids=stop_ids, min_new_tokens=4
        )
        out = scheduler.generate([GenerateRequest(PROMPT, held)])[0]
        assert len(out.output_ids) >= 5 and first not in out.output_ids[:4]
        assert out.output_token_logprobs[0] > -math.inf
        if out.finish_reason == "stop":
            assert out.output_ids[-1] == first and out.matched_stop == first


def test_sampled_rows_with_penalties_never_draw_a_blocked_token(model: torch.nn.Module) -> None:
    scheduler = new_scheduler(model)
    banned = list(range(0, 64, 2))
    params = SamplingParams(
        max_new_tokens=16, temperature=1.5, logit_bias={t: -1e4 for t in banned}, sampling_seed=3
    )
    outs = scheduler.generate(
        [GenerateRequest(PROMPT, params), GenerateRequest(PROMPT, SamplingParams(16))]
    )
    assert all(t % 2 == 1 for t in outs[0].output_ids)
    assert all(lp > -30 for lp in outs[0].output_token_logprobs)  # of the biased distribution


def test_a_stop_check_ends_the_request_at_the_token_that_completes_it(
    model: torch.nn.Module,
) -> None:
    scheduler = new_scheduler(model)
    plain = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    base = scheduler.generate([GenerateRequest(PROMPT, plain)])[0]
    rep = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=2)
    varied = scheduler.generate([GenerateRequest(PROMPT, rep)])[0].output_ids

    def decode(ids: list[int]) -> str:
        return "".join(chr(65 + t % 26) for t in ids)

    target = decode(varied[3:6])
    matcher = StopMatcher([target], [], decode)
    request = GenerateRequest(PROMPT, rep, stop_check=matcher.check)
    out = scheduler.generate([request])[0]
    assert out.finish_reason == "stop" and out.matched_stop == target
    assert out.output_ids == varied[: decode(varied).find(target) + 3]
    regex = StopMatcher([], [decode(varied[4:6]) + "+"], decode)  # unbounded: whole output
    assert regex.window is None
    out = scheduler.generate([GenerateRequest(PROMPT, rep, stop_check=regex.check)])[0]
    assert out.output_ids == varied[: decode(varied).find(decode(varied[4:6])) + 2]
    assert len(base.output_ids) == 40


def test_stop_matcher_windows_and_earliest_match() -> None:
    assert regex_width(r"ab\d{2,5}") == 7 and regex_width(r"a\d+") is None
    matcher = StopMatcher(["xyz", "b"], [r"\d\d"], lambda ids: "".join(map(str, ids)))
    assert matcher.window == 3 + 2
    assert matcher.first("aa12b xyz") == (2, 4, r"\d\d")
    assert matcher.first("nothing") is None
    assert matcher.check([1]) is None and matcher.check([1, 2]) == r"\d\d"


def test_penalty_state_survives_a_retraction_and_is_freed_by_an_abort(
    model: torch.nn.Module,
) -> None:
    scheduler = new_scheduler(model)
    params = SamplingParams(
        max_new_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8
    )
    scheduler.submit(GenerateRequest(list(PROMPT), params, rid="kept"))
    scheduler.submit(GenerateRequest(list(PROMPT), params, rid="dropped"))
    for _ in range(4):
        scheduler.step()
    scheduler.pause("retract")  # requeued with their outputs: their counts stay on the device
    assert scheduler.penalties.held == 2
    assert [o.rid for o in scheduler.abort("dropped")] == ["dropped"]
    assert scheduler.penalties.held == 1
    scheduler.resume()
    finished = []
    while not finished:
        finished = scheduler.step()
    assert finished[0].output_ids == reference_greedy(model, PROMPT, 12, params)[0]
    assert scheduler.penalties.held == 0 and scheduler.penalties.requests == 0
