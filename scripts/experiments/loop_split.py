"""Where the batched engine's steps spend their time in a closed loop: each method's loop of the same Spec-Bench
requests (N in flight), every ``Engine.step`` timed whole and split into planning and drafting, the target's forward,
and the rest (verification, commits, the draft's bookkeeping: also per sequence, by its drafted tokens), with the
tokens it emitted and the depths the plan chose. What the load-aware plan's cost model leaves out shows up as the
difference between the two loops' step times that the forward does not explain. A measurement, not the benchmark.

    python scripts/experiments/loop_split.py --concurrency 8 --temperature 0
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from verispec import load
from verispec.bench.concurrency import verispec_loop
from verispec.datasets import spec_bench_problems
from verispec.drafters import build_drafter
from verispec.engine import Engine
from verispec.methods import resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["ar", "default"])
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--limit", type=int, default=3, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype=args.dtype)
    drafter = build_drafter(args.draft, target, dtype=args.dtype)
    problems = spec_bench_problems(args.limit)
    ids = [target.encode_prompt(p.prompt, chat=p.chat) for p in problems]

    log: list[dict] = []
    everything: list[dict] = []  # every step, prompt chunks alone too
    inner, plan_inner, draft_inner, chunks_inner = Engine.step, Engine._plan, Engine._draft, Engine._chunks
    planning = [0.0]  # seconds of ``Engine._plan`` in the step being timed
    drafting = [0.0, 0.0, 0]  # seconds of ``Engine._draft`` in it, and what the plan's cost model says they cost
    shape: dict = {}  # the step's forward: rows, sequences, widest tree, mean and longest context
    chunked = [0]  # prompt rows in the step's forward
    advance_inner = Engine._advance
    after: dict = collections.defaultdict(list)  # drafted tokens -> seconds of one sequence's verification and commits

    def timed_advance(self, s, draft, *rest, **kw):
        t = time.perf_counter()
        out = advance_inner(self, s, draft, *rest, **kw)
        after[draft.num_drafted].append(time.perf_counter() - t)
        return out

    def timed_draft(self, seqs, planned):
        proposers = [s.drafter.proposer(s.context) for s in seqs]
        measured = self.book.drafting(proposers)
        counts: dict = {}
        drafting[2] = sum(p.catch_up(s.context) for p, s, tree in zip(proposers, seqs, planned)
                          if tree.max_depth and p.batch_key in measured)
        for p, tree in zip(proposers, planned):
            if p.batch_key in measured:
                c = counts.setdefault(p.batch_key, [0] * 16)
                for k in range(tree.max_depth):
                    c[k] += 1
        shape.update(rows=sum(t.size for t in planned), seqs=len(seqs),
                     widest=max((t.size for t in planned), default=0),
                     context=statistics.fmean([len(s.context) for s in seqs] or [0]),
                     span=max((len(s.context) for s in seqs), default=0))
        t = time.perf_counter()
        out = draft_inner(self, seqs, planned)
        drafting[0] = time.perf_counter() - t
        drafting[1] = sum(measured[key].seconds(c) for key, c in counts.items())
        return out

    def timed_plan(self, seqs, *rest):
        t = time.perf_counter()
        out = plan_inner(self, seqs, *rest)
        planning[0] += time.perf_counter() - t
        return out

    def timed_chunks(self, filling, rows):
        out = chunks_inner(self, filling, rows)
        chunked[0] = sum(len(c) for _, c in out)
        return out

    def timed(self):
        chunked[0] = 0
        planning[0] = 0.0
        drafting[:] = [0.0, 0.0, 0]
        shape.clear()
        t0 = time.perf_counter()
        seqs = inner(self)
        wall = time.perf_counter() - t0
        recs = [s.steps[-1] for s in seqs if s.steps]
        everything.append({"wall": wall, "batch": len(recs), "chunk": chunked[0],
                           "tokens": sum(len(r.emitted) for r in recs), "drafted": sum(r.drafted for r in recs)})
        if recs:  # a step of decoding sequences (not prefill chunks alone)
            log.append({"wall": wall, "batch": len(recs), "draft": recs[0].draft_s, "plan": planning[0], "proposing": drafting[0],
                        "modelled": drafting[1], "catch_up": drafting[2], "target": recs[0].target_s,
                        "verify": sum(r.verify_s for r in recs), "tokens": sum(len(r.emitted) for r in recs),
                        "drafted": sum(r.drafted for r in recs), "depths": tuple(sorted(r.draft_depth for r in recs)),
                        "forward_model": self.costs.seconds(shape["rows"] + chunked[0], shape["seqs"], shape["widest"],
                                                            shape["context"], shape["span"]) if shape else 0.0,
                        "span": shape.get("span", 0)})
        return seqs

    Engine.step, Engine._plan, Engine._draft, Engine._chunks = timed, timed_plan, timed_draft, timed_chunks
    Engine._advance = timed_advance
    for m in args.methods:
        plan = resolve(m, temperature=args.temperature)
        verispec_loop(target, plan, drafter, problems[:args.concurrency], ids[:args.concurrency], args.concurrency,
                      args.temperature, 0, 8)  # warm up (and the batch costs measured, once per machine)
        log.clear()
        everything.clear()
        after.clear()
        t0 = time.perf_counter()
        reqs = verispec_loop(target, plan, drafter, problems, ids, args.concurrency, args.temperature, 0,
                             args.max_new_tokens)
        wall = time.perf_counter() - t0
        full = [x for x in log if x["batch"] == args.concurrency]
        tokens = sum(len(r.token_ids) for r in reqs)
        print(f"{m}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tokens/s), {len(log)} steps; steps with "
              f"all {args.concurrency} in flight: {len(full)}")
        print("  after the forward, per sequence (verification, the commits, the draft's bookkeeping): "
              + ", ".join(f"{k} drafted: {1000 * statistics.median(ts):.2f} ms median, {1000 * statistics.fmean(ts):.2f} "
                          f"mean ({len(ts)})" for k, ts in sorted(after.items())))
        kinds = collections.defaultdict(list)
        for x in everything:
            kinds["with a prompt chunk" if x["chunk"] else "all in flight" if x["batch"] == args.concurrency
                  else "fewer in flight"].append(x)
        for kind, xs in kinds.items():
            secs = sum(x["wall"] for x in xs)
            print(f"  steps {kind}: {len(xs)}, {secs:.1f} s, {sum(x['tokens'] for x in xs)} tokens "
                  f"({sum(x['tokens'] for x in xs) / secs:.1f} tokens/s), {sum(x['drafted'] for x in xs)} drafted, "
                  f"{sum(x['chunk'] for x in xs)} prompt rows")
        if not full:
            continue
        med = {k: 1000 * statistics.median(x[k] for x in full) for k in ("wall", "draft", "plan", "target", "verify")}
        mean = {k: 1000 * statistics.fmean(x[k] for x in full) for k in ("wall", "draft", "plan", "target", "verify")}
        tok = statistics.fmean(x["tokens"] for x in full)
        print(f"  full steps: ms per step median / mean: wall {med['wall']:.1f} / {mean['wall']:.1f}, plan+draft "
              f"{med['draft']:.1f} / {mean['draft']:.1f} (of which planning {med['plan']:.1f} / {mean['plan']:.1f}), forward {med['target']:.1f} / {mean['target']:.1f}, "
              f"verify (all sequences) {med['verify']:.1f} / {mean['verify']:.1f}; tokens per step {tok:.2f}; "
              f"tokens per s of step {tok / (mean['wall'] / 1000):.1f}")
        hist = collections.Counter(x["drafted"] for x in full)
        print("  drafted tokens per step (all sequences): "
              + ", ".join(f"{k}: {v}" for k, v in sorted(hist.items())))
        by = collections.defaultdict(list)
        for x in full:
            by[x["drafted"]].append(x)
        for k, xs in sorted(by.items()):
            print(f"    drafted {k}: {len(xs)} steps, wall {1000 * statistics.fmean(x['wall'] for x in xs):.1f} ms, "
                  f"forward {1000 * statistics.fmean(x['target'] for x in xs):.1f} (the table "
                  f"{1000 * statistics.fmean(x['forward_model'] for x in xs):.1f}; longest context "
                  f"{statistics.fmean(x['span'] for x in xs):.0f}), plan+draft "
                  f"{1000 * statistics.fmean(x['draft'] for x in xs):.1f} (planning "
                  f"{1000 * statistics.fmean(x['plan'] for x in xs):.1f}; proposing "
                  f"{1000 * statistics.fmean(x['proposing'] for x in xs):.1f}, the model's draft costs "
                  f"{1000 * statistics.fmean(x['modelled'] for x in xs):.1f}; the first depth's rows "
                  f"{statistics.fmean(x['catch_up'] for x in xs):.1f}), tokens {statistics.fmean(x['tokens'] for x in xs):.2f}")


if __name__ == "__main__":
    main()
