"""One forward pass of a batch of rows over the paged KV pool, eager or replayed from a CUDA graph.

Owns `ModelRunner`. The scheduler hands it, per running request, the tokens to feed, how many
tokens of the request are already in the pool, its page list, and whether it needs every
position's logits (prompt scoring) or only the last one. The runner builds the step's index
tensors (a handful of host-to-device copies, no per-token Python), runs the decoder, applies the
LM head only where logits are wanted, and returns them. Llama-family models run the engine's
own forward (`lean_decoder`) with fused kernels (C on the CPU, Triton on CUDA); others run HF's
layers with attention routed to `paged_attention`, their RMSNorms fused on CUDA and their bf16
linear layers packed for oneDNN on the CPU (`packed_linear`). Either way new K/V are written
into the pool in place; nothing is gathered into an HF cache.

Decode steps (one token a row) on CUDA replay a CUDA graph captured per batch-size bucket:
inputs are copied into one static buffer, padding rows write the pool's scratch slot, and the
Triton decode kernel reads each row's pages up to its own length, so one graph serves every
sequence length up to `graph_max_len`. Weight updates copy into the same parameter storage,
so the graphs stay valid across them. A mixed step (prompt chunks beside decode rows) runs its
decode rows this way and the rest through the general path.

An overlapped decode step (`verst.engine.overlap`) feeds tokens the host has not read yet: each
row names its row of the previous step's sampled tokens (`Row.source`), and after the meta's
copy to the device its token column is gathered from that tensor, on the device, in stream
order. The meta goes through pinned staging buffers used in turn (`StagingRing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verst.engine.adapters import DEFAULT_MAX_ADAPTERS, AdapterRegistry, AdapterRows
from verst.engine.config import QUANTIZATIONS, Quantization
from verst.engine.kernels.cpu import CpuKernels
from verst.engine.kernels.cpu import load as load_cpu_kernels
from verst.engine.kernels.cuda import CudaKernels
from verst.engine.kernels.fp8_linear import check_device as check_fp8_device
from verst.engine.kernels.fused_norm import fusable_norms, fused_norms
from verst.engine.kernels.packed_linear import PackedLinears
from verst.engine.kernels.paged_decode import paged_decode_triton
from verst.engine.kv_pool import KVPool
from verst.engine.lean_decoder import SUPPORTED_MODEL_TYPES, LeanDecoder
from verst.engine.paged_attention import (
    PagedStep,
    model_window,
    paged_attention_mode,
    triton,
)
from verst.engine.staging import StagingRing
from verst.models import batch_invariant as bi
from verst.models.forward import shape_free_attention
from verst.models.invariant_forward import InvariantDecoder, KeySource
from verst.models.moe import hook_routers, routing_shape, use_grouped_experts

_META = 5  # decode meta columns before the page table: token, position, slot, length, adapter
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)


@dataclass
class Row:
    """One request's part of a step."""

    tokens: list[int]  # the tokens to feed now
    past: int  # tokens of this request already in the pool
    pages: list[int]  # covers past + len(tokens)
    all_logits: bool = False  # logits of every fed position, not only the last
    adapter: int | None = None  # its LoRA adapter's slot in the runner's registry; None: base
    # an overlapped decode row: its row of the previous step's sampled tokens, which it feeds
    # (`tokens` then holds a placeholder)
    source: int | None = None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits_B_V: torch.Tensor


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        *,
        pad_token_id: int = 0,
        cuda_graphs: bool | None = None,
        graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES,
        graph_max_len: int | None = None,
        lean: bool = True,
        fused_kernels: bool = True,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
        true_on_policy: bool = False,
        quantization: Quantization = "none",
    ) -> None:
        """`true_on_policy`: every forward (decode and prefill) through the batch-invariant
        forward the trainer runs too (`invariant_forward`): no fused kernels or packing; its
        decode steps on CUDA replay graphs too, one per batch bucket and span of pages read.
        `quantization` fp8: the lean forward's projections on fp8 weights (`fp8_linear`)."""
        check_quantization(quantization, pool, lean=lean, true_on_policy=true_on_policy)
        self.model = model
        self.pool = pool
        self.pad_token_id = pad_token_id
        self.device = pool.device
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        config = model.config
        self.softcap = getattr(config, "final_logit_softcapping", None)
        # rows longer than this attend through windowed masks in the sliding layers
        self.window = model_window(config)
        on_cuda = self.device.type == "cuda"
        self.invariant = InvariantDecoder(model) if true_on_policy else None
        if true_on_policy:
            lean = fused_kernels = False
        self.use_triton = on_cuda and triton is not None and not true_on_policy
        # the invariant forward's GEMMs are Triton kernels too (`invariant_cuda`)
        graphable = self.use_triton or (on_cuda and true_on_policy)
        self.cuda_graphs = graphable if cuda_graphs is None else (cuda_graphs and graphable)
        self.graph_batch_sizes = tuple(sorted(graph_batch_sizes))
        max_len = graph_max_len or int(getattr(config, "max_position_embeddings", 0) or 4096)
        self.graph_pages = -(-max_len // pool.page_size)
        self._graphs: dict[tuple[int, bool, int], _Graph] = {}  # by (bucket, windowed, span)
        self._graph_pool = None
        self._meta: torch.Tensor | None = None  # static inputs of the graphs
        self._staging: StagingRing | None = None  # the host side of `_meta`'s copies
        self.kernels = self._fused_kernels(config) if fused_kernels else None
        # decode attention reads each row's pages in place where a kernel does it
        self.decode_kernel: Callable[..., torch.Tensor] | None = None
        # (latent attention's K and V heads differ in width; the kernels read one width)
        one_width = pool.head_dim == pool.v_head_dim
        if self.use_triton and one_width:
            self.decode_kernel = paged_decode_triton
        elif isinstance(self.kernels, CpuKernels) and one_width:
            self.decode_kernel = self.kernels.paged_decode
        # Llama-family models run the engine's own forward (`lean_decoder`); others run HF's,
        # with the RMSNorms as one Triton kernel each on CUDA (`fused_norm`) and the bf16
        # linear layers on weights packed once for oneDNN on the CPU
        self.lean = self._lean_forward(quantization) if lean else None
        hf = self.lean is None
        self.fused = fusable_norms(model) if hf and self.use_triton else []
        self.packed = PackedLinears.of(model) if hf and not on_cuda and not true_on_policy else None
        # LoRA adapters served beside the frozen base, run by the lean forward
        self.adapters = AdapterRegistry.of(model, max_adapters) if self.lean is not None else None
        self._graphs_structure = 0  # the registry's structure the graphs were captured with
        # MoE: experts as one grouped GEMM; the experts of every token fed are kept beside its
        # KV in the pool (`KVPool.routed_rows`: SGLang's routed_experts), by router hooks that
        # write while the runner's decoder runs (the slots of the step it runs)
        self.routing = routing_shape(model)
        self._step_slots_N: torch.Tensor | None = None
        if self.routing is not None:
            use_grouped_experts(model)
            pool.keep_routing(self.routing.layers, self.routing.top_k)
            hook_routers(model, self._record_routing)
            # the grouped GEMM's per-expert offsets come from the host: a CUDA graph cannot
            # capture them (seen on the H200: "Cannot copy between CPU and CUDA tensors during
            # CUDA graph capture"), so MoE decode runs eagerly
            self.cuda_graphs = False

    def _fused_kernels(self, config) -> CpuKernels | CudaKernels | None:
        """C on the CPU (norms, rotary, decode attention; `cpu_kernels`), Triton on CUDA (norms,
        rotary, SiLU-and-multiply; `cuda_kernels`), where they fit the model."""
        dtype = self.pool.dtype
        if self.device.type == "cuda":
            return CudaKernels() if self.use_triton and CudaKernels.fits(config, dtype) else None
        return load_cpu_kernels() if CpuKernels.fits(config, dtype) else None

    def _lean_forward(self, quantization: Quantization) -> LeanDecoder | None:
        """The engine's own forward of the model, or None where it runs HF's layers; fp8
        projections run only in the former."""
        fp8 = quantization == "fp8"
        lean = LeanDecoder.of(self.model, self.kernels, fp8)
        if lean is None and fp8:
            raise ValueError(
                f"engine.quantization=fp8 runs in the engine's lean forward, which does not "
                f"read {self.model.config.model_type!r} models (it reads "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} with SiLU MLPs and plain linear "
                "projections); use engine.quantization=none"
            )
        return lean

    # --- public ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self, rows: list[Row], sampled_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(last-position logits [B, V], {row: logits [n, V]} of all_logits rows), float32.
        `sampled_B`: the previous step's sampled tokens, on the device, which rows with a
        `source` feed (an overlapped step: decode rows only)."""
        if self.lean is not None:
            self.lean.refresh()
        if sampled_B is not None and any(len(r.tokens) != 1 for r in rows):
            raise ValueError("an overlapped step feeds one token a row (decode rows only)")
        with contextlib.ExitStack() as scope:
            if self.packed is not None:
                scope.enter_context(self.packed.swapped())
            if sampled_B is not None:
                return self._decode(rows, sampled_B), {}
            return self._forward_rows(rows)

    def weights_changed(self) -> None:
        """Every weight update and version bump comes through here: derived copies of the
        weights (the CPU's packed linears) are made again before the next forward."""
        if self.packed is not None:
            self.packed.stale()
        if self.lean is not None:
            self.lean.stale()

    def quantized_tensors(self) -> list[torch.Tensor]:
        """The fp8 copies of the weights (`engine.quantization`): weights too, to the memory."""
        return list(self.lean.quantized.tensors()) if self.lean is not None else []

    def _forward_rows(self, rows: list[Row]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        decoding = [i for i, r in enumerate(rows) if len(r.tokens) == 1]
        if len(decoding) == len(rows):
            return self._decode(rows), {}
        if not decoding:
            return self._general(rows)
        # A mixed step runs as two forwards: padded into one batch, every decode row would
        # compute as many positions as the longest prompt chunk, and none could use the graphs.
        feeding = [i for i, r in enumerate(rows) if len(r.tokens) > 1]
        general_last, general_full = self._general([rows[i] for i in feeding])
        decode_last = self._decode([rows[i] for i in decoding])
        last_B_V = decode_last.new_empty((len(rows), decode_last.shape[1]))
        last_B_V[decoding] = decode_last
        last_B_V[feeding] = general_last
        return last_B_V, {feeding[j]: logits for j, logits in general_full.items()}

    @torch.no_grad()
    def capture_graphs(self, max_batch: int) -> None:
        """Capture the decode graphs of every bucket up to `max_batch` now (else on first use)."""
        if not self.cuda_graphs or self.invariant is not None:
            return  # the invariant decode's graphs depend on the span too: captured as met
        if self.lean is not None:
            self.lean.refresh()
        span = self._span(1)
        for size in reversed(self.graph_batch_sizes):
            if size <= self._bucket(max_batch) and (size, False, span) not in self._graphs:
                self._capture(size, False, span)

    # --- decode ---------------------------------------------------------------------------------

    def _decode(self, rows: list[Row], sampled_B: torch.Tensor | None = None) -> torch.Tensor:
        page = self.pool.page_size
        B = len(rows)
        width = max(-(-(r.past + 1) // page) for r in rows)
        bucket = self._bucket(B)
        graphed = self.cuda_graphs and bucket is not None and width <= self.graph_pages
        size = bucket if graphed else B
        windowed = self._windowed(max(r.past + 1 for r in rows))
        base = self._base_slot()
        # one host tensor: token, position, slot, sequence length, adapter, page table
        meta = [
            [
                r.tokens[0] if r.source is None else r.source,
                r.past,
                r.pages[r.past // page] * page + r.past % page,
                r.past + 1,
                base if r.adapter is None else r.adapter,
                *r.pages[:width],
                *([0] * (width - min(len(r.pages), width))),
            ]
            for r in rows
        ]
        pad_row = [0, 0, self.pool.scratch_slot, 1, base] + [0] * width
        meta += [pad_row] * (size - B)
        meta_B_M = torch.tensor(meta, dtype=torch.long)
        if graphed:
            self._drop_graphs_of_old_adapters()
            key = (bucket, windowed, self._span(width))
            if key not in self._graphs:
                self._capture(*key)
            assert self._meta is not None and self._staging is not None
            # stream order: after the previous replay, which may still read `_meta`
            self._staging.copy_to(self._meta[:size, : _META + width], meta_B_M)
            if sampled_B is not None:
                _feed_sampled(self._meta[:B], sampled_B)
            entry = self._graphs[key]
            entry.graph.replay()
            return entry.logits_B_V[:B]
        meta_B_M = meta_B_M.to(self.device, non_blocking=True)
        if sampled_B is not None:
            _feed_sampled(meta_B_M[:B], sampled_B)
        adapted = any(r.adapter is not None for r in rows)
        return self._decode_eager(meta_B_M, adapted, windowed)[:B]

    def _windowed(self, longest: int) -> bool:
        """Whether a sequence of `longest` tokens reaches past the model's shortest window."""
        return self.window is not None and longest > self.window

    def _span(self, width: int) -> int:
        """Pages of page table a decode graph reads for rows of at most `width` pages: all of
        them for the paged kernel (it stops at each row's length); for the invariant forward,
        which reads every page it is given, `width` rounded up to a power of two."""
        if self.invariant is None:
            return self.graph_pages
        return min(self.graph_pages, 1 << (width - 1).bit_length())

    def _decode_eager(
        self, meta_B_M: torch.Tensor, adapted: bool, windowed: bool, trim_keys: bool = True
    ) -> torch.Tensor:
        """One decode step from its meta rows; `adapted`: run the adapters' terms (rows whose
        adapter column is the base slot get zero from them); `windowed`: see `PagedStep`;
        `trim_keys`: see `_pool_keys` (False in a graph)."""
        ids_B_1 = meta_B_M[:, 0:1]
        positions_B_1 = meta_B_M[:, 1:2]
        seq_lens_B = meta_B_M[:, 3].contiguous()
        table_B_P = meta_B_M[:, _META:].contiguous()
        step = PagedStep(
            pool=self.pool,
            slots_N=meta_B_M[:, 2].contiguous(),
            table_B_P=table_B_P,
            past_B=meta_B_M[:, 1].contiguous(),
            decode=True,
            seq_lens_B=seq_lens_B,
            windowed=windowed,
            decode_kernel=self.decode_kernel,
        )
        adapters = self._adapter_rows(meta_B_M[:, 4]) if adapted else None
        hidden_B_1_E = self._run_decoder(
            ids_B_1, positions_B_1, step, adapters, seq_lens_B, trim_keys
        )
        return self._logits(hidden_B_1_E[:, 0])

    def _bucket(self, batch: int) -> int | None:
        for size in self.graph_batch_sizes:
            if size >= batch:
                return size
        return None

    def _capture(self, size: int, windowed: bool, span: int) -> None:
        if self._meta is None:
            rows = self.graph_batch_sizes[-1]
            self._meta = torch.zeros(
                (rows, _META + self.graph_pages), dtype=torch.long, device=self.device
            )
            self._staging = StagingRing(tuple(self._meta.shape), torch.long, self.device)
            self._graph_pool = torch.cuda.graph_pool_handle()
        meta = self._meta[:size, : _META + span]
        meta.zero_()
        meta[:, 2] = self.pool.scratch_slot
        meta[:, 3] = 1
        meta[:, 4] = self._base_slot()
        adapted = self.adapters is not None and not self.adapters.empty
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (Triton compiles, cuBLAS picks kernels)
            for _ in range(2):
                self._decode_eager(meta, adapted, windowed, trim_keys=False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (another in-process engine, the trainer) may sync the
        # device while this one captures
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            logits = self._decode_eager(meta, adapted, windowed, trim_keys=False)
        self._graphs[(size, windowed, span)] = _Graph(graph, logits)

    def drop_graphs(self) -> None:
        """Forget every captured graph and its memory pool (the KV pool or the weights move)."""
        if self._graph_pool is not None:
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._meta = self._staging = None
        self._graph_pool = None

    def _drop_graphs_of_old_adapters(self) -> None:
        """Graphs read the adapters' stacked buffers by address: capture again once the
        registry made new ones (or holds its first adapter)."""
        structure = self.adapters.structure if self.adapters is not None else 0
        if structure != self._graphs_structure:
            self._graphs.clear()
            if self._graph_pool is not None:  # the old graphs' pool is not for new captures
                torch.cuda.synchronize(self.device)
                self._graph_pool = torch.cuda.graph_pool_handle()
            self._graphs_structure = structure

    # --- adapters -------------------------------------------------------------------------------

    def _base_slot(self) -> int:
        return self.adapters.base_slot if self.adapters is not None else 0

    def _adapter_rows(self, slots_B: torch.Tensor) -> AdapterRows | None:
        return self.adapters.rows(slots_B) if self.adapters is not None else None

    # --- prefill and mixed steps ----------------------------------------------------------------

    def _general(self, rows: list[Row]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        device, page = self.device, self.pool.page_size
        B = len(rows)
        new = [len(r.tokens) for r in rows]
        T = max(new)
        width = max(-(-(r.past + n) // page) for r, n in zip(rows, new, strict=True))
        ids_B_T = torch.tensor(
            [r.tokens + [self.pad_token_id] * (T - len(r.tokens)) for r in rows], dtype=torch.long
        ).to(device, non_blocking=True)
        table_B_P = torch.tensor(
            [r.pages[:width] + [0] * (width - min(len(r.pages), width)) for r in rows],
            dtype=torch.long,
        ).to(device, non_blocking=True)
        past_B = torch.tensor([r.past for r in rows], dtype=torch.long).to(
            device, non_blocking=True
        )
        new_B = torch.tensor(new, dtype=torch.long).to(device, non_blocking=True)
        steps_T = torch.arange(T, device=device)
        positions_B_T = past_B[:, None] + steps_T
        valid_B_T = steps_T < new_B[:, None]
        page_B_T = table_B_P.gather(1, (positions_B_T // page).clamp(max=width - 1))
        slots_B_T = torch.where(
            valid_B_T, page_B_T * page + positions_B_T % page, self.pool.scratch_slot
        )
        fresh = all(r.past == 0 for r in rows)
        step = PagedStep(
            pool=self.pool,
            slots_N=slots_B_T.reshape(-1),
            table_B_P=table_B_P,
            past_B=past_B,
            fresh=fresh,
            windowed=self._windowed(max(r.past + n for r, n in zip(rows, new, strict=True))),
        )
        adapters = None
        if any(r.adapter is not None for r in rows):
            base = self._base_slot()
            slots_B = torch.tensor([base if r.adapter is None else r.adapter for r in rows])
            adapters = self._adapter_rows(slots_B.to(device, non_blocking=True))
        hidden_B_T_E = self._run_decoder(ids_B_T, positions_B_T, step, adapters, past_B + new_B)
        # the LM head only where logits are wanted
        wanted: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        last: list[int] = []
        for b, (r, n) in enumerate(zip(rows, new, strict=True)):
            if r.all_logits:
                spans[b] = (len(wanted), n)
                wanted.extend(range(b * T, b * T + n))
                last.append(len(wanted) - 1)
            else:
                last.append(len(wanted))
                wanted.append(b * T + n - 1)
        index = torch.tensor(wanted, dtype=torch.long).to(device, non_blocking=True)
        logits_N_V = self._logits(hidden_B_T_E.reshape(B * T, -1).index_select(0, index))
        last_B_V = logits_N_V[torch.tensor(last, dtype=torch.long).to(device, non_blocking=True)]
        return last_B_V, {b: logits_N_V[s : s + n] for b, (s, n) in spans.items()}

    # --- shared ---------------------------------------------------------------------------------

    def _run_decoder(
        self,
        ids_B_T: torch.Tensor,
        positions_B_T: torch.Tensor,
        step: PagedStep,
        adapters: AdapterRows | None = None,
        key_lens_B: torch.Tensor | None = None,
        trim_keys: bool = True,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, E]; `key_lens_B`: each row's tokens in the pool once
        this step's are written (read by the true on-policy forward). SDPA's backends are
        chosen here, not around a graph's replay, which runs no SDPA call."""
        with shape_free_attention(self.device):
            if self.invariant is not None:
                assert key_lens_B is not None
                keys = self._pool_keys(step, key_lens_B, trim_keys)
                return self.invariant.hidden(ids_B_T, positions_B_T, keys)
            if self.lean is not None:
                return self.lean.hidden(ids_B_T, positions_B_T, step, adapters)
            self._step_slots_N = step.slots_N
            try:
                with paged_attention_mode(self.model), fused_norms(self.fused):
                    out = self.decoder(
                        input_ids=ids_B_T,
                        position_ids=positions_B_T,
                        use_cache=False,
                        verst_paged=step,
                    )
            finally:
                self._step_slots_N = None
            return out.last_hidden_state

    def _record_routing(self, layer: int, router: torch.nn.Module, output: tuple) -> None:
        # the trainer may run the very same modules (embedded mode): only the runner's records
        if self._step_slots_N is not None:
            self.pool.record_routing(layer, self._step_slots_N, output[2])

    def _pool_keys(self, step: PagedStep, key_lens_B: torch.Tensor, trim_keys: bool) -> KeySource:
        """The true on-policy forward's keys: this step's K/V written into the pool, then each
        row's keys read back heads first, [B, G, W, D], in one gather per layer. Positions at
        or past a row's length read its first key instead (a stale or never-written slot may
        hold NaN, and NaN · 0 is NaN). `trim_keys`: W only as wide as the longest row (reading
        its length costs a host sync, which a CUDA graph's capture cannot have); else every
        page of the table."""
        pool, page = self.pool, self.pool.page_size
        B, P = step.table_B_P.shape
        G = pool.num_kv_heads
        W = bi.key_width(int(key_lens_B.max()) if trim_keys else P * page)
        keys_W = torch.arange(W, device=self.device)
        page_B_W = step.table_B_P.gather(1, (keys_W // page).clamp(max=P - 1).expand(B, W))
        slots_B_W = page_B_W * page + keys_W % page
        slots_B_W = torch.where(keys_W < key_lens_B[:, None], slots_B_W, slots_B_W[:, :1])
        # row slot · G + g of the pool as [slots · G, D]: K and V come out heads first
        rows_N = (slots_B_W[:, None] * G + torch.arange(G, device=self.device)[:, None]).view(-1)

        def keys(layer: int, k_B_T_G_D: torch.Tensor, v_B_T_G_D: torch.Tensor):
            out = []
            for flat, new_B_T_G_D in zip(pool.flat(layer), (k_B_T_G_D, v_B_T_G_D), strict=True):
                D = flat.shape[-1]
                flat.index_copy_(0, step.slots_N, new_B_T_G_D.reshape(-1, G, D).to(pool.dtype))
                out.append(flat.view(-1, D).index_select(0, rows_N).view(B, G, W, D))
            return out[0], out[1]

        return keys

    def _logits(self, hidden_N_E: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            return self.invariant.logits(hidden_N_E)
        if self.lean is not None:
            logits_N_V = self.lean.logits(hidden_N_E).float()
        else:
            logits_N_V = self.lm_head(hidden_N_E).float()
        if self.softcap:
            logits_N_V = torch.tanh(logits_N_V / self.softcap) * self.softcap
        return logits_N_V


def _feed_sampled(meta_B_M: torch.Tensor, sampled_B: torch.Tensor) -> None:
    """Column 0 of each meta row holds the row of `sampled_B` it feeds: put that token there
    (on the device, after the meta's copy in stream order; no host sync)."""
    meta_B_M[:, 0] = sampled_B.index_select(0, meta_B_M[:, 0])


def check_quantization(
    quantization: str, pool: KVPool, *, lean: bool, true_on_policy: bool
) -> None:
    """Refuse a quantization the engine cannot run as asked, naming what stands in the way."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return
    if true_on_policy:
        raise ValueError(
            "engine.quantization=fp8 with trainer.true_on_policy: fp8 weights cannot give the "
            "trainer's log-probs bit for bit"
        )
    if not lean:
        raise ValueError("engine.quantization=fp8 runs in the engine's lean forward (lean=True)")
    check_fp8_device(pool.device, pool.dtype)
