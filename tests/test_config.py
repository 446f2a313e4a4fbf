"""Config: YAML + dotted overrides, errors that name the field, help for every field."""

from __future__ import annotations

from pathlib import Path

import pytest

from verst.cli import main
from verst.config import ConfigError, describe_fields, help_text, load_config

QUICKSTART = Path(__file__).parent.parent / "examples" / "quickstart.yaml"


def test_quickstart_loads_and_overrides_apply() -> None:
    cfg = load_config(QUICKSTART, ["trainer.lr=1e-5", "rollout.stop_token_ids=[3, 4]"])
    assert cfg.trainer.lr == 1e-5
    assert cfg.rollout.stop_token_ids == [3, 4]
    assert cfg.warm_start.enabled and cfg.model.tiny is not None


def test_defaults_validate_without_a_file() -> None:
    cfg = load_config(None)
    assert cfg.model.tiny is not None and cfg.data.task == "addition"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("trainer.lr=-1", "trainer.lr"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.top_k=0", "rollout.top_k"),
        ("loss.eps_clip=2", "loss.eps_clip"),
        ("loss.loss_aggregation=mean", "loss.loss_aggregation"),
        ("trainer.no_such_field=1", "trainer.no_such_field"),
        ("rollout.n_samples_per_prompt=1", "n_samples_per_prompt"),
        ("data={path: x.jsonl, task: addition}", "data"),  # two sources
        ("model={path: /m, tiny: {}}", "model"),  # two sources
        ("rollout.reward=no_such_pkg.mod:fn", "rollout.reward"),
    ],
)
def test_invalid_values_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(QUICKSTART, [override])


def test_choosing_one_source_replaces_the_default_one() -> None:
    cfg = load_config(None, ["model.path=/some/dir", "data.path=prompts.jsonl"])
    assert cfg.model.path == "/some/dir" and cfg.model.tiny is None
    assert cfg.data.path == "prompts.jsonl" and cfg.data.task is None


def test_partial_sections_keep_their_defaults() -> None:
    cfg = load_config(None, ["eval.data.max_prompts=8", "model.tiny.hidden_size=64"])
    assert cfg.eval.data.task == "addition" and cfg.eval.data.split == "test"
    assert cfg.model.tiny.hidden_size == 64 and cfg.model.tiny.num_layers == 4


def test_malformed_override_and_missing_file() -> None:
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(QUICKSTART, ["trainer.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.yaml")


def test_every_field_has_a_description_in_help() -> None:
    rows = describe_fields()
    assert len(rows) > 40
    assert all(description for _, _, description in rows), [n for n, _, d in rows if not d]
    text = help_text()
    for name, _, _ in rows:
        assert name in text


def test_cli_reports_config_errors_before_any_work(tmp_path: Path, capsys) -> None:
    code = main(["train", str(QUICKSTART), "trainer.lr=-1", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert "trainer.lr" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_cli_names_a_reward_that_cannot_be_imported(tmp_path: Path, capsys) -> None:
    code = main(
        [
            "train",
            str(QUICKSTART),
            "rollout.reward=verst.nothing:here",
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    assert code == 2
    assert "verst.nothing:here" in capsys.readouterr().err


def test_fully_async_example_loads() -> None:
    cfg = load_config(Path(__file__).parent.parent / "examples" / "fully_async.yaml")
    assert cfg.mode == "fully_async" and cfg.pause_mode == "in_place"
    assert cfg.sync.resolve(cfg.placement) == "broadcast"
