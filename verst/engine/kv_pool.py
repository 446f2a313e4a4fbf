"""The paged KV pool: every layer's keys and values in fixed-size pages, and the page allocator.

Owns `KVPool`. Promises:
- storage is allocated once (sized from a byte budget by `from_budget`) and never grows;
- `alloc` is all-or-nothing: it either returns n free pages or raises `OutOfPages`;
- `free` rejects double frees and unknown pages, so ownership bugs fail loudly;
- `write` / `gather` are vectorised scatters and gathers (no per-token Python loops), and
  `gather` returns zeros at every position past a sequence's length.
"""

from __future__ import annotations

from typing import Any

import torch


class OutOfPages(RuntimeError):
    """Fewer free pages than requested; nothing was allocated."""


def attention_shape(config: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, key head dim) of the model an HF config describes."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, kv_head_dims(config)[0]


def kv_head_dims(config: Any) -> tuple[int, int]:
    """(key head dim, value head dim): equal, but for latent attention (DeepSeek's MLA), whose
    query and key heads carry a rotary part beside the part they share with the value."""
    nope = getattr(config, "qk_nope_head_dim", None)
    rope = getattr(config, "qk_rope_head_dim", None)
    v_head_dim = getattr(config, "v_head_dim", None)
    if nope and rope and v_head_dim:
        return nope + rope, v_head_dim
    # Some configs carry head_dim = None rather than omitting it.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim, head_dim


class KVPool:
    """Per-layer K and V storage in fixed-size pages: k[layer] and v[layer] are tensors
    [num_pages, page_size, num_kv_heads, head_dim] (`v_head_dim` for v where it differs)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        v_head_dim: int | None = None,
    ) -> None:
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, value in [
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("v_head_dim", v_head_dim),
            ("page_size", page_size),
            ("num_pages", num_pages),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = torch.device(device)
        # One page more than the allocator hands out: the scratch page, which padding tokens of
        # a fixed-shape batch (CUDA graphs) write instead of anyone's KV.
        k_shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        v_shape = (num_pages + 1, page_size, num_kv_heads, v_head_dim)
        # Zero-initialised so a stale read is recognisable in a debugger, not garbage.
        self._k_store = [
            torch.zeros(k_shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self._v_store = [
            torch.zeros(v_shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.k = [store[:num_pages] for store in self._k_store]
        self.v = [store[:num_pages] for store in self._v_store]
        self.scratch_slot = num_pages * page_size
        # A stack popped from the end: pages come out lowest id first, which keeps runs
        # reproducible and page tables easy to read in tests.
        self._free_stack = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages
        # MoE models: each slot's routed experts [pages + 1, page_size, layers, top_k], kept
        # with its KV, so a prefix the cache serves (or a follower copies) keeps its routing
        self.routed: torch.Tensor | None = None

    @staticmethod
    def page_bytes(
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
    ) -> int:
        """Bytes one page takes across all layers, K and V together."""
        widths = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        return num_layers * page_size * num_kv_heads * widths * dtype.itemsize

    @classmethod
    def from_budget(
        cls,
        model_config: Any,
        *,
        budget_bytes: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVPool:
        """As many pages as fit in `budget_bytes` for the model an HF config describes."""
        num_layers = model_config.num_hidden_layers
        _, num_kv_heads, _ = attention_shape(model_config)
        head_dim, v_head_dim = kv_head_dims(model_config)
        page_bytes = cls.page_bytes(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
            v_head_dim=v_head_dim,
        )
        num_pages = budget_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes is smaller than one page ({page_bytes} bytes: "
                f"{num_layers} layers x {page_size} tokens x {num_kv_heads} kv heads x "
                f"({head_dim} + {v_head_dim}) K and V head dims x {dtype.itemsize} bytes)"
            )
        return cls(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            num_pages=num_pages,
            dtype=dtype,
            device=device,
            v_head_dim=v_head_dim,
        )

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, *, budget_bytes: int | None, page_size: int
    ) -> KVPool:
        """A pool for a loaded model, on its device in its dtype, of `budget_bytes`: by default
        256 MiB on the CPU, half the free GPU memory on CUDA."""
        param = next(model.parameters())
        if budget_bytes is None:
            on_cuda = param.device.type == "cuda"
            budget_bytes = torch.cuda.mem_get_info()[0] // 2 if on_cuda else 256 << 20
        return cls.from_budget(
            model.config,
            budget_bytes=budget_bytes,
            page_size=page_size,
            dtype=param.dtype,
            device=param.device,
        )

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [slots, H, D] views, slot = page * page_size + offset; the
        last page's slots (from `scratch_slot`) belong to no one."""
        k_store, v_store = self._k_store[layer], self._v_store[layer]
        return k_store.view(-1, *k_store.shape[2:]), v_store.view(-1, *v_store.shape[2:])

    def num_free(self) -> int:
        return len(self._free_stack)

    def alloc(self, n: int) -> list[int]:
        """n free pages, or `OutOfPages` (and nothing allocated) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_stack):
            raise OutOfPages(
                f"need {n} KV pages, only {len(self._free_stack)} of {self.num_pages} are free"
            )
        pages = [self._free_stack.pop() for _ in range(n)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; all are checked before any is freed."""
        seen: set[int] = set()
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"unknown KV page {page} (pool has {self.num_pages})")
            if self._is_free[page] or page in seen:
                raise ValueError(f"double free of KV page {page}")
            seen.add(page)
        for page in pages:
            self._is_free[page] = True
        self._free_stack.extend(reversed(pages))

    def copy_pages(self, source: list[int], target: list[int]) -> None:
        """Copy the K and V of pages `source[i]` into pages `target[i]`, in every layer."""
        if len(source) != len(target):
            raise ValueError(f"copy_pages: {len(source)} source pages, {len(target)} targets")
        if not source:
            return
        source_P = torch.tensor(source, dtype=torch.long, device=self.device)
        target_P = torch.tensor(target, dtype=torch.long, device=self.device)
        for store in (*self.k, *self.v, *([] if self.routed is None else [self.routed])):
            store.index_copy_(0, target_P, store.index_select(0, source_P))

    def keep_routing(self, layers: int, top_k: int) -> None:
        """Keep the experts each token is routed to beside its KV (`record_routing`), -1 where
        none was recorded: `layers` × `top_k` int32 a slot."""
        shape = (self.num_pages + 1, self.page_size, layers, top_k)
        self.routed = torch.full(shape, -1, dtype=torch.int32, device=self.device)

    def record_routing(self, layer: int, slots_N: torch.Tensor, ids_N_K: torch.Tensor) -> None:
        """One layer's expert ids [N, k] of the N tokens written to `slots_N` (a step's slots;
        padding writes the scratch page). Device-side only: safe inside a CUDA graph."""
        assert self.routed is not None, "keep_routing was not called"
        flat = self.routed.view(-1, *self.routed.shape[2:])
        flat[slots_N, layer] = ids_N_K.to(torch.int32)

    def routed_rows(self, pages: list[int], n: int) -> torch.Tensor:
        """The routed experts of token positions [0, n) of a sequence in `pages`, on the CPU:
        int32 [n, layers, top_k] (SGLang's `routed_experts` for n = its length − 1)."""
        assert self.routed is not None, "keep_routing was not called"
        if n <= 0:  # nothing fed yet (or its pages gone)
            return torch.empty((0, *self.routed.shape[2:]), dtype=torch.int32)
        if n > len(pages) * self.page_size:
            raise ValueError(f"{n} positions do not fit in {len(pages)} pages")
        pages_P = torch.tensor(pages[: -(-n // self.page_size)], dtype=torch.long)
        rows = self.routed.index_select(0, pages_P.to(self.device)).flatten(0, 1)[:n]
        return rows.cpu()

    def write(
        self,
        layer: int,
        pages_N: torch.Tensor,
        offsets_N: torch.Tensor,
        k_N_H_D: torch.Tensor,
        v_N_H_D: torch.Tensor,
    ) -> None:
        """Scatter N tokens' K and V into their (page, offset-within-page) slots."""
        n = pages_N.shape[0]
        if offsets_N.shape != (n,) or k_N_H_D.shape[0] != n or v_N_H_D.shape[0] != n:
            raise ValueError(
                f"write needs N slots and N tokens: pages {tuple(pages_N.shape)}, "
                f"offsets {tuple(offsets_N.shape)}, k {tuple(k_N_H_D.shape)}, "
                f"v {tuple(v_N_H_D.shape)}"
            )
        index = (pages_N.to(self.device), offsets_N.to(self.device))
        self.k[layer].index_put_(index, k_N_H_D.to(self.dtype))
        self.v[layer].index_put_(index, v_N_H_D.to(self.dtype))

    def gather(
        self, layer: int, page_table_B_P: torch.Tensor, lengths_B: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, S, H, D] with S = P * page_size; positions >= length are zeros.

        page_table_B_P lists each sequence's pages in order, padded with -1.
        """
        B, P = page_table_B_P.shape
        S = P * self.page_size
        page_table_B_P = page_table_B_P.to(self.device)
        # Padding (-1) reads page 0 and is then masked out, which keeps the gather one op.
        safe_B_P = page_table_B_P.clamp(min=0)
        position_S = torch.arange(S, device=self.device)
        valid_B_S = position_S < lengths_B.to(self.device).unsqueeze(-1)
        valid_B_S &= (page_table_B_P >= 0).repeat_interleave(self.page_size, dim=1)
        valid_B_S_1_1 = valid_B_S[:, :, None, None]
        k_B_S_H_D = self.k[layer][safe_B_P].reshape(B, S, self.num_kv_heads, self.head_dim)
        v_B_S_H_D = self.v[layer][safe_B_P].reshape(B, S, self.num_kv_heads, self.v_head_dim)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(valid_B_S_1_1, k_B_S_H_D, zero), torch.where(
            valid_B_S_1_1, v_B_S_H_D, zero
        )

    def slots(self, pages: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages_N, offsets_N) on the pool's device for token positions [start, end) of a
        sequence stored in `pages`, ready for `write`."""
        if not 0 <= start <= end <= len(pages) * self.page_size:
            raise ValueError(
                f"positions [{start}, {end}) do not fit in {len(pages)} pages of "
                f"{self.page_size} tokens"
            )
        position_N = torch.arange(start, end, device=self.device)
        pages_P = torch.tensor(pages, dtype=torch.long, device=self.device)
        return pages_P[position_N // self.page_size], position_N % self.page_size
