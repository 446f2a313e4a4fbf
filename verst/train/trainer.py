"""The FSDP2 policy trainer: turns a batch of scored Samples into one optimiser step.

Promises: the model is sharded with `fully_shard` (a world of one in a plain process, N ranks
under torchrun); a batch is cut into micro-batches by a padded-token budget and the summed
micro-batch losses equal the loss of the whole batch; a non-finite loss or gradient norm raises
`NonFiniteLossError` before the optimiser touches the weights.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verst import distributed
from verst.models import lora
from verst.models.invariant_forward import covers
from verst.models.moe import routing_shape
from verst.monitor.mfu import mfu_metrics
from verst.monitor.timer import PhaseTimer
from verst.sync.buckets import full_parameters
from verst.train.activation_checkpointing import checkpoint_layers
from verst.train.algorithms import LossConfig
from verst.train.batching import (
    MicroBatch,
    TrainItem,
    collate,
    masked_out,
    micro_batch_indices,
    pack_micro_batches,
    response_outputs,
)
from verst.train.checkpoint_state import CheckpointState
from verst.train.critic import ValueModel, policy_body_weights
from verst.train.liger import apply_liger
from verst.train.losses import aggregate, kl_penalty, value_loss
from verst.train.objective import (
    Normalisers,
    needs_advantage_pass,
    policy_objective,
    set_token_advantages,
    whiten_globally,
)
from verst.train.offload import OptimizerOffload
from verst.train.on_policy import invariant_scores
from verst.train.routing_replay import RoutingReplay, require_moe, routed_calls
from verst.train.sft_loss import EVAL_SUMS, SFT_TEMPERATURE, eval_metrics, eval_sums, nll_loss
from verst.train.token_logprobs import response_scores
from verst.train.trainer_config import (
    NonFiniteLossError,
    TrainerConfig,
    _lr_lambda,
    compute_dtype,
)


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


class Trainer(CheckpointState):
    """Owns the sharded policy, its optimiser and schedule, an optional frozen reference, and
    for PPO a sharded critic with its own optimiser."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        loss_cfg: LossConfig,
        *,
        total_steps: int,
        pad_token_id: int,
        temperature: float = 1.0,
        constant_normaliser: float = 1.0,
        device: torch.device,
        adapter_lrs: dict[str, float] | None = None,
    ) -> None:
        """`adapter_lrs` (multi-LoRA): the learning rate of each LoRA adapter of `model`, each
        given an optimizer and schedule of its own; a step trains each adapter on its items."""
        self.cfg = cfg
        self.loss_cfg = loss_cfg
        self.device = device
        self.dtype = compute_dtype(cfg.dtype, device)
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.constant_normaliser = constant_normaliser
        self.total_steps = total_steps
        distributed.init_distributed(device)
        if cfg.true_on_policy:
            reason = covers(model, device)
            if reason is not None:
                raise ValueError(f"trainer.true_on_policy cannot be guaranteed with {reason}")
        # MoE: routing recorded at rollout is replayed (loss.routing_replay) or compared with
        self.routing_shape = require_moe(model) if loss_cfg.routing_replay else routing_shape(model)
        self.routing = None
        if self.routing_shape is not None:
            self.routing = RoutingReplay(model, replay=loss_cfg.routing_replay)
        if cfg.gradient_checkpointing:
            checkpoint_layers(model)
        if cfg.kernels == "liger":
            apply_liger(model, device)
        model.to(device=device, dtype=torch.float32)  # master weights stay fp32
        model.train()
        # with LoRA (`verst.models.lora.apply_lora`), the adapted modules' scales; else empty
        self.lora_scalings = lora.scalings(model)
        self.lora = lora.has_lora(model)
        if self.lora:  # a frozen base needs no fp32 master: it stays in the compute dtype
            for param in model.parameters():
                if not param.requires_grad:
                    param.data = param.data.to(self.dtype)
        _shard(model, self.dtype, device)
        self.model = model
        # what the optimizers step (with LoRA, the adapters): the very objects, for pushes that
        # would otherwise walk the whole module tree (thousands of modules with peft's layers)
        self.trainable_parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = self.make_optimizer(cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(cfg, total_steps)
        )
        self.adapter_optimizers = {
            name: self._adapter_optimizer(name, lr) for name, lr in (adapter_lrs or {}).items()
        }
        self.stepped_adapters: list[str] = []  # multi-LoRA: the adapters the last step trained
        self.offload = self._optimizer_offload(cfg, device)
        self.reference: torch.nn.Module | None = None
        self.critic: torch.nn.Module | None = None
        # the current step's forward / backward / optimizer times (`perf/train_*_time_s`)
        self.timer = PhaseTimer(device=device)

    def _optimizer_offload(
        self, cfg: TrainerConfig, device: torch.device
    ) -> OptimizerOffload | None:
        if cfg.offload == "none":
            return None
        if device.type != "cuda":
            raise ValueError(
                f"trainer.offload={cfg.offload} moves optimizer state off the GPU; on the "
                f"{device.type} it is in host memory already"
            )
        return OptimizerOffload(self._optimizers, device)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        adapters = [optimizer for optimizer, _ in self.adapter_optimizers.values()]
        critic = [self.critic_optimizer] if self.critic is not None else []
        return [self.optimizer, *adapters, *critic]

    def make_optimizer(
        self,
        lr: float,
        model: torch.nn.Module | None = None,
        params: list[torch.nn.Parameter] | None = None,
    ) -> torch.optim.Optimizer:
        """AdamW over `params`, else over the trainable parameters of `model` (the policy by
        default; with LoRA: the adapters): only they get optimiser state."""
        if params is None:
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
        # on CUDA the fused kernel: foreach's intermediates would take another copy of the
        # weights' size at the step (28 GB at 7B parameters), and it is faster
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(
            params,
            lr=lr,
            betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
            eps=self.cfg.adam_eps,
            foreach=not fused,
            fused=fused,
            weight_decay=self.cfg.weight_decay,
        )

    def _adapter_optimizer(
        self, name: str, lr: float
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        params = [p for n, p in self.model.named_parameters() if lora.is_adapter(n, name)]
        if not params:
            raise ValueError(f"model.lora.adapters: the model carries no adapter {name!r}")
        optimizer = self.make_optimizer(lr, params=params)
        schedule = _lr_lambda(self.cfg, self.total_steps)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    def set_reference(
        self, shell: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Freeze an unsharded copy of `shell` (the HF policy) holding `weights` (HF names;
        default: the policy's now) as the reference of the KL terms, on every rank (a
        collective: a full state dict is rank 0's alone, so rank 0's copy is broadcast)."""
        reference = copy.deepcopy(shell)
        weights = self.full_state_dict() if weights is None else weights
        if weights or distributed.rank() == 0:
            reference.load_state_dict(weights)
        reference.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        distributed.broadcast_from_rank0(reference)
        self.reference = reference

    def attach_critic(self, critic: ValueModel) -> None:
        """Train `critic` (unsharded; its body starts as the policy's current body, rank 0's
        full state dict broadcast to every rank before sharding) for PPO."""
        critic.load_state_dict(policy_body_weights(self.full_state_dict()), strict=False)
        if self.cfg.gradient_checkpointing:
            checkpoint_layers(critic.model)
        critic.to(device=self.device, dtype=torch.float32).train()
        distributed.broadcast_from_rank0(critic)
        _shard(critic, self.dtype, self.device)
        self.critic = critic
        self.critic_optimizer = self.make_optimizer(self.cfg.critic_lr or self.cfg.lr, critic)
        self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.critic_optimizer, _lr_lambda(self.cfg, self.total_steps)
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 weights on the CPU, named as in the plain HF model (with LoRA, the
        adapters merged in); a collective: every rank must call it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=options)
        return lora.merged_weights(weights, self.lora_scalings) if self.lora else weights

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters, unsharded, on the CPU (a collective: every rank must call it)."""
        return {
            name: (param.data.full_tensor() if isinstance(param.data, DTensor) else param.data)
            .detach()
            .cpu()
            .clone()
            for name, param in self.model.named_parameters()
            if lora.is_adapter(name)
        }

    def full_parameters(
        self, dtype: torch.dtype | None = None, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter as a full tensor, one at a time (`verst.sync.buckets.full_parameters`:
        a gather per tensor, a collective every rank joins)."""
        return full_parameters(self.model, dtype, keep=keep)

    def named_local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's shard of each parameter, as plain tensors sharing the trainer's storage."""
        for name, param in self.model.named_parameters():
            data = param.data
            yield name, data.to_local() if isinstance(data, DTensor) else data

    # --- forward -------------------------------------------------------------------------------

    def _replaying(self, model: torch.nn.Module, micro: MicroBatch) -> Any:
        """The policy's MoE layers replaying the rollout's experts under loss.routing_replay."""
        routing = self.routing if model is self.model else None
        calls = micro.routed_calls
        return routing.feeding(calls) if routing and calls else contextlib.nullcontext()

    def _logits(
        self, model: torch.nn.Module, micro: MicroBatch, temperature: float | None = None
    ) -> torch.Tensor:
        """fp32 logits [B, T, V] at `temperature` (default: the sampling one); position j
        predicts response token j."""
        with self._replaying(model, micro):
            return response_outputs(model, micro).float() / (temperature or self.temperature)

    def _scores(
        self,
        model: torch.nn.Module,
        micro: MicroBatch,
        *,
        entropy_grad: bool = False,
        temperature: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (log-prob, entropy) [B, T] of each response token at `temperature` (default:
        the sampling one)."""
        temperature = temperature or self.temperature
        if self.cfg.true_on_policy:
            return invariant_scores(model, micro, temperature, self.pad_token_id)
        chunk = self.cfg.logprob_chunk_tokens
        with self._replaying(model, micro):
            return response_scores(model, micro, temperature, chunk, entropy_grad=entropy_grad)

    def _logprobs(
        self, model: torch.nn.Module, micro: MicroBatch, temperature: float | None = None
    ) -> torch.Tensor:
        return self._scores(model, micro, temperature=temperature)[0]

    def _micro_batches(
        self, items: list[TrainItem], *, rl: bool = False
    ) -> Iterator[tuple[bool, MicroBatch]]:
        """Micro-batches within the token budget; every rank yields the same number of them,
        since each one is a round of FSDP collectives (a rank short of items repeats one with
        its loss mask zeroed; a rank with none, every group of its share set aside, runs a
        masked-out stand-in whose response, of two tokens, takes the prompt-then-response path
        of `response_outputs` that real rows take, so the ranks' FSDP collectives match)."""
        lengths = [len(item.tokens) for item in items]
        budget = self.cfg.micro_batch_tokens
        count = distributed.all_reduce_max(len(pack_micro_batches(lengths, budget)), self.device)
        pad = self.pad_token_id
        stand_in = masked_out(items[0]) if items else TrainItem([pad] * 3, 2, [0, 0], [0.0] * 2, 0)
        for position, indices in enumerate(micro_batch_indices(lengths, budget, count)):
            batch = [items[i] for i in indices] or [stand_in]
            micro = collate(batch, self.pad_token_id, self.device)
            recorded = [item.routed_experts is not None for item in batch]
            # RL replay needs every sample's record (`routed_calls` says which lacks it), but
            # the masked-out stand-in of a rank without items, which trains nothing; SFT's
            # examples were never rolled out and train on the trainer's own routing
            replays = rl and self.loss_cfg.routing_replay and bool(items)
            if self.routing_shape is not None and (all(recorded) or replays):
                micro.routed_calls = routed_calls(batch, micro, self.routing_shape)
            yield position == count - 1, micro

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
        """One RL optimiser step on this rank's items; returns metrics averaged over all ranks,
        with this rank's `perf/train_{forward,backward,optimizer}_time_s`. With multi-LoRA, one
        step of each adapter that has items (`adapter_steps`)."""
        self.timer = PhaseTimer(device=self.device, step=step, cat="train")
        if self.adapter_optimizers:
            metrics = self.adapter_steps(items, step=step)
        else:
            metrics = self._step(items, self.optimizer, self.scheduler, step=step)
        perf = self.timer.metrics()
        n_params = sum(p.numel() for p in self.model.parameters())
        return metrics | perf | mfu_metrics(self.device, n_params, items, perf)

    def adapter_steps(self, items: list[TrainItem], *, step: int) -> dict[str, float]:
        """Multi-LoRA: each adapter with items on any rank takes a step of its own optimizer
        on them alone (its loss normalised by its own tokens and sequences), with only it
        active in the forward; adapters without items keep their weights and state. Metrics
        per adapter (`train/<name>/...`) and their means weighted by the adapters' items."""
        names = list(self.adapter_optimizers)
        counts = distributed.all_reduce_sum(
            [float(sum(item.adapter == name for item in items)) for name in names], self.device
        )
        self.stepped_adapters, per_adapter = [], {}
        for name, count in zip(names, counts, strict=True):
            if count == 0:
                continue
            lora.set_active_adapter(self.model, name)
            optimizer, scheduler = self.adapter_optimizers[name]
            mine = [item for item in items if item.adapter == name]
            per_adapter[name] = (count, self._step(mine, optimizer, scheduler, step=step))
            self.stepped_adapters.append(name)
        total = sum(count for count, _ in per_adapter.values())
        metrics: dict[str, float] = {}
        for name, (count, stats) in per_adapter.items():
            for key, value in stats.items():
                metrics[key.replace("train/", f"train/{name}/", 1)] = value
                metrics[key] = metrics.get(key, 0.0) + value * count / total
        return metrics

    def _step(
        self,
        items: list[TrainItem],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        step: int,
    ) -> dict[str, float]:
        cfg = self.loss_cfg
        token_norm, seq_norm = self._global_counts(items)
        norms = Normalisers(token_norm, seq_norm, self.constant_normaliser)
        micros = list(self._micro_batches(items, rl=True))
        if needs_advantage_pass(cfg):
            with self.timer("train_forward"), torch.no_grad():
                for _, micro in micros:
                    self._prepare_advantages(micro)
            if cfg.whiten_advantages:
                whiten_globally([micro for _, micro in micros], self.device)
        sums: dict[str, float] = {}
        for is_last, micro in micros:
            self.model.set_requires_gradient_sync(is_last)
            with self.timer("train_forward"):
                # before the forward that backward follows: FSDP reshards after backward only
                unreplayed = {}
                if cfg.routing_replay and micro.routed_calls:
                    unreplayed = self._unreplayed_diff(micro, norms)
                ref_logprobs = None
                if cfg.kl_loss_coef > 0:
                    with torch.no_grad():
                        ref_logprobs = self._logprobs(self._require_reference(), micro)
                logprobs, entropy = self._scores(
                    self.model, micro, entropy_grad=cfg.entropy_coef > 0
                )
                loss, stats = policy_objective(cfg, logprobs, entropy, micro, norms, ref_logprobs)
                stats |= unreplayed
            with self.timer("train_backward"):
                loss.backward()
            if self.critic is not None:
                self.critic.set_requires_gradient_sync(is_last)
                stats |= self._critic_backward(micro, token_norm)
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
        with self.timer("train_optimizer"):
            metrics = self._optimizer_steps(optimizer, scheduler, sums, step)
        if self.routing is not None:
            sums |= self.routing.take_counts()
        world = distributed.world_size()
        totals = distributed.all_reduce_sum(list(sums.values()), self.device)
        reduced = dict(zip(sums, totals, strict=True))
        if "routing_recorded" in reduced:  # the share over every rank's recorded choices
            agreed, recorded = reduced.pop("routing_agreed"), reduced.pop("routing_recorded")
            if recorded:
                metrics["train/routing_agreement"] = agreed / recorded
        return {f"train/{k}": v / world for k, v in reduced.items()} | metrics

    def _unreplayed_diff(self, micro: MicroBatch, norms: Normalisers) -> dict[str, float]:
        """The train-rollout log-prob difference the policy would have without replay."""
        assert self.routing is not None and micro.routed_calls is not None
        with torch.no_grad(), self.routing.feeding(micro.routed_calls, replay=False, count=False):
            chunk = self.cfg.logprob_chunk_tokens
            logprobs_B_T = response_scores(self.model, micro, self.temperature, chunk)[0]
        diff_B_T = (logprobs_B_T - micro.rollout_logprobs_B_T).abs() * micro.loss_mask_B_T
        return {"train_rollout_logprob_abs_diff_no_replay": float(diff_B_T.sum()) / norms.tokens}

    def _optimizer_steps(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        sums: dict[str, float],
        step: int,
    ) -> dict[str, float]:
        """Clip, check and step the policy's (and the critic's) optimizer and schedule."""
        if self.offload is not None:
            self.offload.to_device()
        grad_norm = self._clip_and_check(self.model, optimizer, sums["loss"], step)
        metrics = {"train/grad_norm": grad_norm, "train/lr": scheduler.get_last_lr()[0]}
        if self.critic is not None:
            metrics["train/critic_grad_norm"] = self._clip_and_check(
                self.critic, self.critic_optimizer, sums["value_loss"], step
            )
        # a batch with no signal (every advantage 0) has a gradient of exactly 0; Adam would
        # still move every weight on its momentum, by about lr a step, for tens of steps
        if grad_norm > 0.0:
            optimizer.step()
        metrics["train/update_skipped"] = float(grad_norm == 0.0)
        optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # the schedule counts a skipped step: no misuse here
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            scheduler.step()
        if self.critic is not None:
            self.critic_optimizer.step()
            self.critic_optimizer.zero_grad(set_to_none=True)
            self.critic_scheduler.step()
        if self.offload is not None:
            metrics["perf/offloaded_bytes"] = float(self.offload.to_host())
        return metrics

    def _require_reference(self) -> torch.nn.Module:
        if self.reference is None:
            raise RuntimeError("the loss needs a reference model, but none was set")
        return self.reference

    def _prepare_advantages(self, micro: MicroBatch) -> None:
        cfg = self.loss_cfg
        kl = torch.zeros_like(micro.loss_mask_B_T)
        if cfg.kl_coef > 0 or cfg.estimator.needs_reference:
            kl = kl_penalty(
                self._logprobs(self.model, micro),
                self._logprobs(self._require_reference(), micro),
                cfg.kl_loss_type,
            )
        values = None
        if self.critic is not None:
            values = response_outputs(self.critic, micro)[..., 0].float()
        set_token_advantages(cfg, micro, kl, values)

    def _critic_backward(self, micro: MicroBatch, token_norm: float) -> dict[str, float]:
        assert micro.old_values_B_T is not None and micro.returns_B_T is not None
        mask = micro.loss_mask_B_T
        with self.timer("train_forward"):
            values = response_outputs(self.critic, micro)[..., 0].float()
            per_token = value_loss(
                values,
                micro.old_values_B_T,
                micro.returns_B_T,
                value_clip=self.loss_cfg.value_clip,
            )
            loss = aggregate(per_token, mask, "token_mean", token_normaliser=token_norm)
        with self.timer("train_backward"):
            loss.backward()
        return {
            "value_loss": loss.item(),
            "values_mean": float((values.detach() * mask).sum()) / token_norm,
            "returns_mean": float((micro.returns_B_T * mask).sum()) / token_norm,
        }

    def sft_step(
        self,
        items: list[TrainItem],
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> dict[str, float]:
        """One supervised step: mean NLL of the masked tokens over all ranks at temperature 1
        (whatever the rollout samples at); returns `loss`, `grad_norm`, `tokens` (all ranks')
        and this rank's `perf/train_{forward,backward,optimizer}_time_s`."""
        timer = self.timer = PhaseTimer(device=self.device, step=step, cat="train")
        token_norm, _ = self._global_counts(items)
        total = 0.0
        for is_last, micro in self._micro_batches(items):
            self.model.set_requires_gradient_sync(is_last)
            with timer("train_forward"):
                logprobs_B_T = self._logprobs(self.model, micro, SFT_TEMPERATURE)
                loss = nll_loss(logprobs_B_T, micro.loss_mask_B_T, token_norm)
            with timer("train_backward"):
                loss.backward()
            total += loss.item()
        with timer("train_optimizer"):
            grad_norm = self._clip_and_check(self.model, optimizer, total, step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        world = distributed.world_size()
        return {
            "loss": distributed.all_reduce_sum([total], self.device)[0] / world,
            "grad_norm": grad_norm,
            "tokens": token_norm * world,
        } | timer.metrics()

    @torch.no_grad()
    def sft_eval(self, items: list[TrainItem]) -> dict[str, float]:
        """Held-out NLL of the masked tokens, the share of them that are the argmax, and the
        share of examples whose every masked token is the argmax (greedy decoding would write
        the reference exactly), over all ranks' items."""
        sums = dict.fromkeys(EVAL_SUMS, 0.0)
        self.model.eval()
        for _, micro in self._micro_batches(items):
            logits_B_T_V = self._logits(self.model, micro, SFT_TEMPERATURE)
            for key, value in eval_sums(logits_B_T_V, micro).items():
                sums[key] += value
        # a forward without a backward leaves the parameters unsharded (no post-backward hook
        # reshards them): the optimiser and the next forward must see the sharded ones
        self.model.reshard()
        self.model.train()
        totals = distributed.all_reduce_sum(list(sums.values()), self.device)
        return eval_metrics(dict(zip(sums, totals, strict=True)))

    def _clip_and_check(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: float, step: int
    ) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; "
                "the weights were not updated"
            )
        return grad_norm
