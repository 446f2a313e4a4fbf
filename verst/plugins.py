"""The plug-in contracts of verst.

Every part a run can replace is a `Protocol` here. A config field names a replacement by import
path (`pkg.mod:name`, or `pkg.mod.name`), and `verst.plugin_loader.load_plugin(path, Protocol,
field=...)` imports it, checks it against the Protocol, and raises one `PluginError` that names
the config field, the import path and what is wrong, so a bad plug-in fails when the config is
read, not mid-run.

Wired to config today, the rollout's layers from the outermost in (an outer layer takes over
what the inner ones do): `RolloutFunction` (`rollout.function`), `GenerateFunction`
(`rollout.generate_function`), `AgentFunction` (`rollout.agent_function`); and beside them
`RewardFunction` (`rollout.reward`, `eval.reward`), `GroupRewardFunction`
(`rollout.group_reward`), `SampleFilter` (`rollout.filter`), `Buffer` (`rollout.buffer`),
`AdvantageEstimator` (`loss.advantage_estimator`), `PolicyLoss` (`loss.policy_loss`) and
`CheckpointEvalFunction` (`eval.function`, which may raise `EvalSkip`). `EngineClient` and
`WeightTransport` are the contracts between the trainer and its engines; `EvalFunction` is a
contract no config field loads yet.

Callable contracts take their arguments positionally (`/`): a plug-in may name them as it
likes. This module imports only leaf modules (`verst.types`, the engine's request records and
sampling parameters), so any module may import it without making an import cycle.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from verst.engine.requests import GenerateOutput, GenerateRequest
from verst.engine.sampling import SamplingParams
from verst.types import Group, Sample

if TYPE_CHECKING:
    from prometheus_client.core import Metric

Decode = Callable[[list[int]], str]
"""Token ids -> text (the tokenizer's decode, skipping special tokens)."""

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""A fresh pass over the policy's (name, tensor) pairs, in Hugging Face names."""


@dataclass(frozen=True)
class AdapterUpdate:
    """One LoRA adapter's new weights for the engines' adapter registry, not their model:
    `tensors` are named as in peft's files without the `base_model.model.` prefix
    (`model.layers.0.self_attn.q_proj.lora_A.weight`), `config` holds peft's keys (`r`,
    `lora_alpha`, `target_modules`). Engines create the adapter `name` or replace its weights."""

    name: str
    config: dict[str, Any]
    tensors: NamedTensors


# ---- rewards and filters ----------------------------------------------------------------------


class RewardFunction(Protocol):
    """Scores one finished sample (`rollout.reward`, `eval.reward`).

    Receives the `Sample` with its response filled (text in `metadata["response_text"]`, the
    label in `label`); returns a number, or an awaitable of one (an `async def` reward runs
    concurrently with the others). A reward that raises, returns a non-number or overruns
    `rollout.reward_timeout_s` marks only that sample FAILED, and it is not trained on
    (`verst.rollout.rewards.RewardScorer`).
    """

    def __call__(self, sample: Sample, /) -> float | Awaitable[float]: ...


class GroupRewardFunction(Protocol):
    """Scores a whole group at once (`rollout.group_reward`): a pairwise judge, a reward model
    behind HTTP (the built-in `http`, `verst.rollout.group_reward.HttpGroupScorer`).

    Receives the samples of one prompt that are to be scored (not ABORTED), responses filled;
    returns one number per sample, in the group's order (or an awaitable of that list). It takes
    over from `rollout.reward`. Raising, overrunning `rollout.reward_timeout_s` or returning a
    list of the wrong length fails every sample of the group; an entry that is not a finite
    number fails only its sample.
    """

    def __call__(self, group: Group, /) -> list[float] | Awaitable[list[float]]: ...


class SampleFilter(Protocol):
    """Keeps or drops a scored group (`rollout.filter`; DAPO's dynamic sampling is the built-in
    `reward_variance`, `verst.rollout.dynamic.reward_variance`).

    Receives one group with its rewards set; returns None to keep it, or the reason to drop it
    (short text, e.g. "no reward variance": the ledger records it as `filter: <reason>`, and
    `rollout/filter/drop_<reason>` counts it, spaces made underscores). A dropped group's prompt
    is not served again; the synchronous rollout draws more prompts to fill the batch.
    """

    def __call__(self, group: Group, /) -> str | None: ...


# ---- generation ---------------------------------------------------------------------------------


class Generator(Protocol):
    """What a rollout generates with: the embedded `Scheduler`, a `Fleet` of serving engines,
    or a `RankedFleet` (every rank through rank 0's fleet)."""

    weight_version: int | str

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """One output per request, in request order."""
        ...


class FleetGenerator(Protocol):
    """What one trajectory generates with on serving engines: a `Fleet` (one request at a time,
    on the engine its routing key maps to, so the samples of one prompt share a prefix cache)."""

    async def agenerate(self, request: GenerateRequest, *, key: str | None) -> GenerateOutput: ...


@dataclass
class RolloutContext:
    """What a rollout function works with; built once per run.

    `take(n)` draws `n` prompts from the data source, as groups of `n_samples_per_prompt`
    samples with only the prompt side set (`tokens` = prompt ids, `prompt`, `label`,
    `metadata`); `generate(groups)` fills every sample of `groups` in place with the run's
    engine and sampling parameters (tokens, response_length, loss_mask, rollout_logprobs,
    status, weight_versions, `metadata["response_text"]`), as the plain rollout does;
    `score(groups)` sets rewards with the run's `rollout.reward` or `rollout.group_reward`
    (failures mark samples FAILED); `keep(group)` is the run's `rollout.filter` (None to keep,
    else the reason to drop), or None when no filter is set. `engine` and `decode` are there
    for a function that builds its own requests.
    """

    prompts_per_step: int
    n_samples_per_prompt: int
    take: Callable[[int], list[Group]]
    generate: Callable[[list[Group]], list[Group]]
    score: Callable[[list[Group]], None]
    keep: Callable[[Group], str | None] | None
    engine: Generator
    decode: Decode
    params: SamplingParams


@dataclass
class RolloutRequest:
    """One call of a rollout function: the step and the weight version the engines hold.
    With `prompts` set (an evaluation), generate and score those groups instead of drawing:
    return them all, each sample generated (`verst.eval.rollout_fn`)."""

    step: int
    weight_version: int
    prompts: list[Group] | None = None


@dataclass
class RolloutResult:
    """A rollout function's answer: the groups to train on, flat `rollout/*` metrics, and the
    groups it drew and dropped, each with its reason (recorded like a filter's drops)."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)
    dropped: list[tuple[Group, str]] = field(default_factory=list)


class RolloutFunction(Protocol):
    """Owns one step of the rollout (`rollout.function`): which prompts, how many samples, how
    they are generated, scored and filtered (the plain rollout is `verst.rollout.source.
    EngineRollout`). It takes over from `rollout.generate_function`, `rollout.agent_function`
    and `rollout.dynamic_sampling`; `rollout.reward`, `rollout.group_reward` and
    `rollout.filter` reach it through `context.score` and `context.keep`, to use or not.

    Returns this step's groups; the loop scores any sample still without a reward, trains the
    groups with `rollout.min_scored_samples` scored samples and gives the others' prompts back.
    Synchronous mode only: fully asynchronous mode has no step to own.
    """

    def __call__(self, context: RolloutContext, request: RolloutRequest, /) -> RolloutResult: ...


class GenerateFunction(Protocol):
    """Generates one trajectory (`rollout.generate_function`): the tokens and the episode loop
    of one sample, in both modes; it takes over from `rollout.agent_function`.

    Receives the engine (`await engine.agenerate(request, key=...)`: a `GenerateRequest`, and
    a routing key shared by the samples of one prompt so they share a prefix cache), one
    sample with only its prompt side set, a copy of the sampling parameters and the decode
    function; fills the sample in place (the fields `RolloutContext.generate` fills; tokens the
    model did not sample get loss mask 0) and returns it. Called once per sample, concurrently:
    in synchronous mode the calls that are waiting together go to the engine in one batch. An
    exception marks that sample ABORTED, with the reason in `metadata["abort_error"]`.
    """

    async def __call__(
        self,
        engine: FleetGenerator,
        sample: Sample,
        params: SamplingParams,
        decode: Decode,
        /,
    ) -> Sample: ...


class AgentFunction(Protocol):
    """Plays one multi-turn trajectory through the OpenAI API (`rollout.agent_function`).

    Receives `base_url` (a session's OpenAI endpoint), the sample's `prompt` (text or a message
    list), `request_kwargs` (the sampling settings as `chat.completions.create` arguments) and a
    copy of the sample's `metadata` with its `label`; returns a dict merged into the sample's
    metadata, or None. Must be `async def`: agents share one event loop. The full contract is
    in `verst.rollout.agent`.
    """

    async def __call__(
        self,
        base_url: str,
        prompt: str | list[dict[str, Any]],
        request_kwargs: dict[str, Any],
        metadata: dict[str, Any],
        /,
    ) -> dict[str, Any] | None: ...


class EvalFunction(Protocol):
    """Measures the policy on held-out prompts (the built-in is `verst.eval.evaluate.Evaluator`).

    Receives the engine, the decode function, this rank's held-out prompts (prompt side only,
    in file order), the evaluation's sampling parameters and its reward function; returns flat
    `eval/*` metrics (the built-in gives `eval/accuracy`, `eval/response_len_mean`,
    `eval/num_prompts`), summed over ranks: every rank calls it together.
    """

    def __call__(
        self,
        engine: Generator,
        decode: Decode,
        prompts: list[Sample],
        params: SamplingParams,
        reward: RewardFunction,
        /,
    ) -> dict[str, float]: ...


@dataclass(frozen=True)
class EvalRequest:
    """What an external evaluation is asked to measure: the snapshot of `step`, holding weight
    version `weight_version`, on the run's evaluation sets (`eval.sets` as plain dicts)."""

    step: int
    weight_version: int
    sets: list[dict[str, Any]]


class EvalSkip(Exception):  # noqa: N818 (the name users raise, as in Miles)
    """Raised by an evaluation to skip its point: logged as `eval/skipped_<reason>`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


class CheckpointEvalFunction(Protocol):
    """Scores a saved snapshot (`eval.function`, mode `external`): an HF model directory with a
    `.complete` marker; returns flat scores (names without the `eval/` prefix are given it), or
    raises `EvalSkip(reason)`. Runs in a process of its own, `eval.nice` steps below the
    trainer's CPU priority, one point at a time; its arguments and scores cross a pipe."""

    def __call__(self, checkpoint_dir: str, request: EvalRequest, /) -> dict[str, float]: ...


# ---- the data buffer of fully asynchronous RL ---------------------------------------------------


@runtime_checkable
class Buffer(Protocol):
    """What the rollout worker and the trainer need from a data buffer (`rollout.buffer` names
    its class, built with `verst.rollout.buffer.BUFFER_KWARGS`)."""

    async def put(self, group: Group) -> None:
        """Add a finished, scored group, or drop it; wait while the buffer is full."""
        ...

    async def take(self, n_groups: int, current_version: int) -> list[Group]:
        """Wait for, remove and return `n_groups` groups acceptable at `current_version`."""
        ...

    def metrics(self) -> dict[str, Any]:
        """`buffer/*` metrics; numbers, plus an optional `buffer/advisory` text."""
        ...


# ---- engines and weight sync --------------------------------------------------------------------


@runtime_checkable
class EngineClient(Protocol):
    """One engine, in-process or over SGLang's HTTP protocol (`verst.fleet.client`): SGLang's
    `/generate` request and response dicts, and its control and weight-update calls."""

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """An SGLang `/generate` body (not streamed) → its response body."""
        ...

    async def health(self) -> bool: ...

    async def health_generate(self) -> bool:
        """Whether the engine generates (SGLang's `/health_generate`), not only answers."""
        ...

    async def pause_generation(self, mode: str = "abort") -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> bool: ...

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None: ...

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> dict[str, Any]: ...

    async def get_weight_version(self) -> str: ...

    async def init_weights_update_group(self, **body: Any) -> None:
        """Join the trainer's weight-update group (SGLang's /init_weights_update_group)."""
        ...

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> None:
        """Receive one broadcast bucket (SGLang's /update_weights_from_distributed)."""
        ...

    async def update_weights_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        """Copy in tensors shared as handles (SGLang's /update_weights_from_tensor body:
        `serialized_named_tensors`, `load_format`, ...; see `verst.sync.ipc`)."""
        ...

    async def update_weight_version(self, version: str, *, abort_all: bool = False) -> None:
        """Stamp `version` on the engine (SGLang's /update_weight_version)."""
        ...

    async def get_load(self) -> dict[str, Any]:
        """SGLang's `/v1/loads` body: `{"timestamp", "version", "loads": [per DP rank]}`."""
        ...

    async def metric_families(self) -> list[Metric]:
        """The engine's Prometheus metrics (`GET /metrics`), parsed: verst's and SGLang's use
        SGLang's names (docs/engine_protocol.md, "Metrics")."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Hold the peft adapter directory `path` as LoRA adapter `name`, or replace the weights
        of the one held as `name` (SGLang's /load_lora_adapter); requests pick it by
        `lora_path`."""
        ...

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class WeightTransport(Protocol):
    """Moves weights into engines; the update protocol around it (`verst.sync.protocol`: pause,
    flush, send, stamp the version, continue, confirm) is the same for every transport."""

    async def send(
        self,
        engines: list[EngineClient],
        tensors: NamedTensors,
        version: int,
        adapter: AdapterUpdate | None = None,
    ) -> None:
        """Install `tensors` on `engines`; with `adapter` (LoRA), they are that adapter's
        weights (`adapter.tensors`), for the engines' adapter registry, all in one call."""
        ...


# ---- the algorithm -------------------------------------------------------------------------------


@dataclass
class TokenInputs:
    """What `token_advantages` gets for one micro-batch; per-token tensors are [B, T]."""

    rewards_B: torch.Tensor
    sequence_advantages_B_T: torch.Tensor  # `sequence_advantages` repeated on every token of a row
    mask_B_T: torch.Tensor  # 1 for tokens the model generated, 0 for padding / tool output
    kl_B_T: torch.Tensor  # per-token KL to the reference; zeros when there is none
    values_B_T: torch.Tensor | None  # the critic's values before the update (needs_critic)


class AdvantageEstimator(Protocol):
    """How advantages are computed from rewards (and KL, values), and what that requires
    (`loss.advantage_estimator`; built-ins in `verst.train.algorithms`). `cfg` is the run's
    `loss` config, a `verst.train.algorithms.LossConfig`."""

    group_relative: bool  # relative to the group: needs rollout.n_samples_per_prompt >= 2
    token_level: bool  # token_advantages does real work; kl_coef (KL as reward) applies
    whiten_by_default: bool  # loss.normalize_advantages unset = whiten over the batch
    needs_critic: bool  # the trainer trains a value model and passes its values
    needs_reference: bool  # the trainer keeps a frozen reference and passes the KL to it
    default_policy_loss: str  # the policy loss when loss.policy_loss is unset

    def sequence_advantages(
        self, rewards_B: torch.Tensor, group_ids_B: torch.Tensor, cfg: Any
    ) -> torch.Tensor:
        """One advantage per sample; samples sharing a group id form a group."""
        ...

    def token_advantages(
        self, inputs: TokenInputs, cfg: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Advantages [B, T] and, with a critic, the returns [B, T] it is trained towards.
        Masked positions are zeroed by the caller."""
        ...


class PolicyLoss(Protocol):
    """The policy-gradient loss per token, to be weighted (TIS/MIS) and aggregated
    (`loss.policy_loss`; `cfg` is the run's `loss` config)."""

    def __call__(
        self,
        logprobs_B_T: torch.Tensor,
        old_logprobs_B_T: torch.Tensor,
        advantages_B_T: torch.Tensor,
        mask_B_T: torch.Tensor,
        cfg: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss_B_T to minimise, clipped_B_T: 1.0 where a clip stops the gradient)."""
        ...
