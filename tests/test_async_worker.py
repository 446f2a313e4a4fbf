"""The fully async rollout worker: in-flight accounting under both replacement rules, throttling
by the buffer, failures, stop, the background thread, and its config."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from pydantic import ValidationError

from verst.loop import only_scored
from verst.rollout.async_config import AsyncConfig
from verst.rollout.async_worker import RolloutWorker, RolloutWorkerError
from verst.rollout.buffer import DataBuffer
from verst.rollout.ledger import DROPPED, RETRIED, Ledger, read_ledger
from verst.rollout.worker_build import build_rollout_worker
from verst.types import Group, Sample, Status


class FakeSource:
    """Prompts p0, p1, ... (given-back ones first, with their retry counts), groups of `n`
    fresh Samples; prompt pK has prompt_id K, all of epoch 0."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.counter = 0  # groups served (their group_index)
        self.fresh = 0  # prompts served for the first time
        self.returned: list[tuple[str, int]] = []
        self.given_back: list[str] = []

    def take(self, n_prompts: int) -> list[Group]:
        groups = []
        for _ in range(n_prompts):
            if self.returned:
                prompt, retries = self.returned.pop(0)
            else:
                prompt, retries = f"p{self.fresh}", 0
                self.fresh += 1
            gi = self.counter
            self.counter += 1
            identity = {"prompt_id": int(prompt[1:]), "epoch": 0, "retries": retries}
            groups.append(
                [
                    Sample(
                        prompt=prompt,
                        label="ok",
                        tokens=[1, 2],
                        group_index=gi,
                        index=i,
                        **identity,
                    )
                    for i in range(self.n)
                ]
            )
        return groups

    def give_back(self, groups: list[Group]) -> None:
        for g in groups:
            self.given_back.append(g[0].prompt)
            self.returned.append((g[0].prompt, g[0].retries))


class FakeEngine:
    """generate_sample that waits until the test releases (group_index, index), or sleeps.

    Tracks how many generations run at once, and stamps the current weight version.
    """

    def __init__(self, *, manual: bool = True, delay=None) -> None:
        self.manual = manual
        self.delay = delay
        self.version = 0
        self.running = 0
        self.peak = 0
        self.started: list[tuple[int, int]] = []
        self.cancelled = 0
        self.gates: dict[tuple[int, int], asyncio.Event] = {}
        self.fail: set[tuple[int, int]] = set()

    def gate(self, key: tuple[int, int]) -> asyncio.Event:
        return self.gates.setdefault(key, asyncio.Event())

    def release(self, *keys: tuple[int, int]) -> None:
        for key in keys:
            self.gate(key).set()

    async def __call__(self, sample: Sample) -> Sample:
        key = (sample.group_index, sample.index)
        self.started.append(key)
        self.running += 1
        self.peak = max(self.peak, self.running)
        version = self.version
        try:
            if self.manual:
                await self.gate(key).wait()
            else:
                await asyncio.sleep(self.delay(key) if self.delay else 0)
            if key in self.fail:
                raise ConnectionError(f"engine lost {key}")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        sample.tokens = sample.prompt_tokens + [7, 8]
        sample.response_length = 2
        sample.loss_mask = [1, 1]
        sample.rollout_logprobs = [-0.5, -0.5]
        sample.status = Status.COMPLETED
        sample.weight_versions = [version]
        sample.metadata["response_text"] = "ok" if key[1] else "no"
        return sample


def reward(sample: Sample) -> float:
    return float(sample.metadata["response_text"] == sample.label)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def started_groups(engine: FakeEngine) -> set[int]:
    return {g for g, _ in engine.started}


def test_sample_replacement_frees_places_per_trajectory() -> None:
    async def main() -> None:
        source, engine = FakeSource(2), FakeEngine()
        buffer = DataBuffer(8)
        worker = RolloutWorker(
            source, buffer, engine, reward, n_samples_per_prompt=2, max_inflight=4
        )
        async with worker:
            await settle()
            assert started_groups(engine) == {0, 1} and worker.inflight == 4
            engine.release((0, 0))
            await settle()
            # one place free, a group needs two: nothing new
            assert started_groups(engine) == {0, 1} and worker.inflight == 3
            engine.release((1, 1))
            await settle()
            # two places free (from two different unfinished groups): group 2 starts
            assert started_groups(engine) == {0, 1, 2} and worker.inflight == 4
            engine.release((0, 1))
            await settle()
            assert started_groups(engine) == {0, 1, 2} and worker.inflight == 3
            assert len(buffer) == 1  # group 0 is done, scored and buffered
            engine.release((2, 0), (2, 1))
            await settle()
            assert started_groups(engine) == {0, 1, 2, 3}
            assert engine.peak == 4 and worker.metrics()["rollout/inflight_peak"] == 4
            [g0, g2] = await worker.take(2, current_version=0)
            assert [s.reward for s in g0] == [0.0, 1.0] and g0[0].weight_versions == [0]
            assert g2[0].group_index == 2

    run(main())


def test_group_replacement_waits_for_whole_groups() -> None:
    async def main() -> None:
        source, engine = FakeSource(2), FakeEngine()
        buffer = DataBuffer(8)
        worker = RolloutWorker(
            source,
            buffer,
            engine,
            reward,
            n_samples_per_prompt=2,
            max_inflight=5,  # room for two groups; the odd place is never used
            replacement="group",
        )
        async with worker:
            await settle()
            assert started_groups(engine) == {0, 1} and worker.occupied == 4
            engine.release((0, 0), (1, 1))
            await settle()
            # two trajectories done, but no group is: their places stay held
            assert started_groups(engine) == {0, 1}
            assert worker.inflight == 2 and worker.occupied == 4
            engine.release((1, 0))
            await settle()
            assert started_groups(engine) == {0, 1, 2} and worker.occupied == 4
            assert engine.peak == 4
            assert len(buffer) == 1 and buffer._waiting[0][0].group_index == 1

    run(main())


@pytest.mark.parametrize("replacement", ["sample", "group"])
def test_max_inflight_never_exceeded_with_long_tailed_generations(replacement) -> None:
    rng = random.Random(0)
    delays = {}

    def delay(key):
        # mostly short, sometimes ten times longer
        return delays.setdefault(key, 0.02 if rng.random() < 0.15 else 0.002)

    async def main() -> None:
        source, engine = FakeSource(4), FakeEngine(manual=False, delay=delay)
        buffer = DataBuffer(6)
        worker = RolloutWorker(
            source,
            buffer,
            engine,
            reward,
            n_samples_per_prompt=4,
            max_inflight=10,
            replacement=replacement,
        )
        peaks = []
        async with worker:
            for step in range(6):
                groups = await worker.take(3, current_version=step)
                assert len(groups) == 3 and all(len(g) == 4 for g in groups)
                assert all(s.reward is not None for g in groups for s in g)
                engine.version = step + 1
                peaks.append(worker.metrics()["rollout/inflight_peak"])
                await asyncio.sleep(0.005)  # "training"
        # two whole groups of 4 fit in 10 places; with `sample`, groups overlap into the rest
        assert engine.peak == max(peaks) <= (8 if replacement == "group" else 10)
        assert engine.running == 0

    run(main())


def test_full_buffer_throttles_generation() -> None:
    async def main() -> None:
        source, engine = FakeSource(1), FakeEngine(manual=False)
        buffer = DataBuffer(2)
        worker = RolloutWorker(
            source, buffer, engine, reward, n_samples_per_prompt=1, max_inflight=3
        )
        async with worker:
            await asyncio.sleep(0.05)
            # 2 in the buffer, 1 blocked at put, and nothing else started
            assert len(buffer) == 2 and worker.groups_started == 3
            m = worker.metrics()
            assert m["rollout/put_blocked"] == 1 and m["rollout/inflight"] == 0
            assert m["rollout/inflight_groups"] == 1
            await worker.take(1, 0)
            await asyncio.sleep(0.05)
            # the blocked group went in, filling the buffer again; nothing was blocked then, so
            # one more wave of max_inflight trajectories started, finished, and now waits
            assert len(buffer) == 2 and worker.groups_started == 6
            assert worker.metrics()["rollout/inflight_groups"] == 3
            await asyncio.sleep(0.05)
            assert worker.groups_started == 6

    run(main())


def test_a_generation_error_aborts_its_sample_and_its_group_keeps_the_others() -> None:
    """The synchronous loop's rule: a group with `min_scored_samples` samples neither ABORTED
    nor FAILED goes to the buffer whole (the trainer leaves the aborted one out); with fewer,
    its prompt is served again (`too few scored samples`)."""

    async def main(min_scored: int) -> tuple[list[Group], dict, list[str]]:
        source, engine = FakeSource(2), FakeEngine(manual=False)
        engine.fail = {(0, 1)}
        buffer = DataBuffer(4, give_back=source.give_back)
        worker = RolloutWorker(
            source,
            buffer,
            engine,
            reward,
            n_samples_per_prompt=2,
            max_inflight=2,
            min_scored_samples=min_scored,
            give_back=source.give_back,
        )
        async with worker:
            groups = await worker.take(2, current_version=0)
            return groups, worker.metrics(), source.given_back

    groups, m, given_back = run(main(1))
    assert [(g[0].prompt, g[0].group_index) for g in groups] == [("p0", 0), ("p1", 1)]
    assert [s.status for s in groups[0]] == [Status.COMPLETED, Status.ABORTED]
    assert groups[0][0].reward is not None and groups[0][1].reward is None
    assert only_scored(groups) == [groups[0][:1], groups[1]]
    assert m["buffer/dropped_aborted"] == 0 and m["rollout/generate_errors"] == 1
    assert "p0" not in given_back  # (stop gives back the prompts still in flight)

    groups, m, given_back = run(main(2))
    # p0's group was set aside before the buffer and its prompt served again, as group 1
    assert [(g[0].prompt, g[0].group_index) for g in groups] == [("p0", 1), ("p1", 2)]
    assert m["buffer/dropped_aborted"] == 0 and m["rollout/generate_errors"] == 1
    assert given_back[0] == "p0"


def test_aborted_sample_keeps_the_prompt_side_and_the_reason() -> None:
    seen = []

    class Recording(DataBuffer):
        async def put(self, group):
            seen.append(group)
            await super().put(group)

    async def main() -> None:
        source, engine = FakeSource(2), FakeEngine(manual=False)
        engine.fail = {(0, 0)}

        async def generate(sample):
            sample.tokens.append(99)  # half-done in place when it fails
            return await engine(sample)

        worker = RolloutWorker(
            source, Recording(4), generate, reward, n_samples_per_prompt=2, max_inflight=2
        )
        async with worker:
            await worker.take(1, 0)
        bad = seen[0][0]
        assert bad.status == Status.ABORTED and bad.tokens == [1, 2]
        assert bad.response_length == 0 and bad.reward is None  # aborted samples are not scored
        assert bad.metadata["abort_error"] == "ConnectionError: engine lost (0, 0)"

    run(main())


def test_consecutive_generation_failures_stop_the_worker() -> None:
    async def main() -> None:
        source = FakeSource(2)

        async def broken(sample):
            raise ConnectionRefusedError("router down")

        worker = RolloutWorker(
            source, DataBuffer(4), broken, reward, n_samples_per_prompt=2, max_inflight=4
        )
        await worker.start()
        with pytest.raises(RolloutWorkerError, match="8 generations failed in a row") as info:
            await worker.take(1, 0)
        assert isinstance(info.value.__cause__.__cause__, ConnectionRefusedError)
        await worker.stop()  # already reported: no second raise

    run(main())


def test_worker_bugs_surface_to_the_caller() -> None:
    class BadSource(FakeSource):
        def take(self, n_prompts):
            if self.counter == 3:
                raise KeyError("no more rows")
            return super().take(n_prompts)

    class BadBuffer(DataBuffer):
        async def put(self, group):
            raise RuntimeError("disk full")

    async def main() -> None:
        engine = FakeEngine(manual=False)
        worker = RolloutWorker(
            BadSource(1), DataBuffer(8), engine, reward, n_samples_per_prompt=1, max_inflight=2
        )
        await worker.start()
        with pytest.raises(RolloutWorkerError) as info:
            await worker.take(5, 0)
        assert isinstance(info.value.__cause__, KeyError)
        await worker.stop()

        # a failure nobody took: stop reports it
        worker = RolloutWorker(
            FakeSource(1), BadBuffer(8), engine, reward, n_samples_per_prompt=1, max_inflight=1
        )
        await worker.start()
        await asyncio.sleep(0.02)
        with pytest.raises(RolloutWorkerError, match="disk full"):
            await worker.stop()

    run(main())


@pytest.mark.parametrize("retry", [False, True])
def test_stop_aborts_in_flight_groups_and_returns_prompts(retry) -> None:
    async def main() -> None:
        source, engine = FakeSource(2), FakeEngine()
        buffer = DataBuffer(1)
        worker = RolloutWorker(
            source,
            buffer,
            engine,
            reward,
            n_samples_per_prompt=2,
            max_inflight=4,
            give_back=source.give_back if retry else None,
        )
        await worker.start()
        await settle()
        engine.release((0, 0), (0, 1))
        await settle()
        assert len(buffer) == 1 and started_groups(engine) == {0, 1, 2}
        engine.release((1, 0), (1, 1))
        await settle()
        # the buffer is full: group 1 waits at put, so no group starts in the free places
        assert worker.metrics()["rollout/put_blocked"] == 1
        assert started_groups(engine) == {0, 1, 2} and worker.inflight == 2
        engine.release((2, 0))
        await settle()
        # group 0 buffered, group 1 blocked at put, group 2 half-generated
        live = list(worker._flights.values())
        await worker.stop()
        assert engine.cancelled == 1 and engine.running == 0
        assert worker.aborted_on_stop == 2
        assert [s.status for f in live for s in f.group] == [
            Status.COMPLETED,
            Status.COMPLETED,
            Status.COMPLETED,
            Status.ABORTED,
        ]
        assert source.given_back == (["p1", "p2"] if retry else [])
        assert len(buffer) == 1  # what the buffer holds is untouched
        await worker.stop()  # idempotent
        with pytest.raises(RuntimeError, match="not running"):
            await worker.take(1, 0)

    run(main())


@pytest.mark.parametrize("unused", ["drop", "retry"])
def test_unconsumed_prompts_are_the_ones_not_served_nor_dropped(unused) -> None:
    """What a checkpoint saves for a resumed run to serve again: prompts generating or waiting
    in the buffer, not those a take served, nor those set aside (too few scored samples) or
    dropped (filtered)."""

    def prompts(groups: list[Group]) -> list[str]:
        return sorted(g[0].prompt for g in groups)

    ledger = Ledger(None)

    async def main() -> None:
        source, engine = FakeSource(2), FakeEngine()
        cfg = AsyncConfig(max_inflight=6, buffer_factor=4.0, unused=unused)
        # filter: a group whose first sample said "no" is rejected (all of them, here) unless
        # its prompt is p0 or p3
        worker = build_rollout_worker(
            cfg,
            source,
            engine,
            reward,
            prompts_per_step=1,
            n_samples_per_prompt=2,
            group_filter=lambda g: None if g[0].prompt in ("p0", "p3") else "filtered",
            ledger=ledger,
            min_scored_samples=2,
        )
        engine.fail.add((2, 1))  # p2's second sample aborts: one scored sample is too few
        await worker.start()
        await settle()
        assert prompts(worker.unconsumed_prompts()) == ["p0", "p1", "p2"]  # all generating
        engine.release((0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1))
        await settle()
        # p0 waits in the buffer, p1 was filtered out, p2 set aside (and, with retry, given back
        # to the source, which serves it again next); three more groups started
        started = ["p2", "p3", "p4"] if unused == "retry" else ["p3", "p4", "p5"]
        assert prompts(worker.unconsumed_prompts()) == ["p0", *started]
        assert source.given_back == (["p2"] if unused == "retry" else [])
        assert ledger.take_counts()["rollout/groups_retried"] == (unused == "retry")
        served = await worker.take(1, 0)
        assert prompts(served) == ["p0"]
        assert prompts(worker.unconsumed_prompts()) == started
        await worker.stop()

    run(main())


def test_groups_with_too_few_scored_samples_go_back_until_their_retries_run_out(
    tmp_path,
) -> None:
    """p0's reward always fails, p1's hangs past the timeout on one sample, p2's fails on one
    sample: with min_scored_samples=2, p0 and p1 never enter the buffer (p0 is retried twice,
    then dropped), and the ledger says so; with 1, p2 would be trained on its scored sample."""

    async def flaky(sample: Sample) -> float:
        if sample.prompt == "p0" or (sample.prompt == "p2" and sample.index == 0):
            raise ValueError("unreadable")
        if sample.prompt == "p1" and sample.index == 1:
            await asyncio.sleep(5)
        return reward(sample)

    async def main(min_scored: int, ledger: Ledger) -> tuple[list[Group], dict]:
        source, engine = FakeSource(2), FakeEngine(manual=False)
        cfg = AsyncConfig(max_inflight=2, buffer_factor=2.0)
        worker = build_rollout_worker(
            cfg,
            source,
            engine,
            flaky,
            prompts_per_step=2,
            n_samples_per_prompt=2,
            ledger=ledger,
            reward_timeout_s=0.1,
            min_scored_samples=min_scored,
            max_prompt_retries=2,
        )
        async with worker:
            taken = await worker.take(2, 0) + await worker.take(2, 0)
            return taken, worker.metrics()

    ledger = Ledger(tmp_path / "prompts.jsonl")
    taken, metrics = run(main(2, ledger))
    assert sorted(g[0].prompt for g in taken) == ["p3", "p4", "p5", "p6"]
    fates = [(x["prompt_id"], x["outcome"], x["reason"]) for x in read_ledger(ledger.path)]
    few = "too few scored samples"
    assert [f for f in fates if f[0] == 0] == [
        (0, RETRIED, few),
        (0, RETRIED, few),
        (0, DROPPED, f"retries exhausted ({few})"),
    ]
    assert [f[1] for f in fates if f[0] == 1] == [RETRIED, RETRIED, DROPPED]
    assert [f[1] for f in fates if f[0] == 2] == [RETRIED, RETRIED, DROPPED]
    # p0: 2 samples × 3 serves; p1 and p2: 1 sample × 3 serves each
    assert metrics["rollout/reward_errors"] == 12
    counts = ledger.take_counts()
    assert counts["rollout/too_few_scored_groups"] == 9 and counts["rollout/retries_exhausted"] == 3

    taken, _ = run(main(1, Ledger(None)))
    by_prompt = {g[0].prompt: g for g in taken}
    assert "p0" not in by_prompt and sorted(by_prompt)[:2] == ["p1", "p2"]
    assert [s.status for s in by_prompt["p2"]] == [Status.FAILED, Status.COMPLETED]
    assert by_prompt["p1"][1].metadata["reward_error"] == "reward timed out after 0.1 s"


def test_no_group_starts_that_would_be_stale_before_a_take_reached_it() -> None:
    async def main() -> None:
        source, engine = FakeSource(1), FakeEngine()
        buffer = DataBuffer(8)
        worker = RolloutWorker(
            source, buffer, engine, reward, n_samples_per_prompt=1, max_inflight=8, max_ahead=3
        )
        await worker.start()
        await settle()
        assert started_groups(engine) == {0, 1, 2}  # places for 8, but 3 groups ahead at most
        engine.release((0, 0), (1, 0))
        await settle()
        assert started_groups(engine) == {0, 1, 2} and len(buffer) == 2  # buffered still count
        assert len(await worker.take(1, 0)) == 1
        await settle()
        assert started_groups(engine) == {0, 1, 2, 3}
        await worker.stop()

    run(main())
    assert AsyncConfig(max_staleness=2).ahead_limit(16) == 32
    assert AsyncConfig(max_staleness=0).ahead_limit(16) == 16
    assert AsyncConfig(max_staleness=None).ahead_limit(16) is None


def long_group_worker(wait_for_due: bool) -> tuple[RolloutWorker, FakeEngine]:
    """max_staleness 2, batches of one group, two groups ahead at most: one group a take."""
    source, engine = FakeSource(1), FakeEngine()
    worker = RolloutWorker(
        source,
        DataBuffer(2, max_staleness=2),
        engine,
        reward,
        n_samples_per_prompt=1,
        max_inflight=4,
        max_ahead=2,
        max_staleness=2 if wait_for_due else None,
    )
    return worker, engine


async def take_at_2_while_group_0_generates(worker: RolloutWorker, engine: FakeEngine):
    """Group 0 (long) starts at version 0 and is still generating at the take at 2, its last
    chance; groups 1, 2 and 3 are short and served in turn. Returns the take at 2, started."""
    await settle()
    assert started_groups(engine) == {0, 1}
    for version, short in ((0, 1), (1, 2)):
        engine.version = version
        engine.release((short, 0))
        await settle()
        # at 1, groups 0 and 2 are both due by 2 and two takes remain: the one in hand will do
        [served] = await worker.take(1, version)
        assert served[0].group_index == short
        await settle()  # the next group starts
    engine.version = 2
    engine.release((3, 0))
    await settle()
    return asyncio.ensure_future(worker.take(1, 2))


@pytest.mark.parametrize("wait_for_due", [True, False])
def test_a_long_group_is_waited_for_at_its_last_take_not_dropped(wait_for_due) -> None:
    """The take at 2 waits for group 0 (started at 0) and serves it at staleness 2. Without the
    due wait (the old rule), it serves the short group 3, and group 0 arrives stale."""

    async def main() -> None:
        worker, engine = long_group_worker(wait_for_due)
        async with worker:
            taking = await take_at_2_while_group_0_generates(worker, engine)
            await asyncio.sleep(0.02)
            if wait_for_due:
                assert not taking.done()
                engine.release((0, 0))
                [served] = await asyncio.wait_for(taking, 1)
                assert served[0].group_index == 0 and served[0].weight_versions == [0]
                m = worker.metrics()
                assert m["buffer/due_groups"] == 1 and m["buffer/due_wait_s"] >= 0.02
                assert m["buffer/staleness_max"] == 2 and m["buffer/dropped_stale"] == 0
                return
            [served] = await asyncio.wait_for(taking, 1)
            assert served[0].group_index == 3
            engine.release((0, 0), (4, 0))
            await settle()
            [served] = await worker.take(1, 3)
            m = worker.metrics()
            assert served[0].group_index == 4 and m["buffer/dropped_stale"] == 1
            assert m["buffer/due_groups"] == 0 and m["buffer/dropped_stale_response_len_mean"] > 0

    run(main())


def test_a_take_waiting_for_a_due_group_can_be_cancelled_or_stopped() -> None:
    async def main() -> None:
        worker, engine = long_group_worker(True)
        await worker.start()
        taking = await take_at_2_while_group_0_generates(worker, engine)
        await settle()
        taking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taking
        again = asyncio.ensure_future(worker.take(1, 2))  # a cancelled take changed nothing
        await settle()
        assert not again.done() and len(worker.buffer) == 1
        await asyncio.wait_for(worker.stop(), 1)
        with pytest.raises(RolloutWorkerError, match="stopped"):
            await asyncio.wait_for(again, 1)
        assert engine.cancelled == 1  # group 0 (group 3 is buffered: two ahead, none more)

    run(main())


def test_stop_is_prompt_even_while_the_trainer_waits() -> None:
    async def main() -> None:
        source, engine = FakeSource(1), FakeEngine()
        worker = RolloutWorker(
            source, DataBuffer(2), engine, reward, n_samples_per_prompt=1, max_inflight=2
        )
        await worker.start()
        waiting = asyncio.ensure_future(worker.take(1, 0))
        await settle()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(worker.stop(), 1)
        assert engine.cancelled == 2

    run(main())


def test_inflight_mean_is_time_weighted() -> None:
    async def main() -> None:
        source, engine = FakeSource(2), FakeEngine()
        worker = RolloutWorker(
            source, DataBuffer(8), engine, None, n_samples_per_prompt=2, max_inflight=2
        )
        async with worker:
            await settle()
            worker.metrics()  # start a window with 2 generating
            await asyncio.sleep(0.05)
            engine.release((0, 0))
            await asyncio.sleep(0.05)
            m = worker.metrics()
            assert m["rollout/inflight"] == 1 and m["rollout/inflight_peak"] == 2
            assert 1.2 < m["rollout/inflight_mean"] < 1.8
            assert m["rollout/max_inflight"] == 2 and m["rollout/groups_started"] == 1
            assert "buffer/queue_size" in m

    run(main())


def test_loop_cpu_counts_the_loop_threads_work_not_its_waits() -> None:
    engine = FakeEngine(manual=False)

    async def busy(sample: Sample) -> Sample:
        ends = time.thread_time() + 0.05  # 50 ms of this thread's CPU per trajectory
        while time.thread_time() < ends:
            pass
        return await engine(sample)

    async def main() -> None:
        worker = RolloutWorker(
            FakeSource(2), DataBuffer(8), busy, None, n_samples_per_prompt=2, max_inflight=2
        )
        async with worker:
            await worker.take(2, 0)
            busy_cpu = worker.metrics()["rollout/loop_cpu_s"]
            time.sleep(0.1)  # the thread waits: no CPU
            idle_cpu = worker.metrics()["rollout/loop_cpu_s"]
        assert 0.2 <= busy_cpu < 2.0  # 4 trajectories of 50 ms
        assert idle_cpu < 0.05

    run(main())


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="must be at least n_samples_per_prompt"):
        RolloutWorker(
            FakeSource(4), DataBuffer(2), FakeEngine(), None, n_samples_per_prompt=4, max_inflight=3
        )
    with pytest.raises(ValueError, match="'group' or 'sample'"):
        RolloutWorker(
            FakeSource(1),
            DataBuffer(2),
            FakeEngine(),
            None,
            n_samples_per_prompt=1,
            max_inflight=3,
            replacement="trajectory",
        )
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        RolloutWorker(
            FakeSource(1),
            DataBuffer(2),
            FakeEngine(),
            None,
            n_samples_per_prompt=1,
            max_inflight=3,
            max_staleness=-1,
        )
    with pytest.raises(ValueError, match="max_ahead must be >= 1"):
        RolloutWorker(
            FakeSource(1),
            DataBuffer(2),
            FakeEngine(),
            None,
            n_samples_per_prompt=1,
            max_inflight=3,
            max_ahead=0,
        )


def test_async_config() -> None:
    cfg = AsyncConfig()
    assert cfg.replacement == "sample" and cfg.unused == "retry"
    assert cfg.buffer == "verst.rollout.buffer:DataBuffer"
    assert cfg.inflight_limit(16, 8) == 128 and cfg.buffer_capacity(16) == 32
    assert AsyncConfig(buffer_factor=1.5).buffer_capacity(3) == 5
    assert AsyncConfig(buffer_factor=1.0).buffer_capacity(3) == 3
    assert AsyncConfig(max_inflight=10).inflight_limit(16, 8) == 10
    assert cfg.wait_for_due and cfg.max_staleness == 4
    worker = build_rollout_worker(
        cfg, FakeSource(1), FakeEngine(), reward, prompts_per_step=2, n_samples_per_prompt=1
    )
    assert worker.max_staleness == 4
    off = AsyncConfig(wait_for_due=False)
    worker = build_rollout_worker(
        off, FakeSource(1), FakeEngine(), reward, prompts_per_step=2, n_samples_per_prompt=1
    )
    assert worker.max_staleness is None and worker.buffer.max_staleness == 4
    for name, info in AsyncConfig.model_fields.items():
        assert info.description, name
    with pytest.raises(ValidationError, match="module 'nope' not found"):
        AsyncConfig(buffer="nope:Buffer")
    with pytest.raises(ValidationError):
        AsyncConfig(buffer_factor=0.5)
    with pytest.raises(ValidationError):
        AsyncConfig(replacement="trajectory")
    AsyncConfig(buffer="examples.custom_buffer:FreshestFirstBuffer", max_staleness=None)


def test_slot_counts_agree_with_the_groups_the_worker_holds(tmp_path) -> None:
    """With set-asides before put (an aborted sample leaves too few scored), drops at put
    (filtered), stale drops at take and long tails, the slot
    accounting stays consistent and counts as ahead exactly the prompts a checkpoint saves;
    the ledger gets every drop with its reason."""
    rng = random.Random(1)
    ledger = Ledger(tmp_path / "prompts.jsonl")

    def delay(key):
        return 0.01 if rng.random() < 0.2 else 0.001

    async def main() -> None:
        source, engine = FakeSource(2), FakeEngine(manual=False, delay=delay)
        engine.fail = {(g, 1) for g in range(0, 200, 7)}
        cfg = AsyncConfig(max_inflight=5, buffer_factor=1.5, max_staleness=1)
        worker = build_rollout_worker(
            cfg,
            source,
            engine,
            reward,
            prompts_per_step=2,
            n_samples_per_prompt=2,
            group_filter=lambda g: None if g[0].group_index % 5 != 0 else "filtered",
            ledger=ledger,
            min_scored_samples=2,
        )
        seen = 0

        async def watch() -> None:
            nonlocal seen
            while True:
                worker._slots.check()
                assert len(worker.unconsumed_prompts()) == worker._slots.ahead
                seen += 1
                await asyncio.sleep(0)

        async with worker:
            watcher = asyncio.ensure_future(watch())
            for version in [0, 1, 2, 5, 6, 7]:  # the jump leaves the buffered groups stale
                engine.version = version
                await worker.take(2, current_version=version)
                await asyncio.sleep(0.003)
            watcher.cancel()
        m = worker.metrics()
        assert m["rollout/generate_errors"] >= 1 and m["buffer/dropped_filtered"] >= 1
        assert m["buffer/dropped_stale"] >= 1 and seen > 50
        fates = {(x["outcome"], x["reason"]) for x in read_ledger(ledger.path)}
        few = "too few scored samples"
        assert fates == {(RETRIED, few), (RETRIED, "stale"), (DROPPED, "filter: filtered")}
        worker._slots.check()
        assert worker.inflight == 0 and worker.unconsumed_prompts() == []

    run(main())


def test_a_generation_cancelled_by_something_else_than_stop_fails_the_worker() -> None:
    async def main() -> None:
        async def cancelled(sample):
            raise asyncio.CancelledError

        worker = RolloutWorker(
            FakeSource(1), DataBuffer(2), cancelled, None, n_samples_per_prompt=1, max_inflight=1
        )
        await worker.start()
        with pytest.raises(RolloutWorkerError, match="a group's generation was cancelled"):
            await worker.take(1, 0)
        await worker.stop()
        assert worker.aborted_on_stop == 1 and worker.occupied == 0

    run(main())
