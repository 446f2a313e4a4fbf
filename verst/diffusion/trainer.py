"""The diffusion trainer: replays recorded transitions and optimises Flow-GRPO, NFT or SFT.

`step(trajectories, advantages, train_steps)` takes one batch of rollouts and, for each
trajectory, the denoising steps it trains (its recorded ones, for Flow-GRPO); with
`updates_per_step` = k it makes k optimizer steps on k slices of the transitions. Before the
first update the recomputed log-probs must equal the engine's: `train/log_prob_mean_abs_diff`
is their mean absolute difference on the first slice (0 up to float rounding).
"""

from __future__ import annotations

import copy

import torch

from verst.diffusion import objectives, sde
from verst.diffusion.config import DiffusionConfig
from verst.diffusion.engine import Trajectory
from verst.diffusion.model import flow_matching_loss, velocity
from verst.train.trainer import NonFiniteLossError, TrainerConfig


class DiffusionTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: DiffusionConfig,
        trainer: TrainerConfig,
        device: torch.device,
        seed: int,
    ):
        self.model, self.cfg, self.trainer_cfg, self.device, self.seed = (
            model,
            cfg,
            trainer,
            device,
            seed,
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],  # with LoRA, the adapters
            lr=trainer.lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            eps=trainer.adam_eps,
            weight_decay=trainer.weight_decay,
        )
        self.reference = None
        if cfg.kl_beta > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        model.eval()  # no dropout anywhere: train and rollout run the same forward

    def _apply(self, loss: torch.Tensor) -> float:
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"diffusion loss is {float(loss)}")
        clip = self.trainer_cfg.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def step(
        self,
        trajectories: list[Trajectory],
        advantages: torch.Tensor,
        train_steps: list[list[int]],
        *,
        step: int,
    ) -> dict[str, float]:
        if len(train_steps) != len(trajectories):
            raise ValueError(
                f"{len(train_steps)} lists of train steps for {len(trajectories)} trajectories"
            )
        pairs = [(j, i) for j, chosen in enumerate(train_steps) for i in chosen]
        k = min(self.cfg.updates_per_step, len(pairs))
        order = torch.randperm(
            len(pairs), generator=torch.Generator().manual_seed(self.seed + step)
        )
        slices = [[pairs[int(n)] for n in order[s::k]] for s in range(k)]
        metrics: dict[str, float] = {"train/transitions": float(len(pairs))}
        losses, norms = [], []
        for number, chunk in enumerate(slices):
            if self.cfg.algorithm == "flow_grpo":
                loss, extra = self._flow_grpo(trajectories, advantages, chunk)
            else:
                loss, extra = self._nft(trajectories, advantages, chunk, step * 1000 + number)
            if number == 0:
                metrics |= extra
            losses.append(loss)
            norms.append(self._apply(torch.tensor(loss)))
        return metrics | {"train/loss": sum(losses) / k, "train/grad_norm": sum(norms) / k}

    def _chunks(self, chunk: list[tuple[int, int]]):
        """Micro-batches of (trajectory, step) pairs that share a step (hence a time)."""
        by_step: dict[int, list[int]] = {}
        for j, i in chunk:
            by_step.setdefault(i, []).append(j)
        size = self.cfg.micro_batch
        for i, rows in sorted(by_step.items()):
            for start in range(0, len(rows), size):
                yield i, rows[start : start + size]

    def _conditioning(self, trajectories: list[Trajectory], rows: list[int]):
        dev = self.device
        labels = torch.tensor([trajectories[j].label for j in rows], device=dev)
        negative = torch.tensor([trajectories[j].negative_label for j in rows], device=dev)
        guidance = torch.tensor([trajectories[j].request.guidance_scale for j in rows], device=dev)
        return labels, negative, guidance

    def _flow_grpo(self, trajectories, advantages, chunk):
        """Accumulates the clipped surrogate's gradient; returns (loss, first-slice metrics)."""
        total, diffs, kls, clip_fracs = 0.0, [], [], []
        for i, rows in self._chunks(chunk):
            request = trajectories[rows[0]].request
            sde_type, eta = request.sde_type, request.noise_level
            grid = sde.time_grid(request.num_inference_steps)
            x = torch.stack([trajectories[j].latents[i] for j in rows]).to(self.device)
            x_next = torch.stack([trajectories[j].latents[i + 1] for j in rows]).to(self.device)
            old = torch.stack(
                [trajectories[j].log_probs[trajectories[j].record_steps.index(i)] for j in rows]
            )
            cond = self._conditioning(trajectories, rows)
            t = torch.full((len(rows),), float(grid[i]), device=self.device)
            mean = sde.step_mean(sde_type, eta, grid, i, x, velocity(self.model, x, t, *cond))
            std = sde.step_std(sde_type, eta, grid, i)
            logp = sde.transition_log_prob(x_next, mean, std)
            adv = advantages[rows].to(self.device)
            loss, extra = objectives.flow_grpo_loss(
                logp, old.to(self.device), adv, self.cfg.clip_range
            )
            if self.reference is not None:
                with torch.no_grad():
                    ref_v = velocity(self.reference, x, t, *cond)
                    ref_mean = sde.step_mean(sde_type, eta, grid, i, x, ref_v)
                kl = objectives.gaussian_mean_kl(mean, ref_mean, torch.full_like(logp, std)).mean()
                loss = loss + self.cfg.kl_beta * kl
                kls.append(float(kl))
            weight = len(rows) / len(chunk)
            (loss * weight).backward()
            total += loss.item() * weight
            diffs.append((logp.detach().cpu() - old).abs())
            clip_fracs.append(extra["train/clip_frac"] * weight)
        metrics = {
            "train/log_prob_mean_abs_diff": float(torch.cat(diffs).mean()),
            "train/clip_frac": sum(clip_fracs),
        }
        if kls:
            metrics["train/kl"] = sum(kls) / len(kls)
        return total, metrics

    def _nft(self, trajectories, advantages, chunk, noise_seed: int):
        """Accumulates DiffusionNFT's gradient on corrupted final samples at the chosen times."""
        generator = torch.Generator().manual_seed(self.seed * 7919 + noise_seed)
        total, kls = 0.0, []
        for i, rows in self._chunks(chunk):
            grid = sde.time_grid(trajectories[rows[0]].request.num_inference_steps)
            x0 = torch.stack([trajectories[j].latents[-1] for j in rows]).to(self.device)
            eps = torch.randn(x0.shape, generator=generator).to(self.device)
            t = torch.full((len(rows),), float(grid[i]), device=self.device)
            tt = t.view(-1, 1, 1, 1)
            x_t = (1 - tt) * x0 + tt * eps
            labels, _, _ = self._conditioning(trajectories, rows)
            ones = torch.ones(len(rows), device=self.device)
            with torch.no_grad():
                v_old = velocity(self.model, x_t, t, labels, labels, ones)
            v_new = velocity(self.model, x_t, t, labels, labels, ones)
            adv = advantages[rows].to(self.device)
            loss = objectives.nft_loss(
                x0,
                x_t,
                t,
                v_new,
                v_old,
                adv,
                beta=self.cfg.nft_beta,
                adv_clip_max=self.cfg.adv_clip_max,
            )
            if self.reference is not None:
                with torch.no_grad():
                    v_ref = velocity(self.reference, x_t, t, labels, labels, ones)
                kl = (v_new - v_ref).pow(2).mean()
                loss = loss + self.cfg.kl_beta * kl
                kls.append(float(kl))
            weight = len(rows) / len(chunk)
            (loss * weight).backward()
            total += loss.item() * weight
        return total, ({"train/kl": sum(kls) / len(kls)} if kls else {})

    def sft_step(self, x0_B: torch.Tensor, labels_B: torch.Tensor, step: int) -> dict[str, float]:
        """One flow-matching step on data (SFT for diffusion)."""
        generator = torch.Generator().manual_seed(self.seed * 7919 + step)
        loss = flow_matching_loss(
            self.model, x0_B.to(self.device), labels_B.to(self.device), generator
        )
        loss.backward()
        return {"sft/loss": loss.item(), "train/grad_norm": self._apply(loss.detach())}
