"""The engine's own forward of a Llama-family decoder: the same math as HF's, a third of the ops.

On the CPU a small model's decode step is mostly per-op overhead: HF's decoder layer runs about
75 ops (each RMSNorm is six, rotary is seven a tensor, three Q/K/V and two gate/up linears),
each costing several microseconds however small the tensors are. `LeanDecoder` runs the same
layers, reading the same parameters, with:

- Q/K/V as one linear and gate/up as one linear: on the CPU where the weights are packed for
  oneDNN (the bf16 case; the packed copy is made from the concatenated weights, so fusing
  costs no memory beyond packing), on CUDA always, the parameters re-pointed as views into one
  buffer per projection group (`OneBuffer`: updates written in place land in it);
- RMSNorm (fused with the residual add before it), the per-head norm with rotary, and (on
  CUDA) SiLU-and-multiply as one kernel each, from the kernel set the runner passes: C on the
  CPU (`cpu_kernels`), Triton on CUDA (`cuda_kernels`); all round where HF's code rounds;
- without kernels, RMSNorm as `F.rms_norm` then the weight multiply, and rotary as one `flip`
  and three elementwise ops per tensor (HF's `rotate_half` is a `cat` of a negated half; the
  sign moves onto a per-step copy of `sin`, which is exact);
- attention through `paged_attention.attend`, the kernel HF's attention hook calls;
- with `fp8` (`engine.quantization`), the projections as fp8 GEMMs on quantized copies of their
  weights (`fp8_linear`); embeddings, norms and the LM head stay in the model's dtype.

It serves the architectures whose layers it can read (`LeanDecoder.of` returns None for any
other model, which then runs HF's forward): Llama, Mistral, Qwen2 and Qwen3 with SiLU MLPs and
plain `nn.Linear` projections, or peft LoRA layers over them (the adapters run in this forward,
beside the frozen base), and the LoRA adapters of the engine's own registry (`adapters`), a
row's adapter chosen per request. Derived weights (packed, concatenated, quantized) are cached
in `DerivedWeights` and made again whenever a source weight changes (the fp8 copies in their own
memory, before the forward that first needs them: `refresh`). A layer's sliding window
(Mistral's, or a Qwen layer's marked "sliding_attention") goes to `attend` as HF's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verst.engine.adapters import AdapterRows
from verst.engine.kernels.cpu import CpuKernels
from verst.engine.kernels.cuda import CudaKernels
from verst.engine.kernels.fp8_linear import Fp8Weight, fp8_linear
from verst.engine.kernels.fp8_linear import check_shape as check_fp8_shape
from verst.engine.kernels.fused_norm import FUSABLE
from verst.engine.kernels.packed_linear import DerivedWeights, pack_weight, packable, packed_linear
from verst.engine.kv_pool import attention_shape
from verst.engine.paged_attention import PagedStep, attend
from verst.models.lora import ADAPTER, is_lora_layer

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
# the tiny families (`verst.models.families`) whose models it reads
LEAN_FAMILIES = ("qwen3", "qwen2", "llama", "llama3", "mistral")


class _Linears:
    """One or more `nn.Linear`s over the same input, run as one packed oneDNN call when the
    weights are packable (bf16, CPU), as one fp8 GEMM on their quantized concatenation with
    `fp8`, else one `F.linear` each; returns one output each.

    A LoRA layer (peft's, `verst.models.lora`) runs as its frozen base linear here, plus its
    adapter's low-rank update added to that output, in peft's order (base + B(A(x)) · scale),
    so the adapters are applied in the forward and never merged into the base."""

    def __init__(
        self,
        name: str,
        modules: list[torch.nn.Module],
        derived: DerivedWeights,
        module_names: list[str] | None = None,
        fp8: bool = False,
    ):
        self.name, self.derived = name, derived
        self.module_names = module_names or []  # HF's names, for the engine's adapter registry
        self.modules = [m.base_layer if is_lora_layer(m) else m for m in modules]
        self.adapted = [m if is_lora_layer(m) else None for m in modules]
        self.sizes = [m.out_features for m in self.modules]
        self.fp8 = fp8
        self.packed = not fp8 and packable(self.modules[0].weight)
        if fp8:
            check_fp8_shape(name, sum(self.sizes), self.modules[0].in_features)
        fusable = not fp8 and not self.packed and len(self.modules) > 1
        self.one_buffer = OneBuffer.of(self.modules) if fusable else None

    def __call__(self, x: torch.Tensor, adapters: AdapterRows | None = None) -> list[torch.Tensor]:
        outs = self._base(x)
        for i, layer in enumerate(self.adapted):
            if layer is not None:
                a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
                outs[i] = outs[i] + F.linear(F.linear(x, a), b) * layer.scaling[ADAPTER]
        if adapters is not None:
            for i, module in enumerate(self.module_names):
                delta = adapters.delta(module, x)
                if delta is not None:
                    outs[i] = outs[i] + delta
        return outs

    def fp8_weight(self) -> Fp8Weight:
        """The quantized concatenation of the weights (per-channel scales equal each one's)."""
        weights = [m.weight for m in self.modules]
        return self.derived.get(
            self.name,
            weights,
            lambda: Fp8Weight.of(_joined(weights)),
            lambda copy: copy.refill(_joined(weights)),
        )

    def bias(self) -> torch.Tensor | None:
        biases = [m.bias for m in self.modules if m.bias is not None]
        if not biases:
            return None
        if len(biases) == 1:
            return biases[0]
        return self.derived.get(
            self.name + ".bias",
            biases,
            lambda: _joined(biases),
            lambda copy: copy.copy_(_joined(biases)),
        )

    def _base(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.one_buffer is not None and self.one_buffer.intact():
            out = F.linear(x, self.one_buffer.weight, self.one_buffer.bias)
        elif self.fp8:
            out = fp8_linear(x, self.fp8_weight(), self.bias())
        elif self.packed:
            weights = [m.weight for m in self.modules]
            packed = self.derived.get(self.name, weights, lambda: pack_weight(_joined(weights)))
            out = packed_linear(x, packed, self.bias())
        else:
            return [F.linear(x, m.weight, m.bias) for m in self.modules]
        return list(out.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [out]


class OneBuffer:
    """The weights (and biases) of linears over the same input, re-pointed as views into one
    buffer each, so that they run as one GEMM on CUDA (Q/K/V: three GEMMs of a few microseconds
    become one) while every in-place write to a parameter (a weight update's `copy_`, a
    checkpoint load) lands in the buffer: no copy to refresh, nothing extra in memory.

    A parameter re-pointed elsewhere afterwards (a zero-copy share of the trainer's storage, a
    move between devices) is no longer its view: `intact` says so and the linears run apart
    again, on whatever the parameters now hold. Releasing and resuming the engine's memory
    (`verst.engine.memory`) resizes the shared storage in place, which keeps the views."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        weights = [m.weight for m in modules]
        biases = [m.bias for m in modules if m.bias is not None]
        self.weight = _rehomed(weights)
        self.bias = _rehomed(biases) if biases else None
        # each parameter with its buffer and byte offset there: re-read at each check, since
        # a resized storage moves the buffer and its views together
        pairs = [(p, self.weight) for p in weights] + [(p, self.bias) for p in biases]
        self._homes = [(p, buf, p.data_ptr() - buf.data_ptr()) for p, buf in pairs]

    @classmethod
    def of(cls, modules: list[torch.nn.Module]) -> OneBuffer | None:
        """One buffer for `modules`' parameters on CUDA, where fusing pays; None on the CPU,
        or when their dtypes or devices differ, or only some have a bias."""
        weights = [m.weight for m in modules]
        if weights[0].device.type != "cuda":
            return None
        if len({(w.dtype, w.device, w.shape[1:]) for w in weights}) != 1:
            return None
        if len({m.bias is None for m in modules}) != 1:
            return None
        return cls(modules)

    def intact(self) -> bool:
        """Whether every parameter is still the view of the buffer it was made."""
        return all(p.data_ptr() == buf.data_ptr() + offset for p, buf, offset in self._homes)


def _rehomed(params: list[torch.Tensor]) -> torch.Tensor:
    """One buffer holding `params` end to end, each parameter now a view of its rows."""
    buffer = torch.cat([p.detach() for p in params])
    offset = 0
    for p in params:
        p.data = buffer[offset : offset + p.shape[0]]
        offset += p.shape[0]
    return buffer


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated along their first dimension (one alone is itself, detached)."""
    if len(tensors) == 1:
        return tensors[0].detach()
    return torch.cat([t.detach() for t in tensors])


@dataclass
class _Norm:
    module: torch.nn.Module
    kernels: CpuKernels | CudaKernels | None

    @property
    def eps(self) -> float:
        return self.module.variance_epsilon

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, eps = self.module.weight, self.eps
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, eps)
        return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's residual add, then this norm: (x + residual, its norm)."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, residual, self.module.weight, self.eps)
        total = residual + x
        return total, self(total)


@dataclass
class _Layer:
    index: int
    input_norm: _Norm
    qkv: _Linears
    q_norm: _Norm | None
    k_norm: _Norm | None
    o: _Linears
    post_norm: _Norm
    gate_up: _Linears
    down: _Linears
    scaling: float
    window: int | None  # the layer's sliding window, as HF's attention passes it


class LeanDecoder:
    def __init__(
        self,
        model: torch.nn.Module,
        kernels: CpuKernels | CudaKernels | None = None,
        fp8: bool = False,
    ) -> None:
        """`fp8`: the projections (Q/K/V, O, gate/up, down) run on fp8 copies of their weights;
        embeddings, norms and the LM head stay in the model's dtype."""
        self.kernels = kernels
        self.fp8 = fp8
        self.decoder = model.get_decoder()
        self.heads, self.kv_heads, self.head_dim = attention_shape(model.config)
        self.derived = DerivedWeights()
        self.quantized = DerivedWeights()  # the fp8 copies, apart: the engine's memory tags them
        self._quantized_fresh = False
        self.module_names = {id(m): name for name, m in model.named_modules()}
        self.layers = [self._layer(i, layer) for i, layer in enumerate(self.decoder.layers)]
        self.final_norm = self._norm(self.decoder.norm)
        self.head = _Linears("lm_head", [model.get_output_embeddings()], self.derived)

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        kernels: CpuKernels | CudaKernels | None = None,
        fp8: bool = False,
    ) -> LeanDecoder | None:
        """The lean forward of `model` (norms and rotary by `kernels` where given, projections
        in fp8 with `fp8`), or None when its architecture is not one it reads."""
        return cls(model, kernels, fp8) if readable(model) else None

    def stale(self) -> None:
        """The weights changed: derived copies are made again before the next use."""
        self.derived.stale()
        self.quantized.stale()
        self._quantized_fresh = False

    def refresh(self) -> None:
        """Quantize the weights changed since `stale` now, into the fp8 copies' own memory: a
        replayed CUDA graph reads them by address, without asking."""
        if not self.fp8 or self._quantized_fresh:
            return
        for layer in self.layers:
            for linears in (layer.qkv, layer.o, layer.gate_up, layer.down):
                linears.fp8_weight()
                linears.bias()
        self._quantized_fresh = True

    def hidden(
        self,
        ids_B_T: torch.Tensor,
        positions_B_T: torch.Tensor,
        step: PagedStep,
        adapters: AdapterRows | None = None,
    ) -> torch.Tensor:
        """The final-norm hidden states [B, T, E] of the fed tokens (K/V written to the pool),
        each row with its LoRA adapter from the engine's registry where `adapters` says."""
        x_B_T_E = self.decoder.embed_tokens(ids_B_T)
        cos_B_T_D, sin_B_T_D = self.decoder.rotary_emb(x_B_T_E, positions_B_T)
        if self.kernels is not None:
            rotary = (cos_B_T_D.reshape(-1, self.head_dim), sin_B_T_D.reshape(-1, self.head_dim))
        else:
            # rotate_half(x) * sin == flip_halves(x) * signed_sin, the first half's sign moved
            half = self.head_dim // 2
            signed_sin_B_T_D = torch.cat([-sin_B_T_D[..., :half], sin_B_T_D[..., half:]], dim=-1)
            rotary = (cos_B_T_D.unsqueeze(2), signed_sin_B_T_D.unsqueeze(2))
        # each residual add runs with the norm after it: a layer's post-attention norm, then the
        # next layer's input norm (the final norm after the last layer)
        residual_B_T_E = x_B_T_E
        h_B_T_E = self.layers[0].input_norm(residual_B_T_E)
        after = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        for layer, next_norm in zip(self.layers, after, strict=True):
            attn_B_T_E = self._attention(layer, h_B_T_E, rotary, step, adapters)
            residual_B_T_E, h_B_T_E = layer.post_norm.add(attn_B_T_E, residual_B_T_E)
            residual_B_T_E, h_B_T_E = next_norm.add(
                self._mlp(layer, h_B_T_E, adapters), residual_B_T_E
            )
        return h_B_T_E

    def logits(self, hidden_N_E: torch.Tensor) -> torch.Tensor:
        return self.head(hidden_N_E)[0]

    def separate_projections(self) -> None:
        """Run Q, K, V, gate and up as a GEMM each again, on the same parameters: the baseline
        of the fused GEMMs in `bench/engine_forward_ab.py`."""
        for layer in self.layers:
            layer.qkv.one_buffer = layer.gate_up.one_buffer = None

    # --- internals ------------------------------------------------------------------------------

    def _layer(self, index: int, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return _Layer(
            index=index,
            input_norm=self._norm(layer.input_layernorm),
            qkv=self._linears(f"{index}.qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
            q_norm=self._norm(q_norm) if q_norm is not None else None,
            k_norm=self._norm(k_norm) if k_norm is not None else None,
            o=self._linears(f"{index}.o", [attn.o_proj]),
            post_norm=self._norm(layer.post_attention_layernorm),
            gate_up=self._linears(f"{index}.gate_up", [mlp.gate_proj, mlp.up_proj]),
            down=self._linears(f"{index}.down", [mlp.down_proj]),
            scaling=attn.scaling,
            # Mistral's attention reads its window from the config, Qwen's keeps one a layer
            window=getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None)),
        )

    def _linears(self, name: str, modules: list[torch.nn.Module]) -> _Linears:
        names = [self.module_names[id(m)] for m in modules]
        derived = self.quantized if self.fp8 else self.derived
        return _Linears(name, modules, derived, names, fp8=self.fp8)

    def _norm(self, module: torch.nn.Module) -> _Norm:
        return _Norm(module, self.kernels)

    def _attention(
        self,
        layer: _Layer,
        h_B_T_E: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        step: PagedStep,
        adapters: AdapterRows | None,
    ) -> torch.Tensor:
        """The attention block's output [B, T, E] for normed input h (K/V written to the pool)."""
        B, T, _ = h_B_T_E.shape
        D = self.head_dim
        q, k, v = layer.qkv(h_B_T_E, adapters)
        if step.decode and isinstance(self.kernels, CudaKernels) and _same_norms(layer):
            # one kernel: queries and keys normed and rotated, keys and values into the pool
            q_N_H_D = self._rope_store(layer, q, k, v, rotary, step)
            q_B_T_H_D, k_B_T_H_D, v_B_T_H_D = q_N_H_D.view(B, T, self.heads, D), None, None
        else:
            q_B_T_H_D = self._position(q, layer.q_norm, rotary).view(B, T, self.heads, D)
            k_B_T_H_D = self._position(k, layer.k_norm, rotary).view(B, T, self.kv_heads, D)
            v_B_T_H_D = v.view(B, T, self.kv_heads, D)
        out_B_T_H_D = attend(
            step, layer.index, q_B_T_H_D, k_B_T_H_D, v_B_T_H_D, layer.scaling, window=layer.window
        )
        (attn_B_T_E,) = layer.o(out_B_T_H_D.reshape(B, T, -1), adapters)
        return attn_B_T_E

    def _rope_store(
        self,
        layer: _Layer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        step: PagedStep,
    ) -> torch.Tensor:
        assert isinstance(self.kernels, CudaKernels)
        norms = None
        if layer.q_norm is not None and layer.k_norm is not None:
            norms = (layer.q_norm.module.weight, layer.q_norm.eps)
            norms += (layer.k_norm.module.weight, layer.k_norm.eps)
        kv = (*step.pool.flat(layer.index), step.slots_N)
        qkv = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1))
        return self.kernels.rope_store(*qkv, norms, *rotary, kv)

    def _mlp(
        self, layer: _Layer, h_B_T_E: torch.Tensor, adapters: AdapterRows | None
    ) -> torch.Tensor:
        gate, up = layer.gate_up(h_B_T_E, adapters)
        if isinstance(self.kernels, CudaKernels):
            act = self.kernels.silu_mul(gate, up)
        else:  # PyTorch's two ops measured faster than a C loop on the CPU
            act = F.silu(gate) * up
        (mlp_B_T_E,) = layer.down(act, adapters)
        return mlp_B_T_E

    def _position(
        self, x_B_T_X: torch.Tensor, norm: _Norm | None, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Queries or keys [B, T, heads * D] -> the per-head norm (Qwen3) and rotary applied."""
        B, T, _ = x_B_T_X.shape
        x_N_H_D = x_B_T_X.reshape(B * T, -1, self.head_dim)
        if self.kernels is not None:
            weight = norm.module.weight if norm is not None else None
            eps = norm.module.variance_epsilon if norm is not None else 0.0
            return self.kernels.norm_rope(x_N_H_D, weight, eps, *rotary)
        if norm is not None:
            x_N_H_D = norm(x_N_H_D)
        cos_B_T_1_D, signed_sin_B_T_1_D = rotary
        x_B_T_H_D = x_N_H_D.view(B, T, -1, self.head_dim)
        # HF's x * cos + rotate_half(x) * sin, with rotate_half's sign folded into sin
        flipped = x_B_T_H_D.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return x_B_T_H_D * cos_B_T_1_D + flipped * signed_sin_B_T_1_D


def _same_norms(layer: _Layer) -> bool:
    """Whether queries and keys both have a per-head norm (Qwen3) or neither has."""
    return (layer.q_norm is None) == (layer.k_norm is None)


def _unadapted(module: torch.nn.Module) -> torch.nn.Module:
    """A LoRA layer's base linear; the module itself when it has no adapter, or when its
    adapter is not plain LoRA (DoRA, several adapters, merged), which this forward cannot run."""
    if not is_lora_layer(module):
        return module
    plain = (
        list(module.lora_A) == [ADAPTER]
        and not module.merged
        and not module.disable_adapters
        and not module.use_dora.get(ADAPTER, False)
    )
    return module.base_layer if plain else module


def readable(model: torch.nn.Module) -> bool:
    """Whether `LeanDecoder` computes exactly what HF's forward of `model` does."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", None) != "silu" or model.get_output_embeddings() is None:
        return False
    decoder = model.get_decoder()
    if type(decoder.norm).__name__ not in FUSABLE or not hasattr(decoder, "rotary_emb"):
        return False
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n]
        if any(type(_unadapted(m)) is not torch.nn.Linear for m in linears):
            return False
        if any(type(n).__name__ not in FUSABLE for n in norms):
            return False
    return type(model.get_output_embeddings()) is torch.nn.Linear
