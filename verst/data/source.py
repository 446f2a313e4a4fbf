"""DataSource: prompts from a JSONL / Parquet file or a procedural task, served as groups.

It owns the prompt order: epochs, per-epoch shuffling (seeded with `seed + epoch`), an optional
cap, prompts given back for retry (served first), and a resumable position. `take(n)` returns n
groups of `n_samples_per_prompt` fresh Samples each; `state_dict()` / `load_state_dict()` make a
resumed run see exactly the order an uninterrupted run would have seen.

Every Sample it serves carries its prompt's identity: `prompt_id` (the row's 0-based position in
the file or task split, before shuffling), `epoch` (the pass over the prompts that served it)
and `retries` (how often it was given back). A prompt given back keeps its identity, and is
served again rendered afresh from its row, so nothing a previous attempt wrote into a Sample's
metadata comes with it.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator
from transformers import PreTrainedTokenizerBase

from verst.configbase import ConfigBase
from verst.data.tasks import make_task
from verst.types import LORA_ADAPTER_KEY, Group, Sample


class DataSourceConfig(ConfigBase):
    """Where prompts come from and how they are ordered; set exactly one of `path` and `task`."""

    path: str | None = Field(None, description="prompt file (.jsonl or .parquet)")
    task: str | None = Field(
        None, description="procedural task name instead of a file, e.g. addition"
    )
    task_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the procedural task"
    )
    task_seed: int = Field(
        0, description="seed of the task's split generation (keep fixed so splits stay disjoint)"
    )
    split: Literal["train", "dev", "test"] = Field(
        "train", description="which split of the procedural task to use"
    )
    prompt_key: str = Field("prompt", description="row field holding the prompt (text or messages)")
    label_key: str = Field("label", description="row field holding the label (optional per row)")
    apply_chat_template: bool = Field(
        False, description="render prompts with the tokenizer's chat template + generation prompt"
    )
    shuffle: bool = Field(True, description="reshuffle the prompts every epoch (seed + epoch)")
    max_prompts: int | None = Field(
        None, gt=0, description="use only the first N prompts of the file or split"
    )

    exclusive_fields: ClassVar[tuple[str, ...]] = ("path", "task")

    @model_validator(mode="after")
    def _exactly_one(self) -> DataSourceConfig:
        if (self.path is None) == (self.task is None):
            raise ValueError("set exactly one of data.path and data.task")
        return self


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: malformed JSON line ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append((line_no, row))
    return rows


def _read_parquet(path: Path) -> list[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading {path} needs pyarrow: pip install verst[parquet]") from exc
    return list(enumerate(pq.read_table(path).to_pylist(), start=1))


def read_rows(cfg: DataSourceConfig) -> tuple[list[tuple[int, dict]], str, str]:
    """The rows named by `cfg` in file (or split) order, capped at `max_prompts`, each with its
    number (a file's line, a split's row), and the words that locate a row in an error message:
    where they come from (the file, or the task and split) and what a number counts."""
    if cfg.task is not None:
        rows = make_task(cfg.task, cfg.split, cfg.task_seed, **cfg.task_kwargs)
        numbered = list(enumerate(rows, start=1))
        where = f"task {cfg.task!r} split {cfg.split!r}"
        unit = "row"
    else:
        assert cfg.path is not None
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            numbered, unit = _read_jsonl(path), "line"
        elif suffix == ".parquet":
            numbered, unit = _read_parquet(path), "row"
        else:
            raise ValueError(f"prompt file {str(path)!r}: expected .jsonl or .parquet")
        where = str(path)
    if cfg.max_prompts is not None:
        numbered = numbered[: cfg.max_prompts]
    return numbered, where, unit


def load_rows(cfg: DataSourceConfig) -> list[dict]:
    """The rows named by `cfg` in file (or split) order, capped at `max_prompts`.

    Every row is checked for the prompt key here, so a bad row fails before training starts.
    """
    numbered, where, unit = read_rows(cfg)
    for number, row in numbered:
        if cfg.prompt_key not in row:
            raise ValueError(
                f"{where}: {unit} {number} has no prompt key {cfg.prompt_key!r} "
                f"(keys: {sorted(row)})"
            )
    if not numbered:
        raise ValueError(f"{where}: no prompts")
    return [row for _, row in numbered]


def adapter_rows(data: dict[str, DataSourceConfig]) -> tuple[DataSourceConfig, list[dict]]:
    """Multi-LoRA: every adapter's prompt rows as one prompt set, in adapter order, each row
    tagged with its adapter (`lora_adapter`) and holding its prompt and label under `prompt`
    and `label`; and the config a `DataSource` over these rows renders and orders them by
    (the first adapter's, with those keys)."""
    rows: list[dict] = []
    for name, cfg in data.items():
        for row in load_rows(cfg):
            tagged = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.label_key)}
            tagged |= {"prompt": row[cfg.prompt_key], LORA_ADAPTER_KEY: name}
            if cfg.label_key in row:
                tagged["label"] = row[cfg.label_key]
            rows.append(tagged)
    first = next(iter(data.values()))
    return first.model_copy(update={"prompt_key": "prompt", "label_key": "label"}), rows


class DataSource:
    """Serves groups of fresh Samples, epoch after epoch, in a reproducible order."""

    def __init__(
        self,
        cfg: DataSourceConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        n_samples_per_prompt: int,
        seed: int,
        rows: list[dict] | None = None,
    ) -> None:
        """Prompts from the rows `cfg` names, or from `rows` when given (`adapter_rows`)."""
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = seed
        self.rows = load_rows(cfg) if rows is None else rows
        self._epoch = 0
        self._offset = 0  # position in this epoch's order of the next prompt to serve
        self._returned: list[dict] = []  # prompt sides of given-back groups, served first
        self._group_counter = 0
        self._order = self._epoch_order(0)

    @property
    def epoch(self) -> int:
        """Number of complete passes over the prompts so far."""
        return self._epoch

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.cfg.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _render(self, row: dict) -> tuple[str | list[dict[str, Any]], list[int]]:
        prompt = row[self.cfg.prompt_key]
        if self.cfg.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return messages, self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not isinstance(prompt, str):
            raise ValueError(
                f"prompt {self.cfg.prompt_key!r} is a {type(prompt).__name__}, not text; "
                "set data.apply_chat_template=true to render message lists"
            )
        return prompt, self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def _prompt_sample(
        self, prompt_id: int, group_index: int, *, epoch: int | None = None, retries: int = 0
    ) -> Sample:
        row = self.rows[prompt_id]
        prompt, tokens = self._render(row)
        metadata = {
            k: copy.deepcopy(v)
            for k, v in row.items()
            if k not in (self.cfg.prompt_key, self.cfg.label_key)
        }
        return Sample(
            prompt=prompt,
            label=copy.deepcopy(row.get(self.cfg.label_key)),
            tokens=list(tokens),
            metadata=metadata,
            group_index=group_index,
            prompt_id=prompt_id,
            epoch=epoch,
            retries=retries,
        )

    def _next_prompt(self) -> Sample:
        if self._returned:
            side = self._returned.pop(0)
            retries = int(side.get("retries", 0))
            if "prompt" not in side:  # an identity: rendered afresh from its row
                return self._prompt_sample(
                    side["prompt_id"], self._group_counter, epoch=side["epoch"], retries=retries
                )
            return Sample(
                prompt=side["prompt"],
                label=side["label"],
                tokens=side["tokens"],
                metadata=side["metadata"],
                group_index=self._group_counter,
                prompt_id=side.get("prompt_id"),
                epoch=side.get("epoch"),
                retries=retries,
            )
        prompt_id, epoch = self._order[self._offset], self._epoch
        self._offset += 1
        if self._offset == len(self._order):
            self._epoch += 1
            self._offset = 0
            self._order = self._epoch_order(self._epoch)
        return self._prompt_sample(prompt_id, self._group_counter, epoch=epoch)

    def take(self, n_prompts: int) -> list[Group]:
        """The next `n_prompts` prompts (given-back first), each a group of fresh Samples."""
        groups = []
        for _ in range(n_prompts):
            prompt = self._next_prompt()
            self._group_counter += 1
            groups.append([prompt.clone_prompt(i) for i in range(self.n_samples_per_prompt)])
        return groups

    def give_back(self, groups: list[Group]) -> None:
        """Queue these groups' prompts to be served again (before new ones), e.g. after an abort.

        A prompt keeps its identity and `retries` as the group's first Sample has them (the
        caller counts a retry); it is served rendered afresh from its row. A group without a
        `prompt_id` (made elsewhere) keeps its prompt side as it is now: prompt, label, prompt
        tokens and metadata.
        """
        self._returned.extend(_prompt_side(group) for group in groups if group)

    def give_back_prompt(self, prompt_id: int, *, epoch: int | None, retries: int) -> None:
        """Queue prompt `prompt_id` to be served again (before new ones), with this identity."""
        if not 0 <= prompt_id < len(self.rows):
            raise ValueError(f"prompt_id {prompt_id} outside 0..{len(self.rows) - 1}")
        self._returned.append({"prompt_id": prompt_id, "epoch": epoch, "retries": retries})

    def state_dict(self, pending: Sequence[Group] = ()) -> dict[str, Any]:
        """Everything needed to continue the same order; plain Python data (JSON-serialisable
        when the rows are). `pending`: groups taken but not trained on yet (a fully async
        run's prompts in flight or in its buffer); the saved state serves them again first,
        after the given-back ones, while this source carries on unchanged."""
        return {
            "num_prompts": len(self.rows),
            "epoch": self._epoch,
            "offset": self._offset,
            "returned": copy.deepcopy(self._returned)
            + [_prompt_side(group) for group in pending if group],
            "group_counter": self._group_counter,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the prompt set must be the one it was saved with."""
        if state["num_prompts"] != len(self.rows):
            raise ValueError(
                f"data state was saved with {state['num_prompts']} prompts, "
                f"but this source has {len(self.rows)}"
            )
        self._epoch = int(state["epoch"])
        self._offset = int(state["offset"])
        self._returned = copy.deepcopy(list(state["returned"]))
        self._group_counter = int(state["group_counter"])
        self._order = self._epoch_order(self._epoch)

    def prompts_in_order(self) -> list[Sample]:
        """One Sample per prompt in file (or split) order, unshuffled; for evaluation.

        `group_index` is the prompt's position in the file.
        """
        return [self._prompt_sample(i, i) for i in range(len(self.rows))]


def _prompt_side(group: Group) -> dict[str, Any]:
    """What `give_back` keeps of a group: the identity of its prompt when it has one, else its
    prompt, label, prompt tokens and metadata."""
    sample = group[0]
    identity = {"prompt_id": sample.prompt_id, "epoch": sample.epoch, "retries": sample.retries}
    if sample.prompt_id is not None:
        return identity
    return identity | {
        "prompt": copy.deepcopy(sample.prompt),
        "label": copy.deepcopy(sample.label),
        "tokens": list(sample.prompt_tokens),
        "metadata": copy.deepcopy(sample.metadata),
    }
