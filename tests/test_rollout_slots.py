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


def test_due_groups_closed_form() -> None:
    """max_staleness 2, batches of 2: a group started at version w must be served by the take
    at w + 2; the take at V must serve max_j(#{deadline <= V + j} - 2j) of them."""
    s = slots(n=1, max_inflight=8, max_ahead=4)
    a, b, c, d = (s.start() for _ in range(4))  # before any take: stamped at the first
    assert s.start_version(a) is None
    s.see_version(0)
    assert [s.start_version(k) for k in (a, b, c, d)] == [0, 0, 0, 0]
    # 4 groups due by version 2, and the takes at 0, 1, 2 serve 6: nothing due yet
    assert s.due(0, 2, 2) == []
    buffered(s, c)
    buffered(s, d)
    s.forget(c)
    s.forget(d)  # the take at 0 served the two short ones
    s.see_version(1)
    e, f = s.start(), s.start()  # deadline 3
    # at 1: a, b due by 2 (takes 1 and 2 serve 4), e, f by 3: still nothing due
    assert s.due(1, 2, 2) == []
    buffered(s, e)
    buffered(s, f)
    s.forget(e)
    s.forget(f)  # the take at 1 served the next short ones
    s.see_version(2)
    g = s.start()
    assert s.due(2, 2, 2) == [a, b]  # their last chance: the take waits for both
    buffered(s, a)
    assert s.due(2, 2, 2) == [b]  # handed over: no longer waited for, still counted
    generated(s, b)
    s.put_begin(b)  # blocked at put: handed over too
    assert s.due(2, 2, 2) == []
    # a group whose deadline has passed is lost already and not waited for; a batch of 1
    # must serve only the first of two equal deadlines, one already handed over if any
    assert s.due(3, 2, 2) == [] and s.start_version(g) == 2
    t = slots(n=1, max_inflight=8, max_ahead=4)
    t.see_version(5)
    x, y, z = t.start(), t.start(), t.start()
    assert t.due(7, 2, 1) == [x]  # three due by 7, one batch left: the first of them
    assert t.due(6, 2, 1) == [x]  # due by 7 and two takes left (6, 7): one now
    assert t.due(5, 2, 1) == [x]  # three takes (5, 6, 7) for three: one now
    buffered(t, y)
    assert t.due(7, 2, 1) == []  # y (handed over) meets the count
    assert t.due(7, 2, 2) == [x]
    assert z == x + 2


def simulate(seed: int, max_staleness: int, batch: int, wait_for_due: bool):
    """A long-tailed engine under Slots, takes at versions 0..59: groups finish after 1 tick
    (most) or 6-20 (some); between takes the trainer trains for 0-4 ticks. With `wait_for_due`
    a take first waits for `due` and serves the oldest buffered groups; without, it serves in
    the order they finished (the old rule). Returns (served staleness, (stale, all) lengths)."""
    rng = random.Random(seed)
    s = slots(n=2, max_inflight=12, max_ahead=max(max_staleness, 1) * batch)
    remaining: dict[int, int] = {}
    length: dict[int, int] = {}
    finished: list[int] = []  # buffered, in the order they finished

    def tick() -> None:
        while s.may_start():
            key = s.start()
            remaining[key] = length[key] = 1 if rng.random() < 0.7 else rng.randint(6, 20)
        for key in [k for k in remaining if s.phase(k) is Phase.GENERATING]:
            remaining[key] -= 1
            if remaining[key] == 0:
                buffered(s, key)
                finished.append(key)

    served, stale_lengths = [], []
    for version in range(60):
        s.see_version(version)
        while wait_for_due and s.due(version, max_staleness, batch):
            tick()
        while True:  # the buffer's take: drop what is stale, wait for a batch
            for key in [k for k in finished if version - s.start_version(k) > max_staleness]:
                finished.remove(key)
                stale_lengths.append(length[key])
                s.forget(key)
            if len(finished) >= batch:
                break
            tick()
        order = sorted(finished, key=lambda k: (s.start_version(k), k))
        for key in (order if wait_for_due else finished)[:batch]:
            served.append(version - s.start_version(key))
            finished.remove(key)
            s.forget(key)
        for _ in range(rng.randint(0, 4)):
            tick()
    return served, (stale_lengths, list(length.values()))


@pytest.mark.parametrize("max_staleness", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_no_group_goes_stale_when_takes_wait_for_due_groups(max_staleness, batch) -> None:
    """The rule's promise on a long-tailed engine: every group is served within max_staleness,
    none is dropped; the old rule (serve what finished first, wait for nothing) drops groups,
    and the ones it drops are the long ones."""
    dropped = []
    for seed in range(3):
        served, (stale, _) = simulate(seed, max_staleness, batch, wait_for_due=True)
        assert stale == [] and max(served) <= max_staleness
        assert len(served) == 60 * batch
        served, (stale, _) = simulate(seed, max_staleness, batch, wait_for_due=False)
        assert max(served) <= max_staleness
        dropped += stale
    if max_staleness == 1:  # one batch ahead at most: every take serves all that was drawn
        assert dropped == []
    else:
        assert len(dropped) >= 10 and min(dropped) >= 6  # only long groups went stale
