"""The default model's linear layers with each float32 kernel (``verispec.backends.kernels``): the stock
``F.linear`` (MKL), the plan's ``W @ x^T`` (``DEFAULT_PLAN``'s width for the row count) and verispec's native kernel
(``native.linear``), over the 210 decoder matrices of SmolLM2-135M streamed from memory one after another as in a
forward, and over the output layer; then whole plain steps of B sequences (one row each, 400 entries of context)
under the stock-free ``DEFAULT_PLAN`` and under ``default_plan()``. A measurement, not the benchmark (design.md).

    python scripts/experiments/native_linear.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import load
from verispec.backends import kernels, native
from verispec.tree import Tree


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 32, 136])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native.linear() is None:
        raise SystemExit("the native linear kernel does not build here (a C++ compiler, ninja, AVX2 and FMA)")
    target = load("smollm2-135m", dtype="float32")
    layers = [m for block in target.hf.model.layers for m in block.modules() if type(m) is torch.nn.Linear]
    head = target.hf.get_output_embeddings()
    print(f"{len(layers)} decoder matrices, ms (best of {args.repeats}); output layer {tuple(head.weight.shape)}")
    print("rows | stock | W @ x^T (width) | native | output layer: stock | native")
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k) for k in {m.weight.shape[1] for m in layers}}
            width = kernels.DEFAULT_PLAN[rows] if rows <= kernels.MAX_ROWS else 0
            stock = _best(lambda: [torch.nn.functional.linear(xs[m.weight.shape[1]], m.weight) for m in layers],
                          args.repeats)
            planned = _best(lambda: [kernels.planned_rows(xs[m.weight.shape[1]], m.weight, None, width)
                                     for m in layers], args.repeats) if width else float("nan")
            mine = _best(lambda: [kernels.native_rows(xs[m.weight.shape[1]], m) for m in layers], args.repeats)
            x = torch.randn(rows, head.weight.shape[1])
            print(f"{rows} | {stock:.1f} | {planned:.1f} ({width}) | {mine:.1f} | "
                  f"{_best(lambda: torch.nn.functional.linear(x, head.weight), args.repeats):.2f} | "
                  f"{_best(lambda: kernels.native_rows(x, head), args.repeats):.2f}")
        print("plain step of B sequences at 400 entries, ms (median of 15): B | DEFAULT_PLAN | default_plan()")
        root = Tree.root_only()
        for b in args.batches:
            pool = target.state_pool(b, 410)
            states = [pool.acquire() if pool is not None else target.new_state() for _ in range(b)]
            for s in states:
                target.prefill(s, [5] * 399)

            def step() -> float:
                t = time.perf_counter()
                target.forward_batch(states, [torch.full((1,), 7)] * b, [s.committed + torch.tensor(root.depths)
                                                                         for s in states],
                                     [root.ancestors_mask()] * b, features=(3, 15, 27))
                for s in states:
                    target.commit(s, [])
                return time.perf_counter() - t

            out = []
            for plan in (kernels.DEFAULT_PLAN, kernels.default_plan()):
                undo = kernels.use_fast_linear(target.hf, plan)
                step()
                out.append(1000 * statistics.median(step() for _ in range(15)))
                undo()
            kernels.use_fast_linear(target.hf, kernels.default_plan())
            print(f"{b} | {out[0]:.1f} | {out[1]:.1f}")
            for s in states:
                pool.release(s) if pool is not None else None


if __name__ == "__main__":
    main()
