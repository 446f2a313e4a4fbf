"""The checks of `RunConfig` that span its sections (`RunConfigChecks`, a base of `RunConfig`):
each raises ValueError naming the fields whose combination it refuses, before any work starts.
"""

from __future__ import annotations

from verst.models.families import MOE_FAMILIES
from verst.models.invariant_forward import TRUE_ON_POLICY_FAMILIES

MAX_ADAPTERS = 8  # what the engines hold by default (`verst serve --max-loras-per-batch`)
DIFFUSION_TRANSPORTS = {"in_process": ("colocated",), "http": ("disk", "broadcast")}


class RunConfigChecks:
    """Checks across `RunConfig`'s sections; `RunConfig`'s validator runs them (`self` is the
    `RunConfig`)."""

    def _check_megatron(self) -> None:
        """What the megatron backend does not train fails before any work, naming the field."""
        if self.trainer.backend != "megatron":
            return
        unsupported = {
            "model.lora.enabled (adapters are per HF projection; Megatron fuses q/k/v and "
            "gate/up, see docs/training_backends.md)": self.model.lora.enabled,
            f"loss.advantage_estimator={self.loss.advantage_estimator} (a PPO critic: no Megatron "
            "value model yet)": self.loss.needs_critic,
            "trainer.gradient_checkpointing (not wired to Megatron's recompute yet)": (
                self.trainer.gradient_checkpointing
            ),
            "trainer.kernels=liger (Megatron's layers are its own)": self.trainer.kernels
            == "liger",
            "trainer.offload (Megatron's optimizer is its own)": self.trainer.offload != "none",
        }
        for field, on in unsupported.items():
            if on:
                raise ValueError(f"trainer.backend=megatron does not support {field}; use fsdp2")

    def _check_multi_lora(self) -> None:
        """Refuse `model.lora.adapters` settings that cannot run (each error names the field)."""
        lora = self.model.lora
        if not lora.adapters:
            return
        names = [a.name for a in lora.adapters]
        refusals = {
            "model.lora.rank must be >= 1 to train adapters": not lora.enabled,
            f"names must be distinct, got {names}": len(set(names)) != len(names),
            f"at most {MAX_ADAPTERS} adapters (what an engine holds)": len(names) > MAX_ADAPTERS,
            "each adapter has its own data: leave the top-level data unset": self.data
            != type(self).model_fields["data"].get_default(call_default_factory=True),
            "eval.interval_steps > 0 evaluates adapters' eval_data, and none has any": (
                self.eval.interval_steps > 0 and all(a.eval_data is None for a in lora.adapters)
            ),
            "every adapter's data needs the same apply_chat_template": len(
                {a.data.apply_chat_template for a in lora.adapters}
            )
            > 1,
            "a KL reference or a critic is one model; multi-LoRA has one per adapter (not yet)": (
                self.loss.needs_reference_model or self.loss.needs_critic
            ),
            "loss.opd is not supported with several adapters yet": self.loss.opd is not None,
            "agents and environments are not supported with several adapters yet": bool(
                self.plays_agents
            ),
            "warm_start would train which adapter? run verst sft for the base first": (
                self.warm_start.enabled
            ),
        }
        for reason, refused in refusals.items():
            if refused:
                raise ValueError(f"model.lora.adapters: {reason}")

    def _check_routing_replay(self) -> None:
        """`loss.routing_replay` needs the experts of every token from the rollout (it turns
        `rollout.return_routed_experts` on) and a mixture-of-experts model; a model loaded from a
        path is checked when the trainer is built."""
        if not self.loss.routing_replay:
            return
        if self.trainer.gradient_checkpointing:
            raise ValueError(
                "loss.routing_replay with trainer.gradient_checkpointing: the backward's replay of "
                "a layer would route its tokens again instead of replaying the rollout's experts"
            )
        tiny = self.model.tiny
        if tiny is not None and tiny.family not in MOE_FAMILIES:
            raise ValueError(
                f"loss.routing_replay replays the experts of a mixture-of-experts model, and "
                f"model.tiny.family {tiny.family!r} is dense: use one of {', '.join(MOE_FAMILIES)}"
            )
        self.rollout.return_routed_experts = True

    def _check_true_on_policy(self) -> None:
        """`trainer.true_on_policy` needs verst's own engines running the batch-invariant forward
        on the trainer's kind of device, on a model it reads; a model loaded from a path (and the
        devices `auto` picks) are checked when the engine and trainer are built."""
        if not self.trainer.true_on_policy:
            return
        tiny = self.model.tiny
        refusals = {
            "trainer.backend=megatron (its layers are Megatron's, not the invariant forward)": (
                self.trainer.backend == "megatron"
            ),
            "model.lora.rank > 0 (the invariant forward reads plain linear layers)": (
                self.model.lora.enabled
            ),
            "loss.routing_replay or rollout.return_routed_experts (the invariant forward routes "
            "by itself, without the router hooks; its routing is the engine's anyway)": (
                self.loss.routing_replay or self.rollout.return_routed_experts
            ),
            f"model.tiny.family={tiny.family if tiny else None} (covered: "
            f"{', '.join(TRUE_ON_POLICY_FAMILIES)})": (
                tiny is not None and tiny.family not in TRUE_ON_POLICY_FAMILIES
            ),
            "placement.backend=ray (engines on other hosts may run other kernels)": (
                self.placement.backend == "ray"
            ),
            "placement.engine_devices of another kind than trainer.device (other kernels)": any(
                not device.startswith(self.trainer.device)
                for device in self.placement.engine_devices
            )
            and self.trainer.device != "auto",
            "model.kind=diffusion": self.model.kind == "diffusion",
            "trainer.gradient_checkpointing (the invariant forward keeps its activations)": (
                self.trainer.gradient_checkpointing
            ),
            "trainer.kernels=liger (the invariant forward runs its own kernels)": (
                self.trainer.kernels == "liger"
            ),
        }
        for field, on in refusals.items():
            if on:
                raise ValueError(f"trainer.true_on_policy cannot be guaranteed with {field}")

    def _check_diffusion(self) -> None:
        """Refuse what a diffusion run cannot do (each error names the field)."""
        if self.model.kind != "diffusion":
            return
        if self.model.path is None:
            raise ValueError(
                "model.path: model.kind=diffusion loads a diffusion model directory; make one with "
                "`verst model create-tiny-diffusion DIR`"
            )
        if self.mode == "sft":
            raise ValueError(
                "mode=sft: a diffusion run trains by flow matching with diffusion.algorithm=sft"
            )
        if self.mode == "fully_async" and self.diffusion.algorithm == "sft":
            raise ValueError(
                "mode=fully_async with diffusion.algorithm=sft: SFT has no rollout to run ahead; "
                "use mode=sync"
            )
        lora = self.model.lora
        if lora.enabled and lora.adapters:
            raise ValueError("model.lora.adapters: a diffusion run trains one adapter (not yet)")
        if lora.enabled and lora.dropout > 0:
            raise ValueError(
                "model.lora.dropout: the diffusion trainer runs the model without dropout (train "
                "and rollout run the same forward); set it to 0"
            )
        self._check_diffusion_transport()
        evals = self.eval.changed_fields()
        if evals:
            raise ValueError(
                f"eval.{evals[0]}: a diffusion run evaluates every caption on its own engine "
                "(diffusion.eval_interval_steps, diffusion.eval_seeds_per_prompt); `verst eval "
                f"CHECKPOINT CONFIG` scores a saved checkpoint; leave eval.{evals[0]} unset"
            )

    def _check_diffusion_transport(self) -> None:
        """`diffusion.engine` places a diffusion run's engine and says how weights reach it (in
        process; served, through the disk or a broadcast group): a `placement`, `fault_tolerance`
        or `sync` field that the transport would ignore is refused."""
        engine = self.diffusion.engine
        placed = [f"placement.{name}" for name in self.placement.changed_fields()]
        placed += [f"fault_tolerance.{name}" for name in self.fault_tolerance.changed_fields()]
        if placed:
            raise ValueError(
                f"{placed[0]}: a diffusion run does not use placement or fault_tolerance; "
                "diffusion.engine places the engine (in_process or http), so leave "
                f"{placed[0]} unset"
            )
        transport, allowed = self.sync.transport, DIFFUSION_TRANSPORTS[engine]
        if transport not in ("auto", *allowed):
            where = (
                "in process" if engine == "in_process" else "through the disk or a broadcast group"
            )
            raise ValueError(
                f"sync.transport={transport}: with diffusion.engine={engine} the weights go "
                f"{where} (sync.transport={' or '.join(allowed)} or auto)"
                + (
                    "; broadcast needs a served engine: diffusion.engine=http"
                    if transport == "broadcast"
                    else ""
                )
            )
        # a broadcast push is bucketed and confirmed; the disk and in-process ones are one piece
        used = (
            ("transport", "bucket_mb", "max_resends")
            if transport == "broadcast"
            else ("transport",)
        )
        tuned = [name for name in self.sync.changed_fields() if name not in used]
        if tuned:
            raise ValueError(
                f"sync.{tuned[0]}: a diffusion run pushes whole weights (or whole adapters) in one "
                f"piece unless sync.transport=broadcast (which takes sync.bucket_mb and "
                f"sync.max_resends); leave sync.{tuned[0]} unset"
            )

    def _check_eval(self) -> None:
        """Refuse evaluation modes the run cannot serve (each error names the field)."""
        if self.eval.mode == "fleet" and self.model.lora.enabled:
            raise ValueError(
                "eval.mode=fleet loads full HF snapshots; with model.lora a snapshot holds "
                "adapters "
                "only (not yet): use eval.mode shared or external"
            )
        if self.eval.snapshot and self.mode == "sft":
            raise ValueError(f"eval.mode={self.eval.mode} evaluates RL steps; mode=sft has none")

    def _check_no_reward(self) -> None:
        """Refuse `rollout.reward: none` where nothing would be learned or measured."""
        if self.rollout.reward != "none":
            return
        if self.loss.opd is None:
            raise ValueError(
                "rollout.reward=none: with no reward, only a teacher gives a signal; set "
                "loss.opd.teacher_urls (pure distillation) or choose a reward function"
            )
        if self.rollout.filter_path() == "reward_variance":
            raise ValueError(
                "rollout.dynamic_sampling drops groups of equal rewards, and rollout.reward=none "
                "gives every sample 0: every group would be dropped; turn one of them off"
            )
        evaluates = self.eval.interval_steps > 0 or self.warm_start.enabled
        if evaluates and self.eval.reward is None:
            raise ValueError(
                "eval.reward: evaluation scores with the rollout's reward when unset, and "
                "rollout.reward=none scores 0; set eval.reward (e.g. exact_match)"
            )

    def _check_placement(self) -> None:
        """Refuse engine placement, transport, pause mode and loop mode that cannot work "
        "together."""
        if self.model.kind == "diffusion":  # diffusion.engine places it: check_diffusion_transport
            return
        placement, transport = self.placement, self.sync.resolve(self.placement)
        lm_async = self.mode == "fully_async"
        if self.fault_tolerance.enabled and placement.engines != "processes":
            raise ValueError(
                f"fault_tolerance.enabled: engines placed {placement.engines} run in the trainer's "
                "process and cannot be restarted; use placement.engines=processes, or set "
                "fault_tolerance.enabled=false"
            )
        if lm_async and placement.mode != "disaggregated":
            raise ValueError(
                "mode=fully_async needs placement.mode=disaggregated (with placement.engines="
                "processes): colocated engines share the trainer's device, so they could not "
                "generate while it trains"
            )
        if lm_async and self.pause_mode == "abort":
            raise ValueError(
                "mode=fully_async needs rollout.pause_mode retract or in_place: abort would throw "
                "away every trajectory in flight at each weight update"
            )
        if lm_async and self.rollout.function:
            raise ValueError(
                "rollout.function owns a whole synchronous step, and mode=fully_async has none: "
                "use rollout.generate_function (one sample), or mode=sync"
            )
        if placement.sleep_engines and placement.engines != "embedded":
            raise ValueError(
                f"placement.sleep_engines releases the embedded engine's memory; engines placed "
                f"{placement.engines} keep theirs (use placement.engines=embedded)"
            )
        agents = self.plays_agents
        if self.env.name is not None and self.rollout.agent_function:
            raise ValueError(
                "env.name and rollout.agent_function both say what plays a sample: the environment "
                "runs as the agent function, so leave rollout.agent_function unset"
            )
        if agents and placement.engines == "embedded":
            raise ValueError(
                f"{agents} needs serving engines behind a session server: set "
                "placement.engines=in_process (or processes); the embedded engine has no chat "
                "API for an agent to call"
            )
        if agents and self.pause_mode == "abort":
            raise ValueError(
                f"{agents} needs rollout.pause_mode retract or in_place: abort would "
                "cut agents' turns short at every weight update"
            )
        if placement.mode == "disaggregated" and placement.engines != "processes":
            raise ValueError(
                "placement.mode=disaggregated needs placement.engines=processes: engines on "
                "devices "
                "of their own run in processes of their own"
            )
        if placement.engines == "embedded":
            if transport != "colocated":
                raise ValueError(
                    f"sync.transport={transport} needs serving engines (placement.engines="
                    "in_process or processes); the embedded engine is updated in place"
                )
            if placement.num_engines != 1:
                raise ValueError(
                    "placement.num_engines > 1 needs placement.engines=in_process or processes"
                )
        if transport == "colocated" and placement.mode != "colocated":
            raise ValueError(
                "sync.transport=colocated needs placement.mode=colocated (engines on the trainer's "
                "device); disaggregated engines take broadcast or disk"
            )
        if transport == "broadcast" and placement.engines != "processes":
            raise ValueError(
                "sync.transport=broadcast needs placement.engines=processes: the weight-update "
                "group "
                "joins the trainer to engine processes"
            )

    def _check_ray_transport(self) -> None:
        """Under Ray, colocated weight sync (shared memory, CUDA IPC) needs engines on the
        trainer's node: refuse custom resources that pin them elsewhere."""
        placement = self.placement
        if placement.backend != "ray" or placement.engines != "processes":
            return
        if self.sync.resolve(placement) != "colocated":
            return
        if placement.ray_engine_resources != placement.ray_trainer_resources:
            raise ValueError(
                "sync.transport=colocated works within one node only, and placement."
                "ray_engine_resources pins engines to other nodes than placement."
                "ray_trainer_resources: use sync.transport=broadcast or disk across nodes"
            )
