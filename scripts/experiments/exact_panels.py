"""The default model's linear layers from their GGUF blocks (``kernels._pack_exact``) against float32 panels
(``VERISPEC_FLOAT_PANELS=1``): each setting in its own process, alternated ``--pairs`` times; per setting the median
time of a plain decoding step of B sequences at ``--context`` entries of context (B = 1, 2, 4, 8) and of a prompt's
prefill, and whether every logit of the prefill and of the steps is equal bit for bit between the two settings. A
measurement only (run it on a quiet machine).

    python scripts/experiments/exact_panels.py --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def measure(context: int, out: str) -> None:
    from verispec.backends import load

    torch.set_num_threads(2)
    target = load("smollm2-135m", dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (context,), generator=g).tolist()
    logits, times = {}, {}
    for batch in (1, 2, 4, 8):
        pool = target.state_pool(batch, context + 64) if batch > 1 else None
        states = [pool.acquire() for _ in range(batch)] if pool else [target.new_state()]
        for s in states:
            target.prefill(s, prompt)
        one = torch.ones(1, 1, dtype=torch.bool)
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            res = target.forward_batch(states, [torch.tensor([7])] * batch, [torch.tensor([s.committed]) for s in states],
                                       [one] * batch)
            ts.append(time.perf_counter() - t)
            for s in states:
                target.commit(s, [])
        times[f"step {batch}"] = statistics.median(ts[3:]) * 1e3
        logits[f"step {batch}"] = torch.cat([r.logits for r in res])
    ts = []
    for _ in range(3):
        s = target.new_state()
        t = time.perf_counter()
        logits["prefill"] = target.prefill_output(s, prompt).logits
        ts.append(time.perf_counter() - t)
    times["prefill"] = min(ts) * 1e3
    torch.save({"times": times, "logits": logits}, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        measure(args.context, args.child)
        return
    runs: dict[str, list[dict]] = {"blocks": [], "float32": []}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            got = {}
            for name in ("float32", "blocks") if pair % 2 == 0 else ("blocks", "float32"):
                env = dict(os.environ, VERISPEC_FLOAT_PANELS="1" if name == "float32" else "0")
                path = os.path.join(tmp, f"{name}{pair}.pt")
                subprocess.run([sys.executable, __file__, "--context", str(args.context), "--child", path], env=env,
                               check=True, stderr=subprocess.DEVNULL)
                got[name] = torch.load(path)
                runs[name].append(got[name]["times"])
            same &= all(torch.equal(got["blocks"]["logits"][k], got["float32"]["logits"][k])
                        for k in got["blocks"]["logits"])
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratio = {k: summary["float32"][k] / summary["blocks"][k] for k in summary["blocks"]}
    print(json.dumps({"ms": summary, "float32 / blocks": ratio, "logits bit for bit equal": same}, indent=1))


if __name__ == "__main__":
    main()
