"""What a request must satisfy before the serving engine queues it: each check raises
ValueError naming the field (the HTTP layer answers 400 with the message)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from verst.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from verst.engine.scheduler import Scheduler


def check_request(
    scheduler: Scheduler,
    vocab_size: int,
    input_ids: list[int],
    params: SamplingParams,
    lora_path: str | None = None,
    *,
    top_logprobs_num: int = 0,
    token_ids_logprob: list[int] | None = None,
    return_routed_experts: bool = False,
) -> None:
    """Raise ValueError for a request `scheduler` cannot run (`vocab_size`: the model's, 0
    where unknown: token ids are then not checked against it)."""
    params.validate()
    if return_routed_experts and scheduler.runner.routing is None:
        raise ValueError(
            "return_routed_experts: the model has no mixture-of-experts layers to report"
        )
    check_logprob_options(vocab_size, top_logprobs_num, token_ids_logprob)
    if lora_path is not None:
        scheduler.adapter_registry().slot(lora_path)  # AdapterError names the held ones
    if not input_ids:
        raise ValueError("input_ids must be non-empty")
    if vocab_size and (min(input_ids) < 0 or max(input_ids) >= vocab_size):
        bad = next(t for t in input_ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.constraint is not None:
        scheduler.grammar_matcher(params.constraint)  # compiles it (then cached)
    vocab = scheduler.penalties.vocab
    outside = [t for t in params.logit_bias if t >= vocab]
    if outside:
        raise ValueError(f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab})")


def check_logprob_options(vocab_size: int, top_k: int, token_ids: list[int] | None) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_logprobs_num must be an int >= 0, got {top_k!r}")
    if vocab_size and top_k > vocab_size:
        raise ValueError(f"top_logprobs_num ({top_k}) is larger than the vocabulary ({vocab_size})")
    for token_id in token_ids or ():
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise ValueError("token_ids_logprob must be a flat list of integers.")
        if token_id < 0 or (vocab_size and token_id >= vocab_size):
            raise ValueError(
                f"token_ids_logprob contains out-of-vocabulary token id {token_id}; "
                f"valid range is [0, {vocab_size})."
            )
