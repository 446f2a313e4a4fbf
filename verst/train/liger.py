"""`trainer.kernels: liger`: Liger's Triton kernels for RMSNorm, the SwiGLU MLP and rotary
embedding in the policy's layers (CUDA). Each replaces several elementwise kernels, which
take more of a trainer step's device time than the GEMMs do at 0.5B (docs/performance.md)."""

from __future__ import annotations

import inspect

import torch

from verst.train.activation_checkpointing import base_model


def apply_liger(model: torch.nn.Module, device: torch.device) -> None:
    """Patch `model`'s norms, MLPs and rotary embedding with Liger's kernels, in place; the
    parameters and their names stay. Liger also swaps the family's norm and MLP classes and
    its rotary function in transformers' module, so models of that family built later in this
    process (a KL reference, say) run its kernels too: the same math."""
    if device.type != "cuda":
        raise ValueError(
            f"trainer.kernels=liger runs Liger's Triton kernels, which need CUDA; the trainer "
            f"is on {device.type}: use trainer.kernels=torch"
        )
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as error:
        raise ImportError(
            "trainer.kernels=liger needs liger-kernel: pip install 'verst[liger]'"
        ) from error
    base = base_model(model)
    model_type = base.config.model_type
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ValueError(
            f"trainer.kernels=liger: Liger has no kernels for model_type {model_type!r} "
            f"(it covers {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})"
        )
    wanted = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False)
    wanted["fused_linear_cross_entropy"] = False  # the trainer scores tokens itself
    accepted = inspect.signature(apply).parameters
    apply(model=base, **{key: value for key, value in wanted.items() if key in accepted})
