"""Decode attention on CUDA, one program per row and KV head vs split sequences (flash
decoding), in one process: µs per call, timed as the engine runs it, inside a CUDA graph.

For each batch and sequence length, each variant's call is captured 50 times into a CUDA graph,
the graphs are replayed alternately (`--rounds`), and the best round's time per call is kept.
Shapes are the H200 preset's model (Qwen2-0.5B: 14 query heads, 2 KV heads of 64), pages of 16.

    python bench/paged_decode_ab.py --out bench/results/paged_decode_ab_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from verst.engine.kernels.paged_decode import decode_splits, paged_decode_triton

HQ, HKV, D, PAGE = 14, 2, 64, 16
CALLS = 50


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return graph


def microseconds(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS


def case(batch: int, seq: int, table_pages: int, rounds: int) -> dict:
    """Both variants at one shape; the page table is as wide as a decode graph's."""
    pages = batch * -(-seq // PAGE) + 1
    k = torch.randn(pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.zeros(batch, table_pages, dtype=torch.long, device="cuda")
    used = torch.randperm(pages - 1, device="cuda")[: batch * -(-seq // PAGE)] + 1
    table[:, : -(-seq // PAGE)] = used.view(batch, -1)
    seq_lens = torch.full((batch,), seq, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    splits = decode_splits(batch, HKV, table_pages, PAGE)
    variants = {"one_program": 1, "split": splits}
    graphs = {
        name: graph_of(lambda s=s: paged_decode_triton(q, k, v, table, seq_lens, D**-0.5, s))
        for name, s in variants.items()
    }
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(microseconds(graph))
    best = {name: min(t) for name, t in times.items()}
    return {
        "batch": batch,
        "seq": seq,
        "splits": splits,
        "us_per_call": best,
        "speedup": best["one_program"] / best["split"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--seqs", type=int, nargs="+", default=[384, 4096])
    parser.add_argument("--table-pages", type=int, default=256, help="graph width (4,096 tokens)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    rows = []
    for seq in args.seqs:
        for batch in args.batches:
            row = case(batch, seq, max(args.table_pages, -(-seq // PAGE)), args.rounds)
            rows.append(row)
            t = row["us_per_call"]
            print(
                f"batch {batch:4d} seq {seq:5d}: one program {t['one_program']:7.2f} µs, "
                f"{row['splits']:2d} splits {t['split']:7.2f} µs, {row['speedup']:.2f}x"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"benchmark": "paged_decode_ab", "gpu": torch.cuda.get_device_name()}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
