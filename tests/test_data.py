"""Procedural tasks, prompt files, and the DataSource's order, give-back and resume."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from verst.data import DataSource, DataSourceConfig, make_task
from verst.models import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prompts(groups):
    return [g[0].prompt for g in groups]


def test_addition_splits_disjoint_and_deterministic():
    splits = {s: make_task("addition", s, seed=0) for s in ("train", "dev", "test")}
    assert len(splits["test"]) == len(splits["dev"]) == 200
    assert len(splits["train"]) == 10_000 - 400
    sets = {s: {r["prompt"] for r in rows} for s, rows in splits.items()}
    assert not (
        sets["train"] & sets["dev"] or sets["train"] & sets["test"] or sets["dev"] & sets["test"]
    )
    assert make_task("addition", "test", seed=0) == splits["test"]
    assert make_task("addition", "test", seed=1) != splits["test"]
    row = next(r for r in splits["train"] if r["prompt"] == "07+58=")
    assert row == {"prompt": "07+58=", "label": "65"}
    assert all(len(r["prompt"]) == 4 for r in make_task("addition", "train", 0, digits=1))
    with pytest.raises(ValueError, match="addition"):
        make_task("nope", "train", 0)


@pytest.mark.parametrize("task, train_rows", [("subtraction", 4650), ("arithmetic", 9600 + 4650)])
def test_subtraction_and_arithmetic_splits_are_disjoint(task: str, train_rows: int) -> None:
    splits = {s: make_task(task, s, seed=0) for s in ("train", "dev", "test")}
    assert len(splits["train"]) == train_rows
    sets = {s: {r["prompt"] for r in rows} for s, rows in splits.items()}
    assert not (
        sets["train"] & sets["dev"] or sets["train"] & sets["test"] or sets["dev"] & sets["test"]
    )
    for row in splits["test"]:  # every answer is the arithmetic's
        a, op, b = row["prompt"][:2], row["prompt"][2], row["prompt"][3:5]
        assert int(row["label"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0


def test_config_requires_exactly_one_source():
    with pytest.raises(ValidationError, match="data.path and data.task"):
        DataSourceConfig()
    with pytest.raises(ValidationError, match="data.path and data.task"):
        DataSourceConfig(path="a.jsonl", task="addition")
    for name, field in DataSourceConfig.model_fields.items():
        assert field.description, name


def test_jsonl_errors_name_file_and_line(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        DataSource(DataSourceConfig(path=str(bad)), tokenizer, n_samples_per_prompt=1, seed=0)
    nokey = write_jsonl(tmp_path / "nokey.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(ValueError, match=r"nokey\.jsonl: line 2 has no prompt key 'prompt'"):
        DataSource(DataSourceConfig(path=nokey), tokenizer, n_samples_per_prompt=1, seed=0)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        DataSource(
            DataSourceConfig(path=str(tmp_path / "missing.jsonl")),
            tokenizer,
            n_samples_per_prompt=1,
            seed=0,
        )


def test_samples_carry_prompt_tokens_label_metadata(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "07+58=", "a": 65, "src": "x"}])
    cfg = DataSourceConfig(path=path, prompt_key="q", label_key="a")
    (group,) = DataSource(cfg, tokenizer, n_samples_per_prompt=3, seed=0).take(1)
    assert [s.index for s in group] == [0, 1, 2]
    for s in group:
        assert s.prompt == "07+58=" and s.label == 65 and s.metadata == {"src": "x"}
        assert s.tokens == tokenizer("07+58=", add_special_tokens=False)["input_ids"]
        assert s.response_length == 0 and s.group_index == 0
    group[0].metadata["src"] = "changed"
    assert group[1].metadata["src"] == "x"


def test_parquet(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "label": ["2", "4"]}), path)
    ds = DataSource(
        DataSourceConfig(path=str(path), shuffle=False), tokenizer, n_samples_per_prompt=1, seed=0
    )
    assert [(s.prompt, s.label) for s in ds.prompts_in_order()] == [("1+1=", "2"), ("2+2=", "4")]


def test_chat_template_prompts(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"prompt": "hi"},
            {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "yo"}]},
        ],
    )
    cfg = DataSourceConfig(path=path, apply_chat_template=True, shuffle=False)
    first, second = DataSource(cfg, tokenizer, n_samples_per_prompt=1, seed=0).take(2)
    assert first[0].prompt == [{"role": "user", "content": "hi"}]
    assert tokenizer.decode(first[0].tokens) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(second[0].tokens).startswith("<|im_start|>system\nS<|im_end|>")


def test_take_crosses_epochs_and_shuffles_deterministically(tokenizer):
    cfg = DataSourceConfig(task="addition", split="test", max_prompts=10)
    ds = DataSource(cfg, tokenizer, n_samples_per_prompt=2, seed=5)
    groups = ds.take(7) + ds.take(7)
    assert ds.epoch == 1
    assert [g[0].group_index for g in groups] == list(range(14))
    epoch0 = prompts(groups[:10])
    assert sorted(epoch0) == sorted(s.prompt for s in ds.prompts_in_order())
    assert epoch0 != [s.prompt for s in ds.prompts_in_order()]  # shuffled
    ds.take(6)
    assert ds.epoch == 2
    again = DataSource(cfg, tokenizer, n_samples_per_prompt=2, seed=5)
    assert prompts(again.take(14)) == prompts(groups)
    other = DataSource(cfg, tokenizer, n_samples_per_prompt=2, seed=6)
    assert prompts(other.take(10)) != epoch0
    unshuffled = DataSource(
        cfg.model_copy(update={"shuffle": False}), tokenizer, n_samples_per_prompt=1, seed=5
    )
    assert prompts(unshuffled.take(10)) == [s.prompt for s in ds.prompts_in_order()]


def test_give_back_served_first(tokenizer):
    cfg = DataSourceConfig(task="addition", split="dev", max_prompts=8)
    ds = DataSource(cfg, tokenizer, n_samples_per_prompt=2, seed=0)
    reference = prompts(DataSource(cfg, tokenizer, n_samples_per_prompt=2, seed=0).take(6))
    a = ds.take(3)
    a[1][0].tokens = a[1][0].tokens + [5, 6]  # a partial response must not come back
    a[1][0].response_length = 2
    ds.give_back([a[1]])
    b = ds.take(2)
    assert prompts(b) == [reference[1], reference[3]]
    assert b[0][0].tokens == a[1][1].tokens and b[0][0].response_length == 0
    assert [s.index for s in b[0]] == [0, 1]
    assert b[0][0].group_index == 3


def test_state_dict_resume_gives_identical_sequence(tokenizer):
    cfg = DataSourceConfig(task="addition", split="test", max_prompts=7)
    full = DataSource(cfg, tokenizer, n_samples_per_prompt=1, seed=3)
    first = full.take(5)
    full.give_back(first[2:4])
    state = json.loads(json.dumps(full.state_dict()))
    rest = full.take(20)

    resumed = DataSource(cfg, tokenizer, n_samples_per_prompt=1, seed=3)
    resumed.load_state_dict(state)
    resumed_rest = resumed.take(20)
    assert prompts(resumed_rest) == prompts(rest)
    assert [g[0].group_index for g in resumed_rest] == [g[0].group_index for g in rest]
    assert resumed.epoch == full.epoch
    smaller = DataSource(
        cfg.model_copy(update={"max_prompts": 6}), tokenizer, n_samples_per_prompt=1, seed=3
    )
    with pytest.raises(ValueError, match="7 prompts"):
        smaller.load_state_dict(state)


def test_a_saved_state_serves_pending_prompts_again_first(tokenizer):
    """Prompts taken but not trained on (a fully async run's, in flight or buffered) go into
    the saved state after the given-back ones, and the live source is left as it was."""
    cfg = DataSourceConfig(task="addition", split="test", max_prompts=7)
    live = DataSource(cfg, tokenizer, n_samples_per_prompt=2, seed=3)
    taken = live.take(5)
    live.give_back(taken[4:])
    state = json.loads(json.dumps(live.state_dict(pending=taken[2:4])))
    assert len(live.state_dict()["returned"]) == 1  # the live source is unchanged

    resumed = DataSource(cfg, tokenizer, n_samples_per_prompt=2, seed=3)
    resumed.load_state_dict(state)
    again = resumed.take(3)
    assert prompts(again) == [taken[4][0].prompt, taken[2][0].prompt, taken[3][0].prompt]
    assert again[1][0].tokens == taken[2][0].prompt_tokens and again[1][0].response_length == 0


def test_every_sample_carries_its_prompt_identity(tmp_path, tokenizer):
    """(epoch, prompt_id): the row's position in the file (blank lines skipped) and the pass
    that served it, whatever the shuffle."""
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"{i}+0=", "label": str(i), "topic": "sums"} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[2:]))
    ds = DataSource(DataSourceConfig(path=str(path)), tokenizer, n_samples_per_prompt=2, seed=1)
    groups = ds.take(12)
    for group in groups:
        assert {(s.prompt_id, s.epoch, s.retries) for s in group} == {
            (group[0].prompt_id, group[0].epoch, 0)
        }
        assert group[0].prompt == rows[group[0].prompt_id]["prompt"]
    assert [g[0].epoch for g in groups] == [0] * 5 + [1] * 5 + [2] * 2
    assert sorted(g[0].prompt_id for g in groups[:5]) == list(range(5))
    # evaluation's prompts are in file order, with no epoch
    assert [(s.prompt_id, s.epoch) for s in ds.prompts_in_order()] == [(i, None) for i in range(5)]


def test_a_prompt_given_back_keeps_its_identity_and_comes_back_clean(tokenizer):
    cfg = DataSourceConfig(task="addition", split="test", max_prompts=3)
    ds = DataSource(cfg, tokenizer, n_samples_per_prompt=2, seed=0)
    [first] = ds.take(1)
    first[0].metadata["reward_error"] = "ValueError: bad"  # a previous attempt's leftovers
    first[0].retries = 2  # the caller counts the retry
    ds.take(2)  # the epoch ends; the prompt keeps the epoch that served it
    ds.give_back([first])
    ds.give_back_prompt(1, epoch=0, retries=1)
    again, other = ds.take(2)
    assert (again[0].prompt_id, again[0].epoch, again[0].retries) == (first[0].prompt_id, 0, 2)
    assert again[0].prompt == first[0].prompt and "reward_error" not in again[0].metadata
    assert (other[1].prompt_id, other[1].epoch, other[1].retries) == (1, 0, 1)
    assert ds.take(1)[0][0].epoch == 1
    with pytest.raises(ValueError, match="prompt_id 3"):
        ds.give_back_prompt(3, epoch=0, retries=0)


def test_a_saved_state_keeps_identities_and_reads_older_states(tokenizer):
    cfg = DataSourceConfig(task="addition", split="test", max_prompts=4)
    live = DataSource(cfg, tokenizer, n_samples_per_prompt=1, seed=2)
    taken = live.take(3)
    live.give_back_prompt(taken[0][0].prompt_id, epoch=0, retries=1)
    state = json.loads(json.dumps(live.state_dict(pending=taken[1:2])))
    assert state["returned"] == [
        {"prompt_id": taken[0][0].prompt_id, "epoch": 0, "retries": 1},
        {"prompt_id": taken[1][0].prompt_id, "epoch": 0, "retries": 0},
    ]
    resumed = DataSource(cfg, tokenizer, n_samples_per_prompt=1, seed=2)
    resumed.load_state_dict(state)
    served = [g[0] for g in resumed.take(2)]
    assert [(s.prompt_id, s.retries) for s in served] == [
        (taken[0][0].prompt_id, 1),
        (taken[1][0].prompt_id, 0),
    ]
    # a state saved before prompts had identities: full prompt sides, served as they are
    old = state | {"returned": [{"prompt": "1+2=", "label": "3", "tokens": [5, 6], "metadata": {}}]}
    resumed.load_state_dict(old)
    [[sample]] = resumed.take(1)
    assert (sample.prompt, sample.tokens, sample.prompt_id, sample.retries) == (
        "1+2=",
        [5, 6],
        None,
        0,
    )
