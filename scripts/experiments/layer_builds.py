"""Two builds of the decoder layers' native call (``native.layer()``, layer.cpp) taking turns in one process on the
default model (float32): per batch shape, the median ms of the forwards of S sequences of R rows each after 400
entries of cache (``forward_turns.forwards_in_turns``), this checkout's build against an earlier one still in torch's
extension cache (its module name: ``native.layer_name()`` at that revision). Only the one call switches: whatever
else the forward runs is this checkout's, so the ratio is the call's. Logits differ where the two builds' arithmetic
does. A measurement, not the benchmark.

    python scripts/experiments/layer_builds.py --base verispec_layer512_946cce9d77af
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from forward_turns import forwards_in_turns  # scripts/experiments/forward_turns.py
from verispec.backends import load, native

SHAPES = ((1, 1), (1, 3), (2, 1), (4, 2), (8, 1), (8, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier build's module name")
    ap.add_argument("--turns", type=int, default=40)
    args = ap.parse_args()
    from torch.utils.cpp_extension import _get_build_directory  # noqa: PLC0415

    so = Path(_get_build_directory(args.base, False)) / f"{args.base}.so"
    if not so.is_file():
        raise SystemExit(f"{so} is not built: check the revision out and run its forward once to build it")
    spec = importlib.util.spec_from_file_location(args.base, so)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    new = native.layer()
    if new is None:
        raise SystemExit("the native decoder layer kernel cannot be built here")
    torch.set_num_threads(2)
    target = load("smollm2-135m", dtype="float32")
    lean = target._lean

    def use(kernel):
        return lambda: setattr(lean, "layers_kernel", kernel)

    for seqs, rows in SHAPES:
        ms, same = forwards_in_turns(target, {"base": use(base), "new": use(new)}, seqs, rows, turns=args.turns)
        print(f"{seqs}x{rows}: base {ms['base']:.2f} ms, new {ms['new']:.2f} ms, {ms['base'] / ms['new']:.3f}x, "
              f"logits equal: {same}", flush=True)


if __name__ == "__main__":
    main()
