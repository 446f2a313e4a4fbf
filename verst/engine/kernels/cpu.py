"""The CPU engine's fused kernels (`csrc/cpu_kernels.c`), compiled at first use, called by ctypes.

On a 2-core CPU a small model's decode step is dominated by per-op overhead and by the paged
attention's gather: PyTorch runs RMSNorm as several ops, rotary as several more, and attention
over the paged pool as a copy of every row's pages followed by SDPA over the copy. These
kernels do each in one pass over the data: RMSNorm, the residual add with the norm after it,
per-head norm + rotary, and decode attention that reads K/V straight from the pages. They round
to the tensor dtype wherever HF's code does (float32 and bfloat16 are supported).

`load()` compiles the C source once per machine with the system C compiler (`cc`, or `$CC`)
into `~/.cache/verst/kernels/` (`$VERST_KERNEL_CACHE` overrides) and returns None, with one
logged warning saying why, when there is no compiler or the build fails: the engine then runs
PyTorch's ops, which compute the same. `VERST_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from verst.engine.kv_pool import attention_shape

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
DTYPES = (torch.float32, torch.bfloat16)
MAX_ROW, MAX_HEAD = 16384, 1024  # the C source's stack buffers

_p, _i64, _f, _int = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "rms_norm": [_p, _i64, _p, _p, _i64, _i64, _i64, _f, _int],
    "add_rms_norm": [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64, _f, _int],
    "norm_rope": [_p, _i64, _p, _f, _p, _p, _p, _i64, _i64, _i64, _int],
    "paged_decode": [_p, _p, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _f, _int],
}


class CpuKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        lib.set_threads.argtypes, lib.set_threads.restype = [_int], None
        self._threads = 0

    def _sync_threads(self) -> None:
        """Run parallel loops on PyTorch's intra-op thread count (it may change at run time)."""
        threads = torch.get_num_threads()
        if threads != self._threads:
            self.lib.set_threads(threads)
            self._threads = threads

    @staticmethod
    def fits(config, dtype: torch.dtype) -> bool:
        """Whether a model of this config and dtype is within the kernels' limits (one that is
        not runs PyTorch's ops)."""
        heads, kv_heads, head_dim = attention_shape(config)
        return (
            dtype in DTYPES
            and config.hidden_size <= MAX_ROW
            and head_dim <= MAX_HEAD
            and head_dim % 8 == 0
            and heads // kv_heads * head_dim <= MAX_ROW
        )

    # The wrappers run once per layer and op: on a 2-core CPU the Python around a call costs
    # more than the call (2-3 µs), so they check cheaply and allocate outputs in their final shape.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's RMSNorm over the last dim of x [..., n] (rows may be strided, each row dense)."""
        n = x.shape[-1]
        _check_pair(x, weight, n)
        x_N_X, stride = _rows_and_stride(x, n)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._sync_threads()
        self.lib.rms_norm(
            x_N_X.data_ptr(), stride, weight.data_ptr(), out.data_ptr(), n, out.numel() // n, n,
            eps, x.dtype is torch.bfloat16,
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's residual add then RMSNorm over [..., n]: (x + residual, its norm), one pass."""
        n = x.shape[-1]
        _check_pair(x, weight, n)
        _check_pair(residual, weight, n)
        x_N_E, x_stride = _rows_and_stride(x, n)
        residual_N_E, residual_stride = _rows_and_stride(residual, n)
        total, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
        self._sync_threads()
        self.lib.add_rms_norm(
            x_N_E.data_ptr(), x_stride, residual_N_E.data_ptr(), residual_stride,
            weight.data_ptr(), total.data_ptr(), out.data_ptr(), out.numel() // n, n, eps,
            x.dtype is torch.bfloat16,
        )  # fmt: skip
        return total, out

    def norm_rope(
        self,
        x_N_H_D: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        cos_N_D: torch.Tensor,
        sin_N_D: torch.Tensor,
    ) -> torch.Tensor:
        """Per-head RMSNorm (when `weight` is given), then HF's rotary: [N, H, D] contiguous.
        x's heads must be dense within a row; rows may be strided."""
        N, H, D = x_N_H_D.shape
        if x_N_H_D.stride(2) != 1 or x_N_H_D.stride(1) != D:
            raise ValueError("norm_rope needs each row's heads dense")
        _check_pair(x_N_H_D, cos_N_D, D)
        if weight is not None:
            _check_pair(x_N_H_D, weight, D)
        if (
            not (cos_N_D.is_contiguous() and sin_N_D.is_contiguous())
            or sin_N_D.dtype != cos_N_D.dtype
        ):
            raise ValueError("norm_rope needs contiguous cos / sin of the input's dtype")
        _limit(D, MAX_HEAD)
        out = torch.empty((N, H, D), dtype=x_N_H_D.dtype)
        self._sync_threads()
        self.lib.norm_rope(
            x_N_H_D.data_ptr(), x_N_H_D.stride(0), None if weight is None else weight.data_ptr(),
            eps, cos_N_D.data_ptr(), sin_N_D.data_ptr(), out.data_ptr(), N, H, D,
            x_N_H_D.dtype is torch.bfloat16,
        )  # fmt: skip
        return out

    def paged_decode(
        self,
        q_B_H_D: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        table_B_P: torch.Tensor,
        seq_lens_B: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query token a row over its pages: [B, Hq, D]. k/v_pages [pages, page, Hkv, D]."""
        B, Hq, D = q_B_H_D.shape
        _, page, Hkv, _ = k_pages.shape
        q_B_H_D = q_B_H_D.to(k_pages.dtype).contiguous()
        _check(q_B_H_D, k_pages, v_pages)
        if table_B_P.dtype != torch.long or seq_lens_B.dtype != torch.long:
            raise ValueError("page table and sequence lengths must be int64")
        if table_B_P.stride(1) != 1 or not seq_lens_B.is_contiguous():
            raise ValueError("page table rows and sequence lengths must be dense")
        if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
            raise ValueError("the KV pages must be contiguous")
        _limit(D, MAX_HEAD)
        _limit(Hq // Hkv * D, MAX_ROW)
        out = torch.empty((B, Hq, D), dtype=k_pages.dtype)
        self._sync_threads()
        self.lib.paged_decode(
            q_B_H_D.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), table_B_P.data_ptr(),
            table_B_P.stride(0), seq_lens_B.data_ptr(), out.data_ptr(), B, Hq, Hkv, D, page,
            scale, k_pages.dtype is torch.bfloat16,
        )  # fmt: skip
        return out


def _check_pair(x: torch.Tensor, weight: torch.Tensor, n: int) -> None:
    """The cheap form of `_check` for a tensor and its weight, and the row limit."""
    if not (x.is_cpu and x.dtype is weight.dtype and x.dtype in DTYPES and weight.is_cpu):
        _check(x, weight)  # raises, naming what is wrong
    if n > MAX_ROW or weight.shape[-1] != n:
        raise ValueError(
            f"rows of {n} values with a weight of {weight.shape[-1]} (at most {MAX_ROW})"
        )


def _rows_and_stride(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """x as rows of n dense values: (a tensor holding them, the row stride in elements)."""
    if x.is_contiguous():
        return x, n
    rows = dense_rows(x, n)
    return rows, rows.stride(0)


def dense_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as [N, n] with dense rows, a view where possible."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, n)
    except RuntimeError:
        return x.reshape(-1, n)


def _limit(n: int, most: int) -> None:
    if n > most:
        raise ValueError(f"the CPU kernels buffer rows of at most {most} values; got {n}")


def _check(*tensors: torch.Tensor) -> None:
    dtype = tensors[0].dtype
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or dtype not in DTYPES:
            raise ValueError(
                f"CPU kernels take float32 or bfloat16 CPU tensors of one dtype; got "
                f"{[(t.dtype, t.device.type) for t in tensors]}"
            )


@functools.cache
def load() -> CpuKernels | None:
    """The compiled kernels, or None (with one warning) when they cannot be built here."""
    if os.environ.get("VERST_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: the CPU engine runs PyTorch ops instead of its kernels")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("the CPU engine's kernels did not build (%s); it runs PyTorch ops", error)
        return None


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source)
    for part in (compiler, " ".join(FLAGS), platform.machine(), _cpu_flags()):
        key.update(part.encode())
    root = os.environ.get("VERST_KERNEL_CACHE") or Path.home() / ".cache" / "verst" / "kernels"
    target = Path(root) / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip()[-2000:])
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    return target


def _cpu_flags() -> str:
    """The CPU's feature flags (`-march=native` builds for them), where the OS says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
