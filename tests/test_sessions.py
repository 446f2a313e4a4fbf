"""Sessions: assembly of turn records into Samples (masks, log-prob alignment, per-turn weight
versions, truncation on a turn boundary, inconsistent records), and the session server in front
of a real tiny engine on 127.0.0.1 (directly and behind the router): multi-turn conversations
through aiohttp and the official `openai` client, the append-only rule, rollback, errors."""

from __future__ import annotations

import pytest

from verst.sessions.assembly import AssemblyError, TurnRecord, assemble
from verst.types import Status

# ---- assembly --------------------------------------------------------------------------------


def three_turns() -> list[TurnRecord]:
    """prompt [1,2,3] → out [10,11] → tool [4,5] → out [12] → user [6] → out [13,14,15]."""
    return [
        TurnRecord([1, 2, 3], [10, 11], [-0.1, -0.2], 0, "stop"),
        TurnRecord([1, 2, 3, 10, 11, 4, 5], [12], [-0.3], "1", "stop"),
        TurnRecord([1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14, 15], [-0.4, -0.5, -0.6], 2, "stop"),
    ]


def test_assembly_masks_logprobs_versions() -> None:
    sample = assemble(three_turns())
    assert sample.tokens == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14, 15]
    assert sample.prompt_tokens == [1, 2, 3] and sample.response_length == 9
    assert sample.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert sample.rollout_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5, -0.6]
    assert sample.weight_versions == [0, 1, 2]
    assert sample.status is Status.COMPLETED
    sampled = [t for t, m in zip(sample.response_tokens, sample.loss_mask, strict=True) if m]
    assert sampled == [10, 11, 12, 13, 14, 15]


def test_assembly_status_from_last_turn() -> None:
    records = three_turns()
    last = records[-1]
    records[-1] = TurnRecord(last.input_ids, last.output_ids, last.output_logprobs, 2, "length")
    assert assemble(records).status is Status.TRUNCATED
    records[-1] = TurnRecord(last.input_ids, last.output_ids, last.output_logprobs, 2, "abort")
    assert assemble(records).status is Status.ABORTED
    # A length-cut earlier turn does not make the session truncated.
    first = records[0]
    records[0] = TurnRecord(first.input_ids, first.output_ids, first.output_logprobs, 0, "length")
    records[-1] = last
    assert assemble(records).status is Status.COMPLETED


def test_truncation_on_turn_boundary() -> None:
    records = three_turns()
    assert assemble(records, max_seq_len=12).status is Status.COMPLETED  # fits exactly
    sample = assemble(records, max_seq_len=11)  # the last turn (12 ids) is dropped whole
    assert sample.tokens == [1, 2, 3, 10, 11, 4, 5, 12]
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.weight_versions == [0, 1]
    assert sample.status is Status.TRUNCATED
    assert sample.metadata["dropped_turns"] == 1
    sample = assemble(records, max_seq_len=7)
    assert sample.tokens == [1, 2, 3, 10, 11] and sample.weight_versions == [0]
    assert sample.status is Status.TRUNCATED


def test_truncation_inside_a_too_long_first_turn() -> None:
    sample = assemble(three_turns(), max_seq_len=4)
    assert sample.tokens == [1, 2, 3, 10] and sample.loss_mask == [1]
    assert sample.rollout_logprobs == [-0.1] and sample.status is Status.TRUNCATED
    with pytest.raises(AssemblyError, match="prompt alone"):
        assemble(three_turns(), max_seq_len=3)


def test_inconsistent_records_raise() -> None:
    with pytest.raises(AssemblyError, match="no turns"):
        assemble([])
    records = three_turns()
    records[1] = TurnRecord([1, 2, 3, 10, 99, 4, 5], [12], [-0.3], 1, "stop")
    with pytest.raises(AssemblyError, match="position 4"):
        assemble(records)
    with pytest.raises(AssemblyError, match="log-probs"):
        assemble([TurnRecord([1], [2, 3], [-0.1], 0, "stop")])
    with pytest.raises(AssemblyError, match="not an integer"):
        assemble([TurnRecord([1], [2], [-0.1], "v-final", "stop")])
