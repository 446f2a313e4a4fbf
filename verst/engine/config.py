"""The `engine` section of the config: how verst's own rollout engines compute (where they run
is `placement`'s). Every engine a run starts takes it: the embedded one, in-process serving
engines and `verst serve` processes (`--quantization`)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from verst.configbase import ConfigBase
from verst.engine.lean_decoder import LEAN_FAMILIES

Quantization = Literal["none", "fp8"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


class EngineConfig(ConfigBase):
    quantization: Quantization = Field(
        "none",
        description="rollout engines' projection weights: none = the engine's dtype; fp8 = "
        "e4m3 with per-channel scales, made again at every weight update, GEMMs through "
        "torch._scaled_mm (pair it with loss.use_tis)",
    )
    overlap: bool = Field(
        True,
        description="CUDA engines launch each decode-only step before reading the previous "
        "one's sampled tokens (CPU engines never overlap); false: every step synchronous",
    )

    def scheduler_overlap(self) -> bool | None:
        """The `Scheduler`'s `overlap` for this setting: None (on CUDA only) or off."""
        return None if self.overlap else False

    def check(
        self, *, true_on_policy: bool, kind: str, family: str | None, fp32_on_cuda: bool
    ) -> None:
        """Refuse what fp8 engines cannot run, naming the field: `family` is the tiny model's
        (a model loaded from a path is checked when its engines start)."""
        if self.quantization == "none":
            return
        refusals = {
            "trainer.true_on_policy (fp8 weights cannot give the trainer's log-probs bit for "
            "bit)": true_on_policy,
            "model.kind=diffusion (its engine has no fp8 path)": kind == "diffusion",
            f"model.tiny.family={family} (fp8 runs in the engine's lean forward, which reads "
            f"{', '.join(LEAN_FAMILIES)})": family not in (None, *LEAN_FAMILIES),
            "trainer.dtype=float32 on CUDA (the fp8 GEMM writes bf16 there: set "
            "trainer.dtype=bfloat16)": fp32_on_cuda,
        }
        for field, on in refusals.items():
            if on:
                raise ValueError(f"engine.quantization=fp8 does not work with {field}")
