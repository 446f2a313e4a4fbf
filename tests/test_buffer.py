"""The data buffer: bound and blocking, each drop rule at its point, retry, metrics, plug-ins."""

from __future__ import annotations

import asyncio

import pytest

from verst.data import DataSource, DataSourceConfig
from verst.models import build_char_tokenizer
from verst.plugin_loader import PluginError
from verst.rollout.buffer import (
    DEFAULT_BUFFER,
    Buffer,
    DataBuffer,
    Lengths,
    load_buffer_class,
    make_buffer,
)
from verst.rollout.dynamic import has_reward_variance
from verst.types import Group, Sample, Status


def group(*versions: int | list[int], status: Status = Status.COMPLETED, tag: str = "") -> Group:
    """One sample per entry; an int is that sample's single weight version, a list its turns'."""
    return [
        Sample(
            prompt=tag,
            weight_versions=[v] if isinstance(v, int) else list(v),
            status=status,
            reward=float(i),
            index=i,
        )
        for i, v in enumerate(versions)
    ]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Recorder:
    def __init__(self) -> None:
        self.groups: list[Group] = []

    def __call__(self, groups: list[Group]) -> None:
        self.groups += groups


def test_put_blocks_while_full_and_take_frees_room() -> None:
    async def main() -> None:
        buffer = DataBuffer(2)
        await buffer.put(group(0, tag="a"))
        await buffer.put(group(0, tag="b"))
        third = asyncio.ensure_future(buffer.put(group(0, tag="c")))
        await asyncio.sleep(0.02)
        assert not third.done() and len(buffer) == 2
        taken = await buffer.take(1, current_version=0)
        assert [g[0].prompt for g in taken] == ["a"]
        await asyncio.wait_for(third, 1)
        assert len(buffer) == 2
        assert [g[0].prompt for g in await buffer.take(2, 0)] == ["b", "c"]

    run(main())


def test_take_waits_for_enough_groups() -> None:
    async def main() -> None:
        buffer = DataBuffer(4)
        await buffer.put(group(0, tag="a"))
        taking = asyncio.ensure_future(buffer.take(2, 0))
        await asyncio.sleep(0.02)
        assert not taking.done()
        await buffer.put(group(0, tag="b"))
        assert [g[0].prompt for g in await asyncio.wait_for(taking, 1)] == ["a", "b"]
        assert buffer.metrics()["buffer/take_wait_s"] > 0.01
        with pytest.raises(ValueError, match="capacity 4"):
            await buffer.take(5, 0)

    run(main())


@pytest.mark.parametrize("retry", [False, True])
def test_groups_with_no_sample_to_train_dropped_at_put(retry: bool) -> None:
    async def main() -> None:
        back = Recorder()
        buffer = DataBuffer(3, give_back=back if retry else None)
        aborted = group(0, 0)
        aborted[0].status = Status.ABORTED
        aborted[1].status = Status.FAILED
        await buffer.put(aborted)
        # one sample aborted, one FAILED (a reward error): the others are trained, the group
        # is kept (the worker sets aside those with too few before they reach the buffer)
        partly = group(0, 0)
        partly[1].status = Status.ABORTED
        await buffer.put(partly)
        failed = group(0, 0, status=Status.FAILED)
        await buffer.put(failed)
        assert len(buffer) == 1 and buffer._waiting == [partly]
        assert buffer.metrics()["buffer/dropped_aborted"] == 2
        assert back.groups == ([aborted, failed] if retry else [])

    run(main())


def test_filter_rejected_at_put_never_recycled() -> None:
    async def main() -> None:
        back = Recorder()
        buffer = DataBuffer(2, give_back=back, group_filter=has_reward_variance)
        flat = group(0, 0)
        for s in flat:
            s.reward = 1.0
        await buffer.put(flat)
        await buffer.put(group(0, 0))  # rewards 0.0 and 1.0: informative
        assert len(buffer) == 1
        m = buffer.metrics()
        assert m["buffer/dropped_filtered"] == 1 and m["buffer/dropped_aborted"] == 0
        assert back.groups == []  # rejected prompts are not given back, even with retry
        # a rejected group takes no room: a full buffer does not block it
        await buffer.put(group(0, 0))
        await asyncio.wait_for(buffer.put(flat), 0.5)
        assert buffer.metrics()["buffer/dropped_filtered"] == 2

    run(main())


def test_stale_groups_dropped_at_take_pessimistically() -> None:
    async def main() -> None:
        back = Recorder()
        buffer = DataBuffer(4, max_staleness=1, give_back=back)
        # the second sample's first turn came from version 1: the group counts as version 1,
        # even though most of it is from version 3
        mixed = group(3, [1, 3], 3, tag="mixed")
        await buffer.put(mixed)
        await buffer.put(group(2, 3, tag="fresh"))
        assert len(buffer) == 2  # staleness is not judged at put
        taken = await buffer.take(1, current_version=3)
        assert [g[0].prompt for g in taken] == ["fresh"]
        assert back.groups == [mixed]
        m = buffer.metrics()
        assert m["buffer/dropped_stale"] == 1
        assert m["buffer/staleness_max"] == 1 and m["buffer/staleness_mean"] == 1

    run(main())


def test_oldest_group_served_first_so_a_long_one_is_not_dropped() -> None:
    """A long group started at version 0 finishes after two short ones from version 2: FIFO
    by completion served the short ones first and dropped the long one at version 3; the
    default order serves it at version 2, its last chance (staleness 2, the bound)."""

    async def main() -> None:
        back = Recorder()
        buffer = DataBuffer(4, max_staleness=2, give_back=back)
        await buffer.put(group(2, tag="short1"))
        await buffer.put(group(2, tag="short2"))
        await buffer.put(group(0, [0, 1, 2], tag="long"))
        assert [g[0].prompt for g in await buffer.take(1, current_version=2)] == ["long"]
        assert buffer.metrics()["buffer/staleness_max"] == 2
        # then put order among equal versions; unknown versions last
        await buffer.put([Sample(prompt="unknown", status=Status.COMPLETED)])
        await buffer.put(group(1, tag="v1"))
        taken = await buffer.take(3, current_version=3)
        assert [g[0].prompt for g in taken] == ["v1", "short1", "short2"]
        assert back.groups == [] and buffer.metrics()["buffer/dropped_stale"] == 0

    run(main())


def test_a_take_serves_a_group_blocked_at_put() -> None:
    """A group that finished once the buffer was full is not hidden from a take: the oldest is
    served from its blocked put (which returns), stale ones there are dropped, and a blocked
    put cancelled adds nothing."""

    async def main() -> None:
        back = Recorder()
        buffer = DataBuffer(2, max_staleness=2, give_back=back)
        await buffer.put(group(2, tag="a"))
        await buffer.put(group(2, tag="b"))
        late = asyncio.ensure_future(buffer.put(group(0, tag="long")))
        stale = asyncio.ensure_future(buffer.put(group(-1, tag="stale")))
        cancelled = asyncio.ensure_future(buffer.put(group(2, tag="cancelled")))
        await settle()
        assert not late.done() and len(buffer) == 2
        cancelled.cancel()
        await settle()
        assert [g[0].prompt for g in await buffer.take(1, current_version=2)] == ["long"]
        await asyncio.wait_for(asyncio.gather(late, stale), 1)
        assert [g[0].prompt for g in back.groups] == ["stale"]
        assert cancelled.cancelled() and len(buffer) == 2
        m = buffer.metrics()
        assert m["buffer/put_groups"] == 4 and m["buffer/taken_groups"] == 1
        assert m["buffer/dropped_stale"] == 1
        assert [g[0].prompt for g in await buffer.take(2, current_version=2)] == ["a", "b"]

    run(main())


def test_lengths_quantiles_closed_form() -> None:
    lengths = Lengths()
    assert lengths.summary() == {
        "mean": 0.0,
        "p50": 0.0,
        "p90": 0.0,
        "max": 0.0,
        "truncated_ratio": 0.0,
        "samples": 0.0,
    }
    for n in range(1, 11):  # 1..10, the two longest truncated
        lengths.add_length(n, truncated=n > 8)
    assert lengths.summary() == {
        "mean": 5.5,
        "p50": 5.0,
        "p90": 9.0,
        "max": 10.0,
        "truncated_ratio": 0.2,
        "samples": 10.0,
    }
    g = group(0, 0, 0)
    g[0].response_length, g[1].response_length, g[2].response_length = 3, 7, 100
    g[1].status, g[2].status = Status.TRUNCATED, Status.ABORTED  # aborted: not counted
    lengths = Lengths()
    lengths.add(g)
    assert lengths.summary()["p50"] == 3 and lengths.summary()["truncated_ratio"] == 0.5


def test_generated_and_dropped_stale_lengths_are_counted() -> None:
    """What the engines generated, beside what the stale rule dropped: a length bias shows."""

    def lengths(g: Group, n: int) -> Group:
        for sample in g:
            sample.response_length = n
        return g

    async def main() -> None:
        buffer = DataBuffer(4, max_staleness=1)
        await buffer.put(lengths(group(1, 1), 30))  # long: goes stale
        await buffer.put(lengths(group(3, 3), 10))
        await buffer.put(lengths(group(3, 3, status=Status.ABORTED), 99))  # not generated
        await buffer.take(1, current_version=3)
        m = buffer.metrics()
        assert m["buffer/generated_response_len_mean"] == 20.0
        assert m["buffer/generated_response_len_p50"] == 10.0
        assert m["buffer/generated_response_len_p90"] == 30.0
        assert m["buffer/generated_response_len_max"] == 30.0
        assert m["buffer/generated_truncated_ratio"] == 0.0
        assert m["buffer/dropped_stale_response_len_mean"] == 30.0

    run(main())


def test_stale_check_covers_every_waiting_group_and_frees_room() -> None:
    async def main() -> None:
        buffer = DataBuffer(2, max_staleness=0)
        await buffer.put(group(0, tag="old1"))
        await buffer.put(group(0, tag="old2"))
        blocked = asyncio.ensure_future(buffer.put(group(1, tag="new")))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        # both old groups are stale at version 1: dropped; the take serves the blocked group,
        # and its put returns
        taken = await buffer.take(1, current_version=1)
        assert [g[0].prompt for g in taken] == ["new"]
        await asyncio.wait_for(blocked, 1)
        assert len(buffer) == 0
        assert buffer.metrics()["buffer/dropped_stale"] == 2
        # exactly at the limit is kept; unknown versions are never stale
        edge = DataBuffer(2, max_staleness=2)
        await edge.put(group(3))
        await edge.put([Sample(status=Status.COMPLETED)])
        assert len(await edge.take(2, current_version=5)) == 2
        assert edge.metrics()["buffer/dropped_stale"] == 0

    run(main())


def test_no_staleness_limit_keeps_everything() -> None:
    async def main() -> None:
        buffer = DataBuffer(2, max_staleness=None)
        await buffer.put(group(0))
        assert len(await buffer.take(1, current_version=100)) == 1
        assert buffer.metrics()["buffer/staleness_max"] == 100

    run(main())


def test_retry_returns_prompts_to_the_data_source(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "label": "{i}"}}\n' for i in range(5)))
    source = DataSource(
        DataSourceConfig(path=str(path), shuffle=False),
        build_char_tokenizer(),
        n_samples_per_prompt=2,
        seed=0,
    )

    def generated(g: Group, version: int, status: Status = Status.COMPLETED) -> Group:
        for s in g:
            s.tokens = s.tokens + [5, 6]
            s.response_length = 2
            s.weight_versions = [version]
            s.status = status
        return g

    async def main() -> None:
        buffer = DataBuffer(4, max_staleness=0, give_back=source.give_back)
        g0, g1, g2 = source.take(3)
        await buffer.put(generated(g0, 0, Status.ABORTED))  # aborted: back at once
        await buffer.put(generated(g1, 0))  # stale at version 1: back at take
        await buffer.put(generated(g2, 1))
        assert [g[0].prompt for g in await buffer.take(1, current_version=1)] == ["q2"]
        again = source.take(3)
        assert [g[0].prompt for g in again] == ["q0", "q1", "q3"]
        assert again[0][0].label == "0" and again[0][0].response_length == 0
        assert again[0][0].tokens == g0[0].prompt_tokens

    run(main())


def test_metrics_values() -> None:
    async def main() -> None:
        buffer = DataBuffer(6, max_staleness=5)
        m = buffer.metrics()
        assert m["buffer/queue_size"] == 0 and m["buffer/capacity"] == 6
        assert m["buffer/staleness_mean"] == 0 and m["buffer/waiting_staleness_max"] == 0
        for v in (1, 2, 3, 4):
            await buffer.put(group(v, v + 1))
        await buffer.take(2, current_version=4)  # serves versions 1 and 2: staleness 3, 2
        m = buffer.metrics()
        assert m["buffer/queue_size"] == 2
        assert m["buffer/staleness_mean"] == 2.5 and m["buffer/staleness_max"] == 3
        # waiting: versions 3 and 4 at version 4
        assert m["buffer/waiting_staleness_mean"] == 0.5
        assert m["buffer/waiting_staleness_max"] == 1
        assert m["buffer/put_groups"] == 4 and m["buffer/taken_groups"] == 2
        assert m["buffer/dropped_stale"] == 0 and m["buffer/dropped_aborted"] == 0
        assert "buffer/advisory" not in m

    run(main())


def test_advisory_rollout_bound_and_trainer_bound() -> None:
    async def rollout_bound() -> None:
        buffer = DataBuffer(4, advisory_window=3)
        for _ in range(3):
            taking = asyncio.ensure_future(buffer.take(1, 0))
            await settle()
            assert buffer.metrics()["buffer/rollout_bound"] == 0
            await buffer.put(group(0))
            await taking
        m = buffer.metrics()
        assert m["buffer/rollout_bound"] == 1 and m["buffer/trainer_bound"] == 0
        assert m["buffer/advisory"].startswith("rollout-bound")
        # one take that did not wait clears it
        await buffer.put(group(0))
        await buffer.take(1, 0)
        assert buffer.metrics()["buffer/rollout_bound"] == 0

    async def trainer_bound() -> None:
        buffer = DataBuffer(2, advisory_window=3)
        for _ in range(3):
            while len(buffer) < 2:
                await buffer.put(group(0))
            await buffer.take(1, 0)
        m = buffer.metrics()
        assert m["buffer/trainer_bound"] == 1 and m["buffer/rollout_bound"] == 0
        assert m["buffer/advisory"].startswith("trainer-bound")

    run(rollout_bound())
    run(trainer_bound())


def test_cancelled_put_and_take_change_nothing() -> None:
    async def main() -> None:
        buffer = DataBuffer(1)
        await buffer.put(group(0, tag="a"))
        put = asyncio.ensure_future(buffer.put(group(0, tag="b")))
        await settle()
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert len(buffer) == 1
        take = asyncio.ensure_future(DataBuffer(2).take(2, 0))
        await settle()
        take.cancel()
        with pytest.raises(asyncio.CancelledError):
            await take
        assert [g[0].prompt for g in await buffer.take(1, 0)] == ["a"]

    run(main())


def test_custom_buffer_by_import_path() -> None:
    async def main() -> None:
        back = Recorder()
        buffer = make_buffer(
            "examples.custom_buffer:FreshestFirstBuffer",
            capacity=4,
            max_staleness=2,
            give_back=back,
            group_filter=None,
        )
        assert isinstance(buffer, Buffer) and type(buffer).__name__ == "FreshestFirstBuffer"
        for v, tag in ((2, "v2"), (4, "v4"), (0, "v0"), (3, "v3")):
            await buffer.put(group(v, tag=tag))
        taken = await buffer.take(2, current_version=4)
        assert [g[0].prompt for g in taken] == ["v4", "v3"]
        assert [g[0].prompt for g in back.groups] == ["v0"]  # drop rules still apply
        assert buffer.metrics()["buffer/order_freshest_first"] == 1.0

    run(main())
    default = make_buffer(
        DEFAULT_BUFFER, capacity=2, max_staleness=None, give_back=None, group_filter=None
    )
    assert type(default) is DataBuffer
    load_buffer_class("examples.custom_buffer:FreshestFirstBuffer")
    with pytest.raises(ValueError, match="module 'no_such_mod' not found"):
        load_buffer_class("no_such_mod:Buffer")
    with pytest.raises(ValueError, match="lacks put, take, metrics"):
        load_buffer_class("verst.types:Sample")


class NotABuffer:
    def __init__(self, **kwargs) -> None:
        pass

    def put(self, group: Group) -> None:  # not async
        pass

    async def take(self, n_groups: int, current_version: int) -> list[Group]:
        return []

    def metrics(self) -> dict:
        return {}


def test_make_buffer_checks_the_interface() -> None:
    with pytest.raises(PluginError, match="put must be an async method"):
        make_buffer(
            f"{__name__}:NotABuffer",
            capacity=2,
            max_staleness=None,
            give_back=None,
            group_filter=None,
        )
