"""SFT mode: assistant-only loss masks, row errors, batches, the run through `verst sft`, resume,
and RL started from an SFT checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_loop import torchrun_module, torchrun_train
from verst.cli import main
from verst.data.source import DataSource, DataSourceConfig
from verst.models.tiny import build_char_tokenizer
from verst.train.checkpoint import list_checkpoints, load_weights
from verst.train.sft_data import (
    SFTBatches,
    SFTFormatConfig,
    chat_tokens_and_mask,
    item_from_mask,
    load_examples,
)

TINY = [
    "trainer.device=cpu",
    "num_threads=1",
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
    "intermediate_size: 64, max_position_embeddings: 64}",
]
CHAT = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "yz"},
]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_chat_mask_covers_assistant_content_and_end_of_turn_only() -> None:
    # ChatML, one id per character: "<|im_start|>system\ns<|im_end|>\n" is tokens 0..10,
    # the user turn 11..20, the assistant header "<|im_start|>assistant\n" 21..31, then "o" 32,
    # "k" 33, "<|im_end|>" 34, "\n" 35; user 36..44; header 45..55, "y" 56, "z" 57,
    # "<|im_end|>" 58, "\n" 59
    tokenizer = build_char_tokenizer()
    tokens, mask = chat_tokens_and_mask(tokenizer, CHAT)
    assert len(tokens) == 60
    assert [i for i, m in enumerate(mask) if m] == [32, 33, 34, 56, 57, 58]
    assert tokenizer.convert_ids_to_tokens([tokens[i] for i in (32, 33, 34, 56, 57, 58)]) == [
        "o",
        "k",
        "<|im_end|>",
        "y",
        "z",
        "<|im_end|>",
    ]
    item = item_from_mask(tokens, mask)
    # the prompt ends before "o"; the "\n" after the last trained token is dropped
    assert item.tokens == tokens[:59] and item.response_length == 27
    assert item.loss_mask == mask[32:59]


def test_prompt_completion_rows_train_on_completion_and_eos(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer()
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    items, skipped = load_examples(
        DataSourceConfig(path=str(path)), SFTFormatConfig(), tokenizer, 0
    )
    assert skipped == 0
    (item,) = items
    assert item.tokens == tokenizer("2+2=4")["input_ids"] + [0]
    assert item.response_length == 2 and item.loss_mask == [1, 1]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "line 2: 'messages' has no assistant message (roles: ['user'])",
        ),
        ({"prompt": "1+1="}, "line 2: has neither a messages key 'messages' nor"),
        ({"messages": [{"role": "assistant"}]}, "line 2: messages[0] (assistant) has no text"),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path: Path, row: dict, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHAT}, row])
    with pytest.raises(ValueError, match="bad.jsonl") as error:
        load_examples(
            DataSourceConfig(path=str(path)), SFTFormatConfig(), build_char_tokenizer(), 0
        )
    assert message in str(error.value)


def test_bad_row_stops_verst_sft_with_exit_code_2(tmp_path: Path, capsys) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    args = ["sft", *TINY, f"sft.data={{path: {path}}}", "sft.format=prompt_completion"]
    assert main([*args, "--run-dir", str(tmp_path / "run")]) == 2
    assert "bad.jsonl: line 1: has no 'completion'" in capsys.readouterr().err


def test_batches_follow_the_data_source_order_and_token_budget() -> None:
    tokenizer = build_char_tokenizer()
    cfg = DataSourceConfig(task="addition", split="dev")
    source = DataSource(cfg, tokenizer, n_samples_per_prompt=1, seed=3)
    batches = SFTBatches([1] * 200, batch_size=64, seed=3)
    for _ in range(7):  # across three epoch boundaries
        assert batches.next() == [group[0].prompt_id for group in source.take(64)]
    by_tokens = SFTBatches([3, 5, 2, 9], batch_size=1, batch_tokens=8, shuffle=False)
    assert [by_tokens.next() for _ in range(4)] == [[0, 1], [2], [3], [0, 1]]
    assert by_tokens.steps_for(3.0) == 5


def test_chat_sft_run_logs_loss_and_eval_and_resumes_exactly(tmp_path: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{i}?"},
                {"role": "assistant", "content": f"{i}!"},
            ]
        }
        for i in range(12)
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    args = [
        "sft",
        *TINY,
        f"sft.data={{path: {data}, shuffle: true}}",
        f"sft.eval_data={{path: {data}, max_prompts: 4}}",
        "sft.batch_size=4",
        "sft.eval_interval_steps=2",
        "trainer.lr=1e-3",
        "checkpoint.interval_steps=2",
        "checkpoint.keep_last=5",
    ]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main([*args, "sft.epochs=2", "--run-dir", str(whole)]) == 0
    assert main([*args, "sft.epochs=2", "sft.max_steps=3", "--run-dir", str(cut)]) == 0
    assert main([*args, "sft.epochs=2", "--run-dir", str(cut), "--resume"]) == 0
    rows_whole = records(whole)
    assert [r["step"] for r in rows_whole] == list(range(7))  # 12 rows / 4 × 2 epochs
    assert rows_whole[0]["eval/num_examples"] == 4 and "sft/loss" not in rows_whole[0]
    for row in rows_whole[1:]:
        # every step trains on 4 examples of "<n>!<|im_end|>": 3 tokens each when n < 10
        assert 12 <= row["sft/tokens"] <= 16 and row["sft/loss"] > 0
    assert rows_whole[-1]["eval/loss"] < rows_whole[0]["eval/loss"]
    rows_cut = records(cut)
    assert [r["step"] for r in rows_cut] == list(range(7))
    for a, b in zip(rows_whole[3:], rows_cut[3:], strict=True):
        assert a["sft/loss"] == b["sft/loss"] and a["sft/tokens"] == b["sft/tokens"]
    final_whole, final_cut = list_checkpoints(whole)[-1], list_checkpoints(cut)[-1]
    assert final_whole.name == final_cut.name == "step_000006"
    for name, tensor in load_weights(final_whole).items():
        assert torch.equal(tensor, load_weights(final_cut)[name]), name


def test_sft_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    """Two FSDP2 ranks over gloo, each with half of every batch and of the held-out rows, log
    what one process logs (the same batches, the loss averaged over both halves)."""
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(16)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    args = [
        *TINY,
        f"sft.data={{path: {data}, shuffle: true}}",
        f"sft.eval_data={{path: {data}, max_prompts: 8}}",
        "sft.batch_size=8",
        "sft.epochs=2",
        "sft.eval_interval_steps=4",
        "trainer.lr=1e-3",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["sft", *args, "--run-dir", str(one)]) == 0
    torchrun_train(args, two, command="sft")
    rows_one, rows_two = records(one), records(two)
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == list(range(5))
    for a, b in zip(rows_one[1:], rows_two[1:], strict=True):
        assert a["sft/tokens"] == b["sft/tokens"]
        assert b["sft/loss"] == pytest.approx(a["sft/loss"], rel=1e-4)
    assert rows_two[-1]["eval/loss"] == pytest.approx(rows_one[-1]["eval/loss"], rel=1e-4)
    assert list_checkpoints(two)


def test_rl_starts_from_an_sft_checkpoint_with_the_accuracy_sft_measured(tmp_path: Path) -> None:
    # eval/accuracy of SFT (teacher-forced: every completion token the argmax) must equal the
    # greedy accuracy the engine measures at RL's step 0 on the same prompts
    prompts = "{task: addition, split: train, max_prompts: 8, shuffle: false}"
    sft_dir, rl_dir = tmp_path / "sft", tmp_path / "rl"
    sft_args = [
        *TINY,
        f"sft.data={prompts}",
        f"sft.eval_data={prompts}",
        "sft.batch_size=8",
        "sft.epochs=200",
        "sft.max_steps=150",
        "sft.eval_interval_steps=10",
        "sft.target_accuracy=0.5",
        "trainer.lr=1e-2",
    ]
    assert main(["sft", *sft_args, "--run-dir", str(sft_dir)]) == 0
    measured = records(sft_dir)[-1]["eval/accuracy"]
    assert measured >= 0.5
    checkpoint = list_checkpoints(sft_dir)[-1]
    rl_args = [
        "trainer.device=cpu",
        "num_threads=1",
        f"model.path={checkpoint}",
        "num_steps=1",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        "eval.interval_steps=1",
        f"eval.data={prompts}",
        "eval.max_new_tokens=4",
    ]
    assert main(["train", *rl_args, "--run-dir", str(rl_dir)]) == 0
    assert records(rl_dir)[0]["eval/accuracy"] == measured


def test_sft_recipe_runs_its_first_steps(tmp_path: Path) -> None:
    recipe = Path(__file__).parent.parent / "examples" / "sft.yaml"
    args = ["sft", str(recipe), "sft.max_steps=2", "sft.eval_data.max_prompts=8"]
    assert main([*args, "trainer.device=cpu", "--run-dir", str(tmp_path / "run")]) == 0
    rows = records(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["sft/tokens"] > 128 and rows[-1]["eval/num_examples"] == 8
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_000002"]


def _warm_start_run(accuracies: list[float], keep_nearest: bool) -> tuple[dict, dict, dict]:
    """A real warm start on a tiny trainer whose dev checks read `accuracies` in turn, with a
    copy of the weights taken at each check; (result, weights by check step, final weights)."""
    from tests.test_trainer import items, make_trainer, tiny_model, weights
    from verst.train.sft import WarmStartConfig, warm_start

    trainer = make_trainer(tiny_model())
    cfg = WarmStartConfig(
        enabled=True, batch_size=2, lr=1e-2, max_steps=20, target_accuracy=0.3,
        check_interval_steps=2, keep_nearest=keep_nearest,
    )  # fmt: skip
    seen: dict[int, dict] = {}
    left = list(accuracies)

    def dev_accuracy() -> float:
        seen[2 * (len(seen) + 1)] = weights(trainer)
        return left.pop(0)

    result = warm_start(cfg, trainer, items(), dev_accuracy, lambda _: None, seed=0)
    return result, seen, weights(trainer)


def test_warm_start_that_overshoots_goes_back_to_the_check_nearer_the_target() -> None:
    result, seen, final = _warm_start_run([0.0, 0.18, 0.74], keep_nearest=True)
    assert result["warm_start/steps"] == 4 and result["warm_start/dev_accuracy"] == 0.18
    assert all(torch.equal(final[k], seen[4][k]) for k in final)
    assert not all(torch.equal(final[k], seen[6][k]) for k in final)


@pytest.mark.slow
def test_warm_start_on_two_ranks_goes_back_to_the_nearer_check(tmp_path: Path) -> None:
    """`tests/warm_start_ranks.py` under torchrun: the kept check's weights are rank 0's full
    state dict, loaded on both ranks (rank 1's was empty and it stopped); rank 1 draws items of
    one-token responses, whose micro-batch must take the others' collectives (it hung)."""
    out = tmp_path / "result.json"
    torchrun_module("tests.warm_start_ranks", [str(out)])
    result = json.loads(out.read_text())
    assert result["warm_start/steps"] == 4 and result["warm_start/dev_accuracy"] == 0.18
    assert result["back"] and result["moved_since"]


def test_warm_start_keeps_the_check_that_reached_the_target_when_it_is_nearer() -> None:
    result, seen, final = _warm_start_run([0.0, 0.1, 0.35], keep_nearest=True)
    assert result["warm_start/steps"] == 6 and result["warm_start/dev_accuracy"] == 0.35
    assert all(torch.equal(final[k], seen[6][k]) for k in final)
    result, seen, final = _warm_start_run([0.0, 0.18, 0.74], keep_nearest=False)
    assert result["warm_start/steps"] == 6 and result["warm_start/dev_accuracy"] == 0.74
    assert all(torch.equal(final[k], seen[6][k]) for k in final)


def test_supervised_steps_fit_the_model_whatever_temperature_the_rollout_samples_at() -> None:
    """A warm start runs on the RL trainer, built with `rollout.temperature`; its NLL is still
    the model's own (temperature 1), so sampling at T < 1 afterwards sharpens what it fitted."""
    from tests.test_trainer import CPU, TINY, items, tiny_model, weights
    from verst.models.tiny import build_tiny_model
    from verst.train.algorithms import LossConfig
    from verst.train.trainer import Trainer, TrainerConfig

    def trainer_at(temperature: float) -> Trainer:
        cfg = TrainerConfig(lr=1e-2, device="cpu")
        return Trainer(
            tiny_model(), cfg, LossConfig(), total_steps=10, pad_token_id=0, device=CPU,
            temperature=temperature,
        )  # fmt: skip

    batch = items()
    model = build_tiny_model(TINY, vocab_size=40, seed=0)
    nll = torch.stack([
        -torch.log_softmax(model(torch.tensor([item.tokens])).logits[0].float(), -1)[
            torch.arange(len(item.tokens) - item.response_length - 1, len(item.tokens) - 1),
            torch.tensor(item.tokens[len(item.tokens) - item.response_length :]),
        ].sum()
        for item in batch
    ]).sum().item() / sum(item.response_length for item in batch)  # fmt: skip
    runs = []
    for temperature in (0.5, 1.0):
        trainer = trainer_at(temperature)
        held_out = trainer.sft_eval(batch)
        step = trainer.sft_step(batch, trainer.make_optimizer(1e-2), step=1)
        runs.append((held_out, step, weights(trainer)))
    (eval_half, step_half, after_half), (eval_one, step_one, after_one) = runs
    assert step_half["loss"] == pytest.approx(nll, rel=1e-5)
    assert step_one["loss"] == pytest.approx(nll, rel=1e-5)
    assert eval_half == pytest.approx(eval_one)
    assert eval_one["eval/loss"] == pytest.approx(nll, rel=1e-5)
    assert all(torch.equal(after_half[k], after_one[k]) for k in after_one)
