"""The rollout worker's slot accounting (`verst.rollout.slots`), without an event loop: every
transition, the places each replacement rule holds, the put that holds back new groups, the
staleness limit on groups ahead, the transitions that must raise, and the invariants."""

from __future__ import annotations

import random

import pytest

from verst.rollout.slots import ABORTABLE, Phase, SlotError, Slots


class CheckedSlots(Slots):
    """Slots that recompute every invariant after each transition."""

    def start(self) -> int:
        key = super().start()
        self.check()
        return key

    def finish_sample(self, key: int) -> None:
        super().finish_sample(key)
        self.check()

    def put_begin(self, key: int) -> None:
        super().put_begin(key)
        self.check()

    def put_end(self, key: int) -> None:
        super().put_end(key)
        self.check()

    def forget(self, key: int) -> None:
        super().forget(key)
        self.check()

    def abort(self, key: int) -> bool:
        unconsumed = super().abort(key)
        self.check()
        return unconsumed


def slots(n: int = 2, max_inflight: int = 4, **kwargs) -> CheckedSlots:
    return CheckedSlots(n_samples_per_prompt=n, max_inflight=max_inflight, **kwargs)


def generated(s: Slots, key: int) -> None:
    """Every trajectory of the group finished."""
    while s.phase(key) is Phase.GENERATING:
        s.finish_sample(key)


def buffered(s: Slots, key: int) -> None:
    """Generated, scored and accepted by the buffer."""
    generated(s, key)
    s.put_begin(key)
    s.put_end(key)


def test_start_takes_a_group_of_places() -> None:
    s = slots()
    assert s.may_start() and s.occupied == 0
    a = s.start()
    assert s.phase(a) is Phase.GENERATING
    assert (s.generating, s.occupied, s.ahead, s.inflight_groups) == (2, 2, 1, 1)
    b = s.start()
    assert b != a and s.occupied == 4 and s.groups_started == 2
    assert not s.may_start()
    with pytest.raises(SlotError, match="no group may start: 4/4 places held"):
        s.start()


def test_sample_rule_frees_each_finished_trajectory_but_the_groups_last() -> None:
    s = slots(n=2, max_inflight=4)
    a, b = s.start(), s.start()
    s.finish_sample(a)
    assert s.generating == 3 and s.occupied == 3
    assert not s.may_start()  # one place free, a group needs two
    s.finish_sample(b)
    assert s.occupied == 2 and s.may_start()  # two free places, from two unfinished groups
    c = s.start()
    s.finish_sample(a)  # a's last: it holds that place while it is scored
    assert s.phase(a) is Phase.SCORING
    assert s.generating == 3 and s.occupied == 4 and not s.may_start()
    s.put_begin(a)
    assert s.occupied == 3 and s.phase(c) is Phase.GENERATING


def test_group_rule_holds_every_place_until_the_group_is_put() -> None:
    s = slots(n=2, max_inflight=5, replacement="group")  # the odd place is never used
    a, b = s.start(), s.start()
    s.finish_sample(a)
    s.finish_sample(b)
    assert s.generating == 2 and s.occupied == 4 and not s.may_start()
    s.finish_sample(a)
    assert s.phase(a) is Phase.SCORING and s.occupied == 4
    s.put_begin(a)
    s.put_end(a)
    assert s.occupied == 2 and s.may_start()


def test_a_put_in_progress_holds_back_new_groups() -> None:
    s = slots(n=1, max_inflight=3)
    a = s.start()
    s.finish_sample(a)
    s.put_begin(a)  # blocked: the buffer is full
    assert s.phase(a) is Phase.PUTTING and s.putting == 1
    assert s.occupied == 0 and not s.may_start()  # places free, but generation drains
    assert s.ahead == 1 and s.inflight_groups == 1  # still drawn and unserved, still ours
    s.put_end(a)  # unblocked: the buffer took it
    assert s.phase(a) is Phase.BUFFERED and s.putting == 0 and s.may_start()
    assert s.groups_put == 1 and s.inflight_groups == 0 and s.ahead == 1


def test_served_by_a_take() -> None:
    s = slots()
    a = s.start()
    buffered(s, a)
    s.forget(a)
    assert s.phase(a) is None and s.ahead == 0 and s.groups_put == 1


def test_dropped_stale_at_a_take() -> None:
    s = slots(n=1, max_inflight=2, max_ahead=2)
    a, b = s.start(), s.start()
    buffered(s, a)
    buffered(s, b)
    assert not s.may_start()  # two groups ahead
    s.forget(a)  # too old at the take's version
    assert s.ahead == 1 and s.may_start()


@pytest.mark.parametrize("why", ["filtered", "aborted, prompt given back to retry"])
def test_dropped_at_put(why) -> None:
    """The buffer reports a drop at put before the put returns."""
    s = slots(n=1, max_inflight=1, max_ahead=1)
    a = s.start()
    generated(s, a)
    s.put_begin(a)
    s.forget(a)
    assert s.phase(a) is Phase.RELEASED_IN_PUT
    assert s.ahead == 0 and s.putting == 1 and not s.may_start()  # the put has not returned
    s.put_end(a)
    assert s.phase(a) is None and s.groups_put == 1 and s.may_start()
    retry = s.start()  # the prompt given back is drawn again as a new group
    assert retry != a


def test_ahead_limit_counts_generating_putting_and_buffered_groups() -> None:
    s = slots(n=1, max_inflight=8, max_ahead=3)
    a, b, c = s.start(), s.start(), s.start()
    assert s.occupied == 3 and not s.may_start()  # places for 8, but 3 groups ahead at most
    buffered(s, a)
    generated(s, b)
    s.put_begin(b)
    s.put_end(b)
    assert s.ahead == 3 and not s.may_start()  # buffered groups still count
    s.forget(a)
    assert s.may_start()
    s.start()
    with pytest.raises(SlotError, match="3 groups ahead"):
        s.start()
    assert s.phase(c) is Phase.GENERATING


def test_abort_from_each_phase_the_worker_holds() -> None:
    s = slots(n=2, max_inflight=8)
    generating, scoring, putting, released = (s.start() for _ in range(4))
    s.finish_sample(generating)  # half-generated
    generated(s, scoring)
    for key in (putting, released):
        generated(s, key)
        s.put_begin(key)
    s.forget(released)
    assert (s.generating, s.occupied, s.putting, s.ahead) == (1, 2, 2, 3)
    assert s.abort(generating) and s.generating == 0 and s.occupied == 1
    assert s.abort(scoring) and s.occupied == 0
    assert s.abort(putting) and s.putting == 1
    assert not s.abort(released)  # the buffer had let go of it: its prompts are not ours
    assert (s.putting, s.ahead, s.inflight_groups) == (0, 0, 0)
    assert s.groups_aborted == 4 and s.groups_put == 0 and s.groups_started == 4
    assert s.may_start()


def test_a_buffered_group_is_the_buffers_and_cannot_be_aborted() -> None:
    s = slots()
    a = s.start()
    buffered(s, a)
    with pytest.raises(SlotError, match="cannot abort group 0: it is buffered"):
        s.abort(a)


@pytest.mark.parametrize(
    ("steps", "transition", "message"),
    [
        ([], "put_begin", "cannot put group 0: it is generating, not scoring"),
        ([], "put_end", "cannot end the put of group 0: it is generating"),
        ([], "forget", "cannot forget group 0: it is generating, not putting, buffered"),
        (["generated"], "finish_sample", "cannot finish a sample of group 0: it is scoring"),
        (["generated"], "forget", "it is scoring"),
        (["generated", "put_begin"], "put_begin", "it is putting"),
        (["generated", "put_begin", "forget"], "forget", "it is released_in_put"),
        (["generated", "put_begin", "put_end"], "put_end", "it is buffered"),
        (["generated", "put_begin", "put_end"], "finish_sample", "it is buffered"),
        (["generated", "put_begin", "put_end", "forget"], "forget", "group 0: it is not live"),
        (["abort"], "finish_sample", "group 0: it is not live"),
        (["abort"], "abort", "group 0: it is not live"),
    ],
)
def test_impossible_transitions_raise(steps, transition, message) -> None:
    s = slots()
    key = s.start()
    for step in steps:
        if step == "generated":
            generated(s, key)
        else:
            getattr(s, step)(key)
    before = (s.generating, s.occupied, s.putting, s.ahead, s.inflight_groups, s.phase(key))
    with pytest.raises(SlotError, match=message):
        getattr(s, transition)(key)
    assert (s.generating, s.occupied, s.putting, s.ahead, s.inflight_groups, s.phase(key)) == (
        before
    )
    s.check()


def test_a_key_never_started_is_not_live() -> None:
    s = slots()
    assert s.phase(7) is None
    with pytest.raises(SlotError, match="group 7: it is not live"):
        s.finish_sample(7)


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="n_samples_per_prompt must be >= 1"):
        Slots(n_samples_per_prompt=0, max_inflight=3)
    with pytest.raises(ValueError, match="must be at least n_samples_per_prompt"):
        Slots(n_samples_per_prompt=4, max_inflight=3)
    with pytest.raises(ValueError, match="'group' or 'sample'"):
        Slots(n_samples_per_prompt=1, max_inflight=3, replacement="trajectory")
    with pytest.raises(ValueError, match="max_ahead must be >= 1"):
        Slots(n_samples_per_prompt=1, max_inflight=3, max_ahead=0)


def test_check_catches_a_count_gone_wrong() -> None:
    s = slots()
    s.start()
    s._generating += 1
    with pytest.raises(SlotError, match="generating 3 is not the groups' sum"):
        s.check()


@pytest.mark.parametrize("replacement", ["sample", "group"])
@pytest.mark.parametrize("max_ahead", [None, 3])
def test_invariants_hold_on_random_walks(replacement, max_ahead) -> None:
    """Any order of events the worker can report keeps places within max_inflight, groups ahead
    within max_ahead, and every count equal to its recomputation (CheckedSlots)."""
    rng = random.Random(0)
    n, max_inflight = 3, 7
    s = slots(n=n, max_inflight=max_inflight, replacement=replacement, max_ahead=max_ahead)
    keys: list[int] = []
    peak = 0
    for _ in range(3000):
        moves = [("start", None)] if s.may_start() else []
        for key in keys:
            phase = s.phase(key)
            moves += [
                (move, key)
                for move, phases in (
                    ("finish_sample", {Phase.GENERATING}),
                    ("put_begin", {Phase.SCORING}),
                    ("put_end", {Phase.PUTTING, Phase.RELEASED_IN_PUT}),
                    ("forget", {Phase.PUTTING, Phase.BUFFERED}),
                    ("abort", ABORTABLE),
                )
                if phase in phases and (move != "abort" or rng.random() < 0.05)
            ]
        move, key = rng.choice(moves)
        if move == "start":
            keys.append(s.start())
        else:
            getattr(s, move)(key)
        keys = [k for k in keys if s.phase(k) is not None]
        peak = max(peak, s.occupied)
        assert s.occupied <= max_inflight
        assert max_ahead is None or s.ahead <= max_ahead
    assert peak == (6 if replacement == "group" else max_inflight)  # two groups of 3 fit in 7
    assert s.groups_started > 300
