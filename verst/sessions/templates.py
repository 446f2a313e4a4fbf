"""Token-in-token-out (TITO) multi-turn tokenisation over a Hugging Face chat template.

The trainer must see exactly the tokens the policy saw and sampled, so a multi-turn conversation
is never re-tokenised: the first turn is rendered in full (`render_prompt`), the model's output
ids are kept verbatim, and each later batch of user/tool/system messages is turned into only the
ids to append (`extend`). `extend` renders the new messages behind a dummy system + dummy
assistant pair, takes the text difference, and fixes the junction after the model's last output
(the end-of-turn token the model emitted, or did not emit because it was truncated, and what
the template writes after it, e.g. ChatML's "\\n").

Where a template is append-only, prompt + outputs + extensions equal `canonical` (a full
re-render) token for token. Where it is not (templates that drop earlier reasoning, trim
whitespace, ...), the assembled ids still hold what the model saw, and `mismatch` counts the
differences by kind. See docs/chat_templates.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from verst.chat.families import FAMILIES, detect_family, get_family, template_messages

Message = dict[str, Any]
MISMATCH_TYPES = (
    "special_token_count",
    "special_token_type",
    "non_assistant_text",
    "assistant_text",
)
APPENDABLE_ROLES = frozenset({"user", "tool", "system"})

# Content the template must print verbatim; no whitespace so that `| trim` cannot alter it.
_DUMMY_SYSTEM: Message = {"role": "system", "content": "VERST_DUMMY_SYSTEM"}
_DUMMY_ASSISTANT: Message = {"role": "assistant", "content": "VERST_DUMMY_ASSISTANT"}

# A ChatML-based tool-calling template with Qwen2.5's conventions: tools listed in the system
# prompt, `<tool_call>{json}</tool_call>` in assistant turns, and consecutive `tool` messages
# grouped into one user turn of `<tool_response>` blocks. Works with `build_char_tokenizer()`.
CHATML_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures, within "
    "<tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with the function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TurnFormat:
    """How the template frames an assistant turn, read off a dummy render (and the family).

    `header` precedes the assistant's content ("<|im_start|>assistant\\n"; None when it cannot be
    read off); `close` follows it ("<|im_end|>\\n"); `end_of_turn` is the token the model stops
    on (close's first token). `stop_ids` are every token that ends a turn (end_of_turn first,
    then the family's `stops`); `openers` are the strings after which assistant text starts
    (the header and the family's openers) and `stops` those that end it, for `mismatch`.
    """

    header: str | None
    close: str
    end_of_turn: str
    end_of_turn_id: int
    stop_ids: tuple[int, ...] = ()
    openers: tuple[str, ...] = ()
    stops: tuple[str, ...] = ()


class ChatTokenizer:
    """Incremental multi-turn tokenisation that never re-tokenises earlier turns.

    `family` is a name in `verst.chat.FAMILIES` (qwen3, chatml, llama3, glm4, deepseek_v3,
    mistral, default); None detects it from the template. A named family asserts its junction
    rule (the text after an assistant turn) against the template and raises if it differs; an
    auto-detected family that does not match falls back to "default", which reads the rule off
    the template itself. The family also gives the stop tokens, where assistant text starts and
    ends, and the tool-call format (`tool_parser`). `template_kwargs` go to every render (e.g.
    `enable_thinking=False`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        family: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not tokenizer.chat_template or not isinstance(tokenizer.chat_template, str):
            raise ValueError("the tokenizer has no (single) chat template to render with")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        read = self._read_turn_format()
        detected = family is None
        name = detect_family(tokenizer.chat_template) if detected else get_family(family).name
        expected_close = FAMILIES[name].close
        if expected_close is not None and read.close != expected_close:
            if not detected:
                raise ValueError(
                    f"family {name!r} expects {expected_close!r} after an assistant turn "
                    f"but this template writes {read.close!r}; use family='default'"
                )
            name = "default"
        self.family = name
        self.format = self._with_family(read)
        self.special_ids = frozenset(tokenizer.all_special_ids) | {
            i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special
        }

    @property
    def tool_parser(self) -> str:
        """The tool-call format of the family (a key of `verst.chat.TOOL_PARSERS`)."""
        return FAMILIES[self.family].tool_parser

    def _with_family(self, read: TurnFormat) -> TurnFormat:
        """The read-off format completed with what the family knows: its stop tokens, and
        where assistant text starts and ends when the generation prompt cannot tell."""
        family = FAMILIES[self.family]
        stop_ids = [read.end_of_turn_id]
        for stop in family.stops:
            ids = self.encode(stop)
            if len(ids) != 1:
                raise ValueError(
                    f"family {family.name!r} stops on {stop!r}, which this tokenizer does not "
                    f"have as one token (it encodes to {ids})"
                )
            stop_ids += [i for i in ids if i not in stop_ids]
        openers = ((read.header,) if read.header else ()) + family.openers
        return TurnFormat(
            read.header,
            read.close,
            read.end_of_turn,
            read.end_of_turn_id,
            tuple(stop_ids),
            tuple(dict.fromkeys(openers)),
            tuple(dict.fromkeys((read.end_of_turn, *family.stops, *family.turn_starts))),
        )

    # -- rendering ------------------------------------------------------------------------

    def _render(
        self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            template_messages(messages),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        """Ids of `text` with no BOS/EOS added (the template writes those itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _read_turn_format(self) -> TurnFormat:
        base = self._render([_DUMMY_SYSTEM, _DUMMY_ASSISTANT], None, add_generation_prompt=False)
        sys_end = base.find(_DUMMY_SYSTEM["content"]) + len(_DUMMY_SYSTEM["content"])
        asst_at = base.rfind(_DUMMY_ASSISTANT["content"])
        if sys_end < len(_DUMMY_SYSTEM["content"]) or asst_at < sys_end:
            raise ValueError("the chat template does not print system/assistant content verbatim")
        close = base[asst_at + len(_DUMMY_ASSISTANT["content"]) :]
        close_ids = self.encode(close)
        if close_ids:
            end_of_turn_id = close_ids[0]
        elif self.tokenizer.eos_token_id is not None:
            end_of_turn_id = self.tokenizer.eos_token_id
        else:
            raise ValueError("the template closes assistant turns with nothing and has no EOS")
        end_of_turn = self.tokenizer.decode([end_of_turn_id], skip_special_tokens=False)
        # The assistant header is the longest start of the generation prompt that also ends the
        # text before the dummy assistant's content; Qwen3's "no thinking" prompt, for one,
        # adds an empty <think> block that history turns do not carry.
        with_prompt = self._render([_DUMMY_SYSTEM, _DUMMY_ASSISTANT], None, True)
        gen_prompt = with_prompt[len(base) :] if with_prompt.startswith(base) else ""
        before = base[sys_end:asst_at]
        header = next(
            (
                gen_prompt[:k]
                for k in range(len(gen_prompt), 0, -1)
                if before.endswith(gen_prompt[:k])
            ),
            None,
        )
        return TurnFormat(header, close, end_of_turn, end_of_turn_id)

    # -- the TITO API ---------------------------------------------------------------------

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The first turn's ids: the whole template with the generation prompt."""
        if not messages:
            raise ValueError("render_prompt needs at least one message")
        return self.encode(self._render(messages, tools, add_generation_prompt=True))

    def extend(
        self,
        prev_ids: list[int],
        new_messages: list[Message],
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The ids to append after `prev_ids` for `new_messages`, ending with the gen prompt.

        `prev_ids` end with the model's last output, with or without its end-of-turn token (a
        truncated output has none; it is closed here). `new_messages` are user, tool or system
        messages: assistant turns only enter the history as the model's own output ids.
        """
        if not prev_ids:
            raise ValueError("extend needs the ids so far; use render_prompt for the first turn")
        if not new_messages:
            raise ValueError("extend needs at least one new message")
        for m in new_messages:
            if m.get("role") not in APPENDABLE_ROLES:
                raise ValueError(
                    f"cannot append a {m.get('role')!r} message: history is append-only and "
                    f"assistant turns come from the model's output ids; allowed: "
                    f"{sorted(APPENDABLE_ROLES)}"
                )
        dummies = [_DUMMY_SYSTEM, _DUMMY_ASSISTANT]
        base = self._render(dummies, tools, add_generation_prompt=False)
        full = self._render(dummies + list(new_messages), tools, add_generation_prompt=True)
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders earlier messages differently once new ones follow; "
                "it cannot be extended incrementally"
            )
        ids = self.encode(self._junction(prev_ids) + full[len(base) :])
        if not self.format.close and ids and ids[0] == prev_ids[-1] in self.format.stop_ids:
            return ids[1:]  # GLM-4: the token the model stopped on opens the next message
        return ids

    def _junction(self, prev_ids: list[int]) -> str:
        """The part of the assistant turn's close that `prev_ids` are still missing."""
        fmt = self.format
        close_ids = self.encode(fmt.close)
        if close_ids and prev_ids[-len(close_ids) :] == close_ids:
            return ""
        if prev_ids[-1] == fmt.end_of_turn_id and fmt.close.startswith(fmt.end_of_turn):
            return fmt.close[len(fmt.end_of_turn) :]
        return fmt.close

    def canonical(
        self,
        messages: list[Message],
        tools: list[dict] | None = None,
        add_generation_prompt: bool | None = None,
    ) -> list[int]:
        """A full re-render of the conversation; the generation prompt by default iff the last
        message is not the assistant's."""
        if add_generation_prompt is None:
            add_generation_prompt = messages[-1].get("role") != "assistant"
        return self.encode(self._render(messages, tools, add_generation_prompt))

    # -- checking -------------------------------------------------------------------------

    def mismatch(
        self,
        assembled_ids: list[int],
        messages: list[Message],
        tools: list[dict] | None = None,
        generated: list[bool] | None = None,
    ) -> dict[str, int]:
        """Differences between assembled ids and `canonical(messages)`, counted by kind.

        Both sequences are cut into special tokens and the runs of ordinary tokens between them.
        `special_token_count`: the two cuts do not line up (reported alone, since nothing can be
        aligned then); `special_token_type`: a special token differs at the same place;
        `assistant_text` / `non_assistant_text`: a run of ordinary tokens differs, inside an
        assistant turn or elsewhere. Runs are compared by ids, so a different tokenisation of
        the same text counts too. All zero iff the sequences are equal. When the conversation
        ends with the assistant, its end-of-turn close is ignored on both sides.

        `generated` (one flag per assembled id: the model sampled it): when the cuts do not line
        up but do once the special tokens the model wrote inside its answers (other than a
        turn's end) are left out, those tokens are what differs: the messages cannot carry them
        (their text drops them), so each counts as `assistant_text` instead.
        """
        canonical_ids = self.canonical(messages, tools)
        counts = self._compare(canonical_ids, list(assembled_ids), messages)
        if not counts["special_token_count"] or generated is None:
            return counts
        keep = [
            not (made and i in self.special_ids and i not in self.format.stop_ids)
            for i, made in zip(assembled_ids, generated, strict=True)
        ]
        stripped = [i for i, kept in zip(assembled_ids, keep, strict=True) if kept]
        retry = self._compare(canonical_ids, stripped, messages)
        if retry["special_token_count"]:
            return counts
        retry["assistant_text"] += keep.count(False)
        return retry

    def _compare(
        self, canonical_ids: list[int], assembled_ids: list[int], messages: list[Message]
    ) -> dict[str, int]:
        counts = dict.fromkeys(MISMATCH_TYPES, 0)
        if messages and messages[-1].get("role") == "assistant":
            canonical_ids = self._strip_close(canonical_ids)
            assembled_ids = self._strip_close(assembled_ids)
        exp, act = self._segments(canonical_ids), self._segments(assembled_ids)
        if [s for s, _ in exp] != [s for s, _ in act]:
            n_exp = sum(s for s, _ in exp)
            n_act = sum(s for s, _ in act)
            counts["special_token_count"] = max(abs(n_exp - n_act), 1)
            return counts
        exp_assistant = self._assistant_flags(exp)
        act_assistant = self._assistant_flags(act)
        for i, ((special, e), (_, a)) in enumerate(zip(exp, act, strict=True)):
            if e == a:
                continue
            if special:
                counts["special_token_type"] += 1
            elif exp_assistant[i] and act_assistant[i]:
                counts["assistant_text"] += 1
            else:
                counts["non_assistant_text"] += 1
        return counts

    def _strip_close(self, ids: list[int]) -> list[int]:
        close_ids = self.encode(self.format.close)
        if close_ids and ids[-len(close_ids) :] == close_ids:
            return ids[: -len(close_ids)]
        if ids and ids[-1] in self.format.stop_ids:
            return ids[:-1]
        return ids

    def _segments(self, ids: list[int]) -> list[tuple[bool, list[int]]]:
        """(is_special, ids) runs: each special token alone, ordinary tokens grouped."""
        segments: list[tuple[bool, list[int]]] = []
        for i in ids:
            if i in self.special_ids:
                segments.append((True, [i]))
            elif segments and not segments[-1][0]:
                segments[-1][1].append(i)
            else:
                segments.append((False, [i]))
        return segments

    def _assistant_flags(self, segments: list[tuple[bool, list[int]]]) -> list[bool]:
        """Whether each ordinary run overlaps an assistant turn's content: from an opener (the
        header, or a family's other opener) to the first string that ends a turn after it.

        An empty content (a turn the template renders as its header and close alone, e.g. a
        tool-calling turn in a template that prints only `content`) still belongs to the run
        that touches it: the header's run, where the other side has the model's text."""
        openers, stops = self.format.openers, self.format.stops
        if not openers:
            return [False] * len(segments)
        texts = [self.tokenizer.decode(ids, skip_special_tokens=False) for _, ids in segments]
        full = "".join(texts)
        regions: list[tuple[int, int]] = []
        for opener in openers:
            at = full.find(opener)
            while at >= 0:
                start = at + len(opener)
                ends = [e for e in (full.find(s, start) for s in stops) if e >= 0]
                end = min(ends, default=len(full))
                regions.append((start, end))
                at = full.find(opener, max(end, start))
        flags, offset = [], 0
        for (special, _), text in zip(segments, texts, strict=True):
            lo, hi = offset, offset + len(text)
            flags.append(
                not special
                and any((lo < e and s < hi) or (s == e and lo <= s <= hi) for s, e in regions)
            )
            offset = hi
        return flags
