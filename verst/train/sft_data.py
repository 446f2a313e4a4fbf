"""SFT examples: chat `messages` rows or prompt/completion pairs, as `TrainItem`s whose loss
mask covers exactly what the model is taught to write, and the order they are served in.

- messages: the conversation is rendered with the tokenizer's chat template; the loss is on the
  assistant turns only, each turn's content and the end-of-turn token the template writes after
  it (never the header that opens the turn, nor whitespace the template adds after the
  end-of-turn token, which the model never generates since it stops on that token). Which
  characters belong to an assistant turn is found by rendering the conversation up to the turn
  with the generation prompt and up to its end without, so no template is special-cased.
- prompt_completion: the prompt's tokens (through the chat template when the data source says
  so) followed by the completion's tokens and EOS, with the loss on the completion and EOS.
  A procedural task's rows are prompt/completion pairs whose completion is the label.

Every row is checked and tokenised when the data is loaded, so a bad row stops the run before
training with a message naming the file (or task), the line and the field.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field
from transformers import PreTrainedTokenizerBase

from verst.configbase import ConfigBase
from verst.data.source import DataSourceConfig, read_rows
from verst.train.batching import TrainItem


class SFTFormatConfig(ConfigBase):
    format: Literal["auto", "messages", "prompt_completion"] = Field(
        "auto",
        description="row format; auto = messages when a row has the messages key, else "
        "prompt/completion",
    )
    messages_key: str = Field("messages", description="row field holding the chat messages")
    completion_key: str = Field(
        "completion",
        description="row field holding the completion (a task's completion is its label)",
    )
    max_seq_len: int | None = Field(
        None, ge=2, description="skip examples longer than this many tokens; unset = keep all"
    )


def item_from_mask(tokens: list[int], mask: list[int]) -> TrainItem:
    """The tokens as a prompt (up to the first trained token) and a response (up to the last
    trained one) with the loss mask over the response."""
    first = mask.index(1)
    last = len(mask) - mask[::-1].index(1)
    return TrainItem(
        tokens=tokens[:last],
        response_length=last - first,
        loss_mask=mask[first:last],
        rollout_logprobs=[0.0] * (last - first),
        advantage=0.0,
    )


def prompt_completion_item(prompt_ids: list[int], completion_ids: list[int]) -> TrainItem:
    """prompt + completion, with the loss on the completion tokens only."""
    return TrainItem(
        tokens=prompt_ids + completion_ids,
        response_length=len(completion_ids),
        loss_mask=[1] * len(completion_ids),
        rollout_logprobs=[0.0] * len(completion_ids),
        advantage=0.0,
    )


def _render(tokenizer: PreTrainedTokenizerBase, messages: list, *, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[range]:
    """Character ranges of the rendered conversation that the assistant writes."""
    full = _render(tokenizer, messages, generation=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], generation=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(
                f"messages[{i}]: the chat template does not render this conversation as a "
                "prefix of its continuation, so the assistant's tokens cannot be located"
            )
        turn = through[len(before) :].rstrip()
        spans.append(range(len(before), len(before) + len(turn)))
    return spans


def chat_tokens_and_mask(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict]
) -> tuple[list[int], list[int]]:
    """The rendered conversation's token ids, and 1 for each token an assistant turn holds."""
    if not tokenizer.is_fast or not tokenizer.chat_template:
        raise ValueError("messages rows need a fast tokenizer with a chat template")
    text = _render(tokenizer, messages, generation=False)
    spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(start in span for span in spans)) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def _check_messages(messages: Any, key: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{key!r} must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"{key}[{i}] is not a message with a 'role'")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{key}[{i}] ({message['role']}) has no text 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        roles = [m["role"] for m in messages]
        raise ValueError(f"{key!r} has no assistant message (roles: {roles}); nothing to learn")
    return messages


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, data: DataSourceConfig, prompt: Any) -> list:
    if data.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = _render(tokenizer, messages, generation=True)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise ValueError(
            f"prompt {data.prompt_key!r} is a {type(prompt).__name__}, not text; set "
            "apply_chat_template=true on the data source to render message lists"
        )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def row_item(
    row: dict,
    data: DataSourceConfig,
    fmt: SFTFormatConfig,
    tokenizer: PreTrainedTokenizerBase,
    eos_id: int,
) -> TrainItem:
    """One row as a TrainItem; a ValueError names the field that is wrong."""
    kind = fmt.format
    if kind == "auto":
        kind = "messages" if fmt.messages_key in row else "prompt_completion"
    if kind == "messages":
        if fmt.messages_key not in row:
            raise ValueError(f"has no messages key {fmt.messages_key!r} (keys: {sorted(row)})")
        messages = _check_messages(row[fmt.messages_key], fmt.messages_key)
        tokens, mask = chat_tokens_and_mask(tokenizer, messages)
        return item_from_mask(tokens, mask)
    completion_key = "label" if data.task is not None else fmt.completion_key
    for key in (data.prompt_key, completion_key):
        if key not in row:
            raise ValueError(
                f"has neither a messages key {fmt.messages_key!r} nor a prompt/completion pair: "
                f"no {key!r} (keys: {sorted(row)})"
                if fmt.format == "auto"
                else f"has no {key!r} (keys: {sorted(row)})"
            )
    completion = row[completion_key]
    if not isinstance(completion, str | int | float) or isinstance(completion, bool):
        raise ValueError(f"{completion_key!r} is a {type(completion).__name__}, not text")
    completion_ids = tokenizer(str(completion), add_special_tokens=False)["input_ids"]
    return prompt_completion_item(
        _prompt_ids(tokenizer, data, row[data.prompt_key]), completion_ids + [eos_id]
    )


def load_examples(
    data: DataSourceConfig,
    fmt: SFTFormatConfig,
    tokenizer: PreTrainedTokenizerBase,
    eos_id: int,
) -> tuple[list[TrainItem], int]:
    """Every row of `data` as a TrainItem, in file (or split) order, and how many were skipped
    for being longer than `fmt.max_seq_len`."""
    numbered, where, unit = read_rows(data)
    items: list[TrainItem] = []
    skipped = 0
    for number, row in numbered:
        try:
            item = row_item(row, data, fmt, tokenizer, eos_id)
        except ValueError as error:
            raise ValueError(f"{where}: {unit} {number}: {error}") from None
        if fmt.max_seq_len is not None and len(item.tokens) > fmt.max_seq_len:
            skipped += 1
            continue
        items.append(item)
    if not items:
        raise ValueError(f"{where}: no examples to train on ({skipped} longer than max_seq_len)")
    return items, skipped


class SFTBatches:
    """Batches of example indices, epoch after epoch (reshuffled with `seed + epoch`, the order
    `DataSource` serves prompts in): `batch_size` examples, or with `batch_tokens` as many as
    fit in that many tokens (at least one). Resumable through `state_dict`."""

    def __init__(
        self,
        lengths: list[int],
        *,
        batch_size: int,
        batch_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.lengths = lengths
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.lengths)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.offset / len(self.lengths)

    def _full(self, batch: list[int], candidate: int) -> bool:
        if self.batch_tokens is None:
            return len(batch) >= self.batch_size
        used = sum(self.lengths[i] for i in batch)
        return bool(batch) and used + self.lengths[candidate] > self.batch_tokens

    def next(self) -> list[int]:
        batch: list[int] = []
        while not self._full(batch, self._order[self.offset]):
            batch.append(self._order[self.offset])
            self.offset += 1
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order()
        return batch

    def steps_for(self, epochs: float) -> int:
        """How many batches, from here, until `epochs` passes over the data are done."""
        probe = SFTBatches(
            self.lengths,
            batch_size=self.batch_size,
            batch_tokens=self.batch_tokens,
            shuffle=self.shuffle,
            seed=self.seed,
        )
        probe.load_state_dict(self.state_dict())
        steps = 0
        while probe.epochs_done < epochs:
            probe.next()
            steps += 1
        return steps

    def state_dict(self) -> dict[str, int]:
        return {"num_examples": len(self.lengths), "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_examples"] != len(self.lengths):
            raise ValueError(
                f"SFT data state was saved with {state['num_examples']} examples, "
                f"but this data has {len(self.lengths)}"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._epoch_order()
