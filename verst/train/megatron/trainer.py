"""The Megatron-core policy trainer: the FSDP2 trainer's interface (`step`, `full_state_dict`,
`full_parameters`, `optimizer_state`, `load_state`) over a GPTModel split by tensor, pipeline
and expert parallelism.

Promises: every rank of a model-parallel group trains on the same items (the world's items are
gathered, and data-parallel rank d takes every dp-th); micro-batches follow the token budget
and the same token-mean / sequence-mean normalisers as FSDP2 (global counts over the
data-parallel ranks, gradients summed over them and divided by their number); weights leave
as full HF tensors, non-expert ones first (`verst.train.megatron.gather`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from verst import distributed
from verst.monitor.timer import PhaseTimer
from verst.train.algorithms import LossConfig
from verst.train.batching import (
    MicroBatch,
    TrainItem,
    collate,
    masked_out,
    micro_batch_indices,
    pack_micro_batches,
)
from verst.train.losses import entropy_from_logits, kl_penalty, logprobs_from_logits
from verst.train.megatron import gather
from verst.train.megatron.config import check_layout
from verst.train.megatron.inputs import response_logits, sequence_inputs
from verst.train.megatron.mapping import WeightMap
from verst.train.megatron.model import build_model, init_parallel, load_hf_weights
from verst.train.objective import (
    Normalisers,
    needs_advantage_pass,
    policy_objective,
    set_token_advantages,
    whiten_globally,
)
from verst.train.sft_loss import EVAL_SUMS, SFT_TEMPERATURE, eval_metrics, eval_sums, nll_loss
from verst.train.trainer_config import NonFiniteLossError, TrainerConfig, _lr_lambda, compute_dtype


class MegatronTrainer:
    lora = False
    stepped_adapters: list[str] = []
    adapter_optimizers: dict = {}
    critic = None

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
        seed: int = 0,
    ) -> None:
        """`model`: the HF policy; its config and weights build this rank's Megatron stage."""
        self.cfg, self.loss_cfg, self.device = cfg, loss_cfg, device
        self.dtype = compute_dtype(cfg.dtype, device)
        self.pad_token_id = pad_token_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.constant_normaliser = constant_normaliser
        distributed.init_distributed(device)
        layout = cfg.megatron
        check_layout(layout, model.config, distributed.world_size())
        init_parallel(layout, seed, device)
        self.mapping = WeightMap(model.config, layout)
        self.vocab = model.config.vocab_size
        self.model = build_model(model.config, layout, self.dtype)
        load_hf_weights(self.model, self.mapping, model.state_dict())
        self.model.to(device).train()
        self.trainable_parameters = list(self.model.named_parameters())
        self.optimizer = self.make_optimizer(cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(cfg, total_steps)
        )
        self.reference: torch.nn.Module | None = None
        self.timer = PhaseTimer(device=device)

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """AdamW over this rank's shards of the policy (the warm start makes its own)."""
        cfg = self.cfg
        return torch.optim.AdamW(
            [p for _, p in self.trainable_parameters],
            lr=lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )

    def set_reference(self, shell: Any, weights: dict[str, torch.Tensor] | None = None) -> None:
        """A frozen second GPTModel of the policy's layout holding `weights` (HF names;
        default: the policy's now, copied shard for shard) as the reference of the KL terms.
        `shell`: the HF policy, whose config it is built from. Its parameters are fp32 like the
        policy's, so its forward is the policy's own path (bf16 autocast on CUDA)."""
        reference = build_model(shell.config, self.cfg.megatron, self.dtype)
        if weights is None:
            reference.load_state_dict(self.model.state_dict())
        else:
            load_hf_weights(reference, self.mapping, weights)
        self.reference = reference.to(self.device).eval().requires_grad_(False)

    # --- weights out ---------------------------------------------------------------------------

    def full_parameters(
        self, dtype: torch.dtype | None = None, keep: Any = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF tensors on rank 0, one entry at a time (a collective every rank joins)."""
        for name, tensor in gather.hf_tensors(self.model, self.mapping, to_all=False):
            if keep is None or keep(name):
                yield name, tensor if dtype is None else tensor.to(dtype)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in HF names, fp32 on the CPU, on every rank."""
        return {
            name: tensor.cpu()
            for name, tensor in gather.hf_tensors(self.model, self.mapping, to_all=True)
        }

    def named_local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Megatron names: an HF engine never shares this storage."""
        yield from self.model.named_parameters()

    # --- steps ---------------------------------------------------------------------------------

    def step(self, items: list[TrainItem], *, step: int) -> dict[str, float]:
        """One RL optimiser step over the world's items; metrics from the loss ranks."""
        self.timer = PhaseTimer(device=self.device, step=step, cat="train")
        cfg = self.loss_cfg
        mine = gather.data_parallel_share(items)
        token_norm, seq_norm = gather.global_counts(mine, self.device)
        norms = Normalisers(token_norm, seq_norm, self.constant_normaliser)
        micros = list(self._micro_batches(mine))
        if needs_advantage_pass(cfg):
            with self.timer("train_forward"):
                self._advantage_pass(micros)
        sums: dict[str, float] = {}
        for micro in micros:
            with self.timer("train_forward"):
                ref_logprobs = None
                if cfg.kl_loss_coef > 0:
                    ref_logprobs = self._forward_logprobs(self._require_reference(), micro)
                loss_fn = partial(self._rl_loss, norms=norms, ref_logprobs_B_T=ref_logprobs)
                stats = self._forward_backward(micro, loss_fn)
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
        sums = gather.loss_rank_sums(sums)
        with self.timer("train_optimizer"):
            loss = sums.get("loss", 0.0)
            metrics = self._optimizer_step(self.optimizer, self.scheduler, loss, step)
        dp = gather.data_parallel_size()
        return {f"train/{k}": v / dp for k, v in sums.items()} | metrics | self.timer.metrics()

    def _optimizer_step(
        self, optimizer: torch.optim.Optimizer, scheduler: Any, loss: float, step: int
    ) -> dict[str, float]:
        """Reduce and clip the gradients, step (as FSDP2: not on an all-zero gradient, which
        Adam's momentum would still turn into an update) and advance the schedule."""
        grad_norm = self._finish_gradients(loss, step)
        lr = scheduler.get_last_lr()[0]
        if grad_norm > 0.0:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # the schedule counts a skipped step: no misuse here
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            scheduler.step()
        skipped = float(grad_norm == 0.0)
        return {"train/grad_norm": grad_norm, "train/lr": lr, "train/update_skipped": skipped}

    def _require_reference(self) -> torch.nn.Module:
        if self.reference is None:
            raise RuntimeError("the loss needs a reference model, but none was set")
        return self.reference

    @torch.no_grad()
    def _advantage_pass(self, micros: list[MicroBatch]) -> None:
        """Per-token advantages (KL reward, REINFORCE++, on-policy distillation, whitening)
        from the policy's and the reference's log-probs, before any weight moves. Only the
        loss stage reads advantages, so other stages keep theirs; whitening sums over the
        data-parallel group (its ranks hold distinct items; TP peers hold the same ones)."""
        cfg = self.loss_cfg
        for micro in micros:
            kl_B_T = torch.zeros_like(micro.loss_mask_B_T)
            if cfg.kl_coef > 0 or cfg.estimator.needs_reference:
                policy_B_T = self._forward_logprobs(self.model, micro)
                reference_B_T = self._forward_logprobs(self._require_reference(), micro)
                if policy_B_T is None or reference_B_T is None:
                    continue
                kl_B_T = kl_penalty(policy_B_T, reference_B_T, cfg.kl_loss_type)
            set_token_advantages(cfg, micro, kl_B_T, None)
        if cfg.whiten_advantages:
            whiten_globally(micros, self.device, gather.data_parallel_group())

    def _micro_batches(self, items: list[TrainItem]) -> Iterator[MicroBatch]:
        """As the FSDP2 trainer's: every rank runs the same number (a short rank repeats a
        masked-out item), since each micro-batch is a round of collectives."""
        lengths = [len(item.tokens) for item in items]
        budget = self.cfg.micro_batch_tokens
        count = distributed.all_reduce_max(len(pack_micro_batches(lengths, budget)), self.device)
        pad = self.pad_token_id
        stand_in = masked_out(items[0]) if items else TrainItem([pad] * 3, 2, [0, 0], [0.0] * 2, 0)
        for indices in micro_batch_indices(lengths, budget, count):
            yield collate([items[i] for i in indices] or [stand_in], pad, self.device)

    def _forward_backward(
        self,
        micro: MicroBatch,
        loss_fn: Any,
        forward_only: bool = False,
        model: torch.nn.Module | None = None,
    ) -> dict:
        """One micro-batch forward (and backward) of `model` (the policy by default); the
        loss stage's stats (empty elsewhere). With PP > 1 it goes through Megatron's pipeline
        schedule (CUDA only: the schedules allocate on "cuda"); with one stage the model is
        called directly, which is all the no-pipelining schedule does."""
        model = self.model if model is None else model
        inputs = sequence_inputs(micro, self.pad_token_id)
        on = self.dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=on):
            if self.cfg.megatron.pipeline_parallel == 1:
                output = model(
                    inputs.ids_B_S, inputs.positions_B_S, attention_mask=inputs.mask_B_1_S_S
                )
                loss, stats = loss_fn(output, micro=micro, inputs=inputs)
                if not forward_only:
                    loss.backward()
                return stats
            return self._pipelined(model, micro, inputs, loss_fn, forward_only)

    def _pipelined(
        self,
        model: torch.nn.Module,
        micro: MicroBatch,
        inputs: Any,
        loss_fn: Any,
        forward_only: bool,
    ) -> dict:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple:
            next(data_iterator)
            output = model(inputs.ids_B_S, inputs.positions_B_S, attention_mask=inputs.mask_B_1_S_S)
            return output, partial(loss_fn, micro=micro, inputs=inputs)

        stored = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([micro]),
            model=model,
            num_microbatches=1,
            seq_length=inputs.ids_B_S.shape[1],
            micro_batch_size=inputs.ids_B_S.shape[0],
            forward_only=forward_only,
        )
        return stored[0] if stored else {}

    def logits(
        self, output: torch.Tensor, inputs: Any, temperature: float | None = None
    ) -> torch.Tensor:
        """fp32 response logits at `temperature` (default: the sampling one)."""
        return response_logits(output, inputs, self.vocab) / (temperature or self.temperature)

    def _rl_loss(
        self,
        output: torch.Tensor,
        *,
        micro: MicroBatch,
        inputs: Any,
        norms: Normalisers,
        ref_logprobs_B_T: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logits_B_T_V = self.logits(output, inputs)
        logprobs_B_T = logprobs_from_logits(logits_B_T_V, micro.response_ids_B_T)
        with torch.set_grad_enabled(self.loss_cfg.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy_B_T = entropy_from_logits(logits_B_T_V)
        cfg = self.loss_cfg
        return policy_objective(cfg, logprobs_B_T, entropy_B_T, micro, norms, ref_logprobs_B_T)

    def _keep_logprobs(self, output: torch.Tensor, *, micro: MicroBatch, inputs: Any) -> tuple:
        values_B_T = logprobs_from_logits(self.logits(output, inputs), micro.response_ids_B_T)
        return output.new_zeros(()), {"logprobs": values_B_T}

    @torch.no_grad()
    def _forward_logprobs(self, model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor | None:
        """fp32 log-probs [B, T] of `micro`'s responses under `model` on the loss stage's
        ranks, None on the others (every rank of the pipeline joins)."""
        return self._forward_backward(micro, self._keep_logprobs, True, model).get("logprobs")

    @torch.no_grad()
    def logprobs(self, items: list[TrainItem]) -> list[list[float]]:
        """Each item's response-token log-probs (at the trainer's temperature), on every rank;
        items are not split over data-parallel ranks."""
        rows: list[list[float]] = []
        self.model.eval()
        for item in items:
            values_B_T = self._forward_logprobs(
                self.model, collate([item], self.pad_token_id, self.device)
            )
            rows.append(
                gather.from_loss_rank(None if values_B_T is None else values_B_T[0].tolist())
            )
        self.model.train()
        return rows

    # --- supervised steps ----------------------------------------------------------------------

    def sft_step(
        self,
        items: list[TrainItem],
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> dict[str, float]:
        """One supervised step over the world's items (`verst.train.sft_loss.nll_loss`, the
        FSDP2 trainer's loss): `loss`, `grad_norm`, `tokens` (masked tokens, all ranks)."""
        self.timer = PhaseTimer(device=self.device, step=step, cat="train")
        mine = gather.data_parallel_share(items)
        token_norm, _ = gather.global_counts(mine, self.device)
        total = 0.0
        for micro in self._micro_batches(mine):
            with self.timer("train_forward"):
                stats = self._forward_backward(
                    micro, partial(self._sft_loss, token_norm=token_norm)
                )
            total += stats.get("loss", 0.0)
        total = gather.loss_rank_sums({"loss": total})["loss"]
        with self.timer("train_optimizer"):
            grad_norm = self._finish_gradients(total, step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        dp = gather.data_parallel_size()
        return {
            "loss": total / dp,
            "grad_norm": grad_norm,
            "tokens": token_norm * dp,
        } | self.timer.metrics()

    def _sft_loss(self, output: torch.Tensor, *, micro: MicroBatch, inputs: Any, token_norm: float):
        logits_B_T_V = self.logits(output, inputs, SFT_TEMPERATURE)
        logprobs_B_T = logprobs_from_logits(logits_B_T_V, micro.response_ids_B_T)
        loss = nll_loss(logprobs_B_T, micro.loss_mask_B_T, token_norm)
        return loss, {"loss": loss.item()}

    @torch.no_grad()
    def sft_eval(self, items: list[TrainItem]) -> dict[str, float]:
        """Held-out NLL, token accuracy and exact-example accuracy over the world's items."""
        sums = dict.fromkeys(EVAL_SUMS, 0.0)

        def keep(output: torch.Tensor, *, micro: MicroBatch, inputs: Any) -> tuple:
            logits_B_T_V = self.logits(output, inputs, SFT_TEMPERATURE)
            return output.new_zeros(()), eval_sums(logits_B_T_V, micro)

        self.model.eval()
        for micro in self._micro_batches(gather.data_parallel_share(items)):
            for key, value in self._forward_backward(micro, keep, forward_only=True).items():
                sums[key] += value
        self.model.train()
        totals = gather.loss_rank_sums(sums)
        return eval_metrics({key: totals.get(key, 0.0) for key in EVAL_SUMS})

    def _finish_gradients(self, loss: float, step: int) -> float:
        """Sum gradients over data-parallel ranks (÷ their number), clip by the global norm."""
        gather.reduce_gradients(self.model)
        norm = gather.gradient_norm(self.model)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.model.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"non-finite loss ({loss}) or gradient norm ({norm}) at step {step}; "
                "the weights were not updated"
            )
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if norm > max_norm:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    # --- checkpoint state -----------------------------------------------------------------------

    def optimizer_state(self) -> dict:
        """This rank's optimiser state (Megatron names) and the schedule, gathered to all."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        return {"ranks": distributed.all_gather_object(state)}

    def load_state(self, weights: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
        """Weights in HF names (as `full_state_dict` gave them), the optimiser of each rank."""
        load_hf_weights(self.model, self.mapping, weights)
        if optimizer_state is not None:
            state = optimizer_state["ranks"][distributed.rank()]
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
