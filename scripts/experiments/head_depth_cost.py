"""What a depth of the shipped draft head costs, part by part, with its weights in the CPU's caches and as the
decoding loop meets them: right after a target forward, which has streamed the target's weights through the caches
(issue 66: "a head depth costs at most 0.6 ms"); the head's own layers read from float16 panels (as loaded) and from
Q8_0 blocks (as ``build_drafter`` drafts with it, ``EagleHead.draft_from_blocks``), taking turns.

    python scripts/experiments/head_depth_cost.py [--repeats 40] [--out results/head_depth_cost.json]

Parts, each timed alone at one sequence (the median of ``--repeats``): the head's input (``fuse`` of the target's
three feature layers and ``fc`` with the token's embedding), its output layer (16,384 rows), the head's model forward
over one pair (its decoder layer, final norm and output layer, as separate calls), all of those in one native call
(``EagleHead.depth``, what the drafter runs), and a whole first depth as the loop asks for it
(``propose_batch`` of a chain of 1: the input, the forward, the draft's law and draw). Each part runs ``warm`` (the
same call just before, so its weights are cached) and ``after a target forward`` (one untimed decoding row of the
target on a 256-token context just before each timed call, as in a decoding step). The bytes are those of the
packed weights each part reads. Run on a quiet machine; the JSON keeps the command, revision, CPU and date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from verispec import load  # noqa: E402
from verispec.bench.records import git_revision, machine  # noqa: E402
from verispec.drafters.costs import _forks, _timed  # noqa: E402
from verispec.drafters.eagle import EagleDrafter  # noqa: E402
from verispec.eagle import EagleHead  # noqa: E402
from verispec.eagle.head import shipped_head  # noqa: E402

CONTEXT = 256


def packed_bytes(modules) -> int:
    """Bytes of the packed weights (``kernels._prepacked``) the modules read, after they ran once."""
    return sum(m.__dict__["_verispec_packed"].numel() * m.__dict__["_verispec_packed"].element_size()
               for m in modules if "_verispec_packed" in m.__dict__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "head_depth_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load()
    heads = {"float16 panels": EagleHead.load(shipped_head(target.name), target),
             "Q8_0 blocks": EagleHead.load(shipped_head(target.name), target)}
    if not heads["Q8_0 blocks"].draft_from_blocks():
        raise SystemExit("the native linear kernel does not build here: no Q8_0 blocks to compare")
    context = [(17 * i + 5) % 20000 + 100 for i in range(CONTEXT)]
    state = target.new_state()
    features = heads["float16 panels"].feature_layers
    pre = target.prefill_output(state, context[:-1], features=features)
    row = torch.tensor([context[-1]])

    def target_row() -> None:  # one decoding row of the target, kept out of its cache
        target.forward(state, row, torch.tensor([CONTEXT - 1]), torch.ones(1, 1, dtype=torch.bool))
        target.commit(state, [])

    feats, token = pre.hidden[-1:], torch.tensor([context[-1]])
    x = torch.randn(1, heads["float16 panels"].hidden)
    parts: dict[tuple[str, str], object] = {}
    forks = {}
    for kind, head in heads.items():
        fork = _forks(EagleDrafter(head), context, pre.hidden, 1)
        _timed(fork, context, 1, 2)  # the head's cache takes in the context once
        forks[kind] = fork
        out_layer = head.lm.hf.get_output_embeddings()
        parts[kind, "input (fuse and fc)"] = lambda h=head: h.target_inputs(feats, token)
        parts[kind, "output layer"] = lambda o=out_layer: o(x)
        embeds = head.target_inputs(feats, token)

        def forward(d=fork[0], e=embeds):  # the forward on the head's input, as separate calls
            tokens, _ = d._root_input(context)
            return d.lm.prefill_output(d.state, tokens, e)

        parts[kind, "model forward (layer, norm, output layer)"] = forward
        parts[kind, "the depth in one native call (input, layer, norm, output layer)"] = \
            lambda f=fork: f[0]._root_logits(context)
        parts[kind, "first depth, whole (propose_batch)"] = lambda f=fork: _timed(f, context, 1, 1)
    times = {key: {"warm": [], "after a target forward": []} for key in parts}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for (kind, name), fn in parts.items():
                fn()
                t = time.perf_counter()
                fn()
                times[kind, name]["warm"].append(time.perf_counter() - t)
                target_row()
                t = time.perf_counter()
                fn()
                times[kind, name]["after a target forward"].append(time.perf_counter() - t)
                if name.startswith(("model forward", "the depth")):
                    forks[kind][0].commit(None, [])
        target_ms = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            target_row()
            target_ms.append(time.perf_counter() - t)
    rows = []
    for kind, head in heads.items():
        out_layer = head.lm.hf.get_output_embeddings()
        inputs = [m for m in (head.fuse, head.fc) if m is not None]
        bytes_of = {"input (fuse and fc)": packed_bytes(inputs), "output layer": packed_bytes([out_layer])}
        lean = head.lm._lean  # the decoder layer's stacked panels (``LeanLlama._layer_args``), run in one call
        if lean is not None and lean._layer_args is not None:
            layer_bytes = sum(t.numel() * t.element_size() for t in lean._layer_args[0])
        else:
            layer_bytes = packed_bytes([m for m in head.body.modules() if isinstance(m, torch.nn.Linear)])
        bytes_of["model forward (layer, norm, output layer)"] = layer_bytes + bytes_of["output layer"]
        bytes_of["the depth in one native call (input, layer, norm, output layer)"] = \
            layer_bytes + bytes_of["output layer"] + bytes_of["input (fuse and fc)"]
        bytes_of["first depth, whole (propose_batch)"] = layer_bytes + bytes_of["output layer"] + \
            bytes_of["input (fuse and fc)"]
        rows += [{"weights": kind, "part": name, "bytes": bytes_of[name],
                  **{cond: 1000 * statistics.median(ts) for cond, ts in times[kind, name].items()}}
                 for (k, name) in parts if k == kind]
    report = {"command": "python scripts/experiments/head_depth_cost.py " + " ".join(sys.argv[1:]),
              "git": git_revision(), "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "threads": args.threads, "repeats": args.repeats, "context": CONTEXT,
              "target_row_ms": 1000 * statistics.median(target_ms), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        print(f"{r['weights']:15s} {r['part']:45s} {r['bytes'] / 1e6:6.1f} MB  warm {r['warm']:.3f} ms  "
              f"after a target forward {r['after a target forward']:.3f} ms")
    print(f"target row: {report['target_row_ms']:.2f} ms")


if __name__ == "__main__":
    main()
