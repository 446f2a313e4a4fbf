"""The FSDP2 policy trainer: turns a batch of scored Samples into one optimiser step.

Promises: the model is sharded with `fully_shard` (a world of one in a plain process, N ranks
under torchrun); a batch is cut into micro-batches by a padded-token budget and the summed
micro-batch losses equal the loss of the whole batch; a non-finite loss or gradient norm raises
`NonFiniteLossError` before the optimiser touches the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from pydantic import Field
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verst.configbase import ConfigBase
from verst.models.forward import cached_forward, new_cache
from verst.train import distributed
from verst.train.batching import (
    MicroBatch,
    TrainItem,
    balance_micro_batches,
    collate,
    masked_out,
    pack_micro_batches,
)
from verst.train.losses import (
    LossConfig,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    policy_loss,
)


class TrainerConfig(ConfigBase):
    lr: float = Field(1e-6, gt=0, description="peak learning rate of AdamW")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="decay after warm-up, down to min_lr_ratio × lr at the last step"
    )
    lr_warmup_steps: int = Field(0, ge=0, description="steps of linear learning-rate warm-up")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm; 0 disables")
    micro_batch_tokens: int = Field(
        16384, ge=1, description="token budget per micro-batch (padded length × sequences)"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute dtype; auto = bfloat16 on CUDA, float32 on CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="training device; auto = CUDA when available"
    )


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm is NaN/inf; the weights were not updated."""


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _lr_lambda(cfg: TrainerConfig, total_steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.lr_warmup_steps:
            return (step + 1) / cfg.lr_warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(total_steps - cfg.lr_warmup_steps, 1)
        progress = min((step - cfg.lr_warmup_steps) / span, 1.0)
        if cfg.lr_schedule == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return factor


def _shard(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # an explicit mesh: fully_shard's default mesh is on CUDA whenever CUDA is available,
    # which would move a model meant for the CPU
    mesh = init_device_mesh(device.type, (distributed.world_size(),))
    # a world of one holds whole parameters anyway: resharding after forward would only
    # repeat the (copying) all-gather in the next forward and in backward
    # (and needs no per-layer groups, whose only purpose is to bound gathered memory)
    sharded = distributed.world_size() > 1
    layers = getattr(getattr(model, "model", None), "layers", None) if sharded else None
    for layer in layers or []:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=sharded)


class Trainer:
    """Owns the sharded policy, its optimiser and schedule, and an optional frozen reference."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        loss_cfg: LossConfig,
        *,
        total_steps: int,
        pad_token_id: int,
        temperature: float = 1.0,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.loss_cfg = loss_cfg
        self.device = device
        self.dtype = compute_dtype(cfg.dtype, device)
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        distributed.init_distributed(device)
        model.to(device=device, dtype=torch.float32)  # master weights stay fp32
        model.train()
        _shard(model, self.dtype, device)
        self.model = model
        self.optimizer = self.make_optimizer(cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(cfg, total_steps)
        )
        self.reference: torch.nn.Module | None = None

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=lr,
            betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
            eps=self.cfg.adam_eps,
            foreach=True,
            weight_decay=self.cfg.weight_decay,
        )

    def set_reference(self, reference: torch.nn.Module) -> None:
        """Freeze `reference` (an unsharded copy of the policy) for the KL term."""
        reference.load_state_dict(self.full_state_dict())
        reference.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.reference = reference

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 weights on the CPU (a collective: every rank must call it)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def named_local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's shard of each parameter, as plain tensors sharing the trainer's storage."""
        for name, param in self.model.named_parameters():
            data = param.data
            yield name, data.to_local() if isinstance(data, DTensor) else data

    # --- forward -------------------------------------------------------------------------------

    def _logits(self, model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
        """Temperature-scaled fp32 logits [N, R, V]; position j predicts response token j."""
        cache = new_cache(model)
        prompt_positions = (micro.prompt_mask_K_P.cumsum(-1) - 1).clamp(min=0)
        last_K_1_V = cached_forward(
            model,
            micro.prompt_ids_K_P,
            micro.prompt_mask_K_P,
            prompt_positions,
            cache,
            last_only=True,
        )
        index_N = micro.prompt_index_N
        first_N_1_V = last_K_1_V[index_N]
        width_r = micro.response_ids_N_R.shape[1]
        if width_r == 1:
            return first_N_1_V.float() / self.temperature
        # The last response token predicts nothing we train on, and nothing attends to it:
        # only tokens 0..R-2 need a forward pass.
        cache.batch_select_indices(index_N)  # each response continues its own prompt's KV
        prompt_lengths_N_1 = micro.prompt_mask_K_P.sum(-1, keepdim=True)[index_N]
        positions_N_T = prompt_lengths_N_1 + torch.arange(width_r - 1, device=self.device)
        mask_N_S = torch.cat(
            [micro.prompt_mask_K_P[index_N], micro.response_mask_N_R[:, :-1]], dim=1
        )
        response_logits = cached_forward(
            model, micro.response_ids_N_R[:, :-1], mask_N_S, positions_N_T, cache
        )
        logits = torch.cat([first_N_1_V, response_logits], dim=1)
        return logits.float() / self.temperature

    def _micro_batches(self, items: list[TrainItem]) -> Iterator[tuple[bool, MicroBatch]]:
        """Micro-batches within the token budget; every rank yields the same number of them,
        since each one is a round of FSDP collectives (a rank short of items repeats one with
        its loss mask zeroed)."""
        lengths = [len(item.tokens) for item in items]
        count = distributed.all_reduce_max(
            len(pack_micro_batches(lengths, self.cfg.micro_batch_tokens)), self.device
        )
        for position, indices in enumerate(balance_micro_batches(lengths, count)):
            batch = [items[i] for i in indices] or [masked_out(items[0])]
            yield position == count - 1, collate(batch, self.pad_token_id, self.device)

    def _global_counts(self, items: list[TrainItem]) -> tuple[float, float]:
        """Masked tokens and sequences over all ranks, divided by the world size.

        FSDP averages gradients over ranks, so each rank normalises by its share of the global
        count and the averaged gradient equals that of one big batch.
        """
        tokens = float(sum(sum(item.loss_mask) for item in items))
        tokens, sequences = distributed.all_reduce_sum([tokens, float(len(items))], self.device)
        world = distributed.world_size()
        return max(tokens, 1.0) / world, max(sequences, 1.0) / world

    # --- steps ---------------------------------------------------------------------------------

    def step(self, items: list[TrainItem], *, step: int) -> dict[str, float]:
        """One RL optimiser step on this rank's items; returns metrics averaged over all ranks."""
        token_norm, seq_norm = self._global_counts(items)
        sums: dict[str, float] = {}
        for is_last, micro in self._micro_batches(items):
            self.model.set_requires_gradient_sync(is_last)
            loss, stats = self._rl_loss(micro, token_norm, seq_norm)
            loss.backward()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
        grad_norm = self._clip_and_check(sums["loss"], step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        world = distributed.world_size()
        reduced = distributed.all_reduce_sum(list(sums.values()), self.device)
        metrics = {f"train/{k}": v / world for k, v in zip(sums, reduced, strict=True)}
        metrics["train/grad_norm"] = grad_norm
        metrics["train/lr"] = lr
        return metrics

    def _rl_loss(
        self, micro: MicroBatch, token_norm: float, seq_norm: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the batch loss, and its share of each metric."""
        cfg = self.loss_cfg
        mask = micro.loss_mask_N_R

        def reduce(values_B_T: torch.Tensor) -> torch.Tensor:
            return aggregate(
                values_B_T,
                mask,
                cfg.loss_aggregation,
                token_normaliser=token_norm,
                num_sequences=seq_norm,
            )

        logits = self._logits(self.model, micro)
        logprobs = logprobs_from_logits(logits, micro.response_ids_N_R)
        pg, clipped = policy_loss(
            logprobs,
            micro.rollout_logprobs_N_R,
            micro.advantages_N_R,
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.clip_high,
        )
        loss = reduce(pg)
        stats = {"pg_loss": loss.item()}
        if cfg.kl_loss_coef > 0:
            if self.reference is None:
                raise RuntimeError("loss.kl_loss_coef > 0 but no reference model was set")
            with torch.no_grad():
                ref_logits = self._logits(self.reference, micro)
                ref_logprobs = logprobs_from_logits(ref_logits, micro.response_ids_N_R)
            kl = reduce(kl_penalty(logprobs, ref_logprobs, cfg.kl_loss_type))
            loss = loss + cfg.kl_loss_coef * kl
            stats["kl_loss"] = kl.item()
        if cfg.entropy_coef > 0:
            entropy = reduce(entropy_from_logits(logits))
            loss = loss - cfg.entropy_coef * entropy
            stats["entropy"] = entropy.item()
        with torch.no_grad():
            diff_B_T = (logprobs - micro.rollout_logprobs_N_R).abs()
            stats["pg_clipfrac"] = ((clipped * mask).sum() / token_norm).item()
            stats["train_rollout_logprob_abs_diff"] = ((diff_B_T * mask).sum() / token_norm).item()
        stats["loss"] = loss.item()
        return loss, stats

    def sft_step(
        self, items: list[TrainItem], optimizer: torch.optim.Optimizer, *, step: int
    ) -> float:
        """One supervised step: mean negative log-likelihood of the masked tokens."""
        token_norm, _ = self._global_counts(items)
        total = 0.0
        for is_last, micro in self._micro_batches(items):
            self.model.set_requires_gradient_sync(is_last)
            logprobs = logprobs_from_logits(self._logits(self.model, micro), micro.response_ids_N_R)
            loss = -(logprobs * micro.loss_mask_N_R).sum() / token_norm
            loss.backward()
            total += loss.item()
        self._clip_and_check(total, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return distributed.all_reduce_sum([total], self.device)[0] / distributed.world_size()

    def _clip_and_check(self, loss: float, step: int) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; "
                "the weights were not updated"
            )
        return grad_norm

    # --- checkpoint state -----------------------------------------------------------------------

    def optimizer_state(self) -> dict:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state(self, weights: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, weights, options=options)
        if optimizer_state is not None:
            set_optimizer_state_dict(
                self.model, self.optimizer, optimizer_state["optimizer"], options=options
            )
            self.scheduler.load_state_dict(optimizer_state["scheduler"])
