"""What the server's answer cache (``verispec serve --answer-cache``) buys on repeated requests: the same server with
the cache and without it (``--answer-cache 0``), each started fresh on 127.0.0.1, one request at a time. Each round
sends every request once (the first pass: the cache holds nothing like it yet), then every request again (the
repeat pass, timed against the same pass of the other server). Rounds alternate which server goes first. A
measurement on a quiet machine, not the benchmark; the servers are stopped by their pid after each round.

    python scripts/experiments/answer_cache.py --rounds 3 --temperatures 0 0.6
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from verispec.bench.records import git_revision, machine
from verispec.bench.serving import chat_body, free_port, server_process, stream_chat
from verispec.datasets import load_prompts


def run_server(cache: int, problems, temperature: float, max_tokens: int, threads: int) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "verispec", "serve", "--port", str(port), "--max-batch", "1",
               "--threads", str(threads), "--dtype", "float32", "--answer-cache", str(cache)]
    out = {"first": [], "repeat": [], "tokens": []}
    with server_process(f"answer-cache-{cache}", command, port):
        stream_chat(port, chat_body("Hello.", "smollm2-135m", 4, temperature, 0))  # warm-up
        for name in ("first", "repeat"):
            for i, p in enumerate(problems):
                r = stream_chat(port, chat_body(p.prompt, "smollm2-135m", max_tokens, temperature, i, return_token_ids=True))
                if r.error:
                    raise SystemExit(f"request {p.id} failed: {r.error}")
                out[name].append((len(r.token_ids or []), r.end_s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    ap.add_argument("--datasets", default="spec-bench")
    ap.add_argument("--limit", type=int, default=1, help="requests per category")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=int, default=100_000, help="the cached server's --answer-cache")
    ap.add_argument("--json", default=None, help="write every measurement here")
    args = ap.parse_args()
    problems = load_prompts(args.datasets, args.limit)
    revision, started = git_revision(), time.strftime("%Y-%m-%d %H:%M")  # what ran: the tree as the run starts
    records = []
    for t in args.temperatures:
        logs = {"first": [], "repeat": []}
        for rnd in range(args.rounds):
            order = (args.cache, 0) if rnd % 2 == 0 else (0, args.cache)
            runs = {c: run_server(c, problems, t, args.max_tokens, args.threads) for c in order}
            for name in logs:
                for (n_on, s_on), (n_off, s_off) in zip(runs[args.cache][name], runs[0][name]):
                    # tokens/s with the cache over tokens/s without, per request
                    logs[name].append(math.log((n_on / s_on) / (n_off / s_off)))
            records.append({"temperature": t, "round": rnd, "order": list(order),
                            "runs": {str(c): r for c, r in runs.items()}})
            print(f"T = {t} round {rnd + 1}: repeat pass {sum(s for _, s in runs[args.cache]['repeat']):.1f} s "
                  f"with the cache, {sum(s for _, s in runs[0]['repeat']):.1f} s without", flush=True)
        for name, xs in logs.items():
            m = statistics.fmean(xs)
            half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
            print(f"T = {t}, {name} pass: with the cache {math.exp(m):.2f}x [{math.exp(m - half):.2f}, "
                  f"{math.exp(m + half):.2f}] the server without it (per-request tokens/s, {len(xs)} pairs over "
                  f"{args.rounds} rounds)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": ["python", *sys.argv], "git": revision, "machine": machine(),
                       "date": started, "cache": args.cache, "limit": args.limit,
                       "max_tokens": args.max_tokens, "records": records}, f)


if __name__ == "__main__":
    main()
