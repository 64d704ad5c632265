"""The committed audit of the engines' speculative sampling (docs/results.md, "Engines' speculative sampling against
the target's law"): ``verispec audit-engine`` on every engine it ships and the negative controls, then on a
``verispec serve`` started here on 127.0.0.1 (stopped by its pid at the end), then with top-k and top-p filtering,
then llama-cpp-python's prompt lookup (the llama extra: ``bash scripts/install_llama.sh``) on both of
``audit-engine``'s default prompts and a plain text that repeats (through the chat template it rarely drafts), then
verispec at one request on both chat prompts (``prompts``: the committed rows at ``--samples 5000``), then llama.cpp's
``llama-server`` with a draft model on both chat prompts (``llama-server``: it needs ``scripts/llama_build.py
server``), then Hugging Face assisted generation with the int8 assistant on both chat prompts (``hf-prompts``: the
committed rows at ``--samples 5000``). Rows go to results/audit_engines/*.jsonl.gz (written as .jsonl, then gzipped).
About an hour on 2 cores, and some 40 minutes for each part at 5,000 samples.

    python scripts/audit_engines.py [--samples 3000]
        [--only engines filtered serve llama prompts llama-server hf-prompts]
        [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import gzip
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Name an animal."
REPEATS = "Continue the pattern: red, blue, red, blue, red,"
TEXT = "red, blue, green, red, blue, green, red, blue, green, red,"  # plain text, no chat template: lookup drafts here
PARTS = ("engines", "filtered", "serve", "llama", "prompts", "llama-server", "hf-prompts")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "verispec", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    ap.add_argument("--dtype", default="float32", help="the served target's dtype (the law is computed in the same)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the prompts part")
    args = ap.parse_args()
    (ROOT / "results" / "audit_engines").mkdir(parents=True, exist_ok=True)
    n = str(args.samples)
    common = ["--samples", n, "--prompt", PROMPT, "--threads", "2"]
    if "engines" in args.only:
        subprocess.run(cli("audit-engine", "verispec", "verispec-int8", "verispec-batch", "hf-assisted", "hf-lookup",
                           "--controls", *common, "--out", "results/audit_engines/engines.jsonl"), cwd=ROOT, check=False)
    if "filtered" in args.only:
        subprocess.run(cli("audit-engine", "verispec", "hf-assisted", "--temperatures", "1", "--top-k", "20", "--top-p",
                           "0.9", *common, "--out", "results/audit_engines/filtered.jsonl"), cwd=ROOT, check=False)
    if "llama" in args.only:
        subprocess.run(cli("audit-engine", "llama-cpp-lookup", "--samples", n, "--prompt", PROMPT, "--prompt", REPEATS,
                           "--text", TEXT, "--threads", "2", "--out", "results/audit_engines/llama.jsonl"), cwd=ROOT,
                       check=False)
    if "serve" in args.only:
        serve(n, args.dtype)
    if "prompts" in args.only:  # verispec at one request on both chat prompts, at the N asked (5,000 in the table)
        subprocess.run(cli("audit-engine", "verispec", "--samples", n, "--prompt", PROMPT, "--prompt", REPEATS,
                           "--threads", str(args.threads), "--out", "results/audit_engines/prompts.jsonl"), cwd=ROOT,
                       check=False)
    if "hf-prompts" in args.only:  # Hugging Face assisted generation (the int8 assistant) on both chat prompts
        subprocess.run(cli("audit-engine", "hf-assisted", "--samples", n, "--prompt", PROMPT, "--prompt", REPEATS,
                           "--threads", str(args.threads), "--out", "results/audit_engines/hf_prompts.jsonl"), cwd=ROOT,
                       check=False)
    if "llama-server" in args.only:  # llama.cpp's own server drafting with -md, started and stopped by the audit
        subprocess.run(cli("audit-engine", "llama-server-draft", "--samples", n, "--prompt", PROMPT, "--prompt",
                           REPEATS, "--threads", str(args.threads), "--out",
                           "results/audit_engines/llama_server.jsonl"), cwd=ROOT, check=False)


def serve(n: str, dtype: str) -> None:
    """The server's rows: a ``verispec serve`` started here, audited over HTTP, stopped by its pid."""
    port = free_port()
    # a fixed chain of 3: at 8 requests at once the load-aware plan drafts almost nothing (0.04-0.05 tokens a sample
    # measured), and a server that does not speculate tests nothing of its speculative sampling
    server = subprocess.Popen(cli("serve", "--host", "127.0.0.1", "--port", str(port), "--threads", "2", "--dtype",
                                  dtype, "--policy", "fixed", "--tree", "chain:3"), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {server.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:  # refused, or 503 while it warms up
                pass
            time.sleep(2)
        else:
            raise SystemExit("the server was not ready in 10 minutes")
        subprocess.run(cli("audit-engine", "verispec-serve", "--url", f"http://127.0.0.1:{port}", "--samples", n,
                           "--prompt", PROMPT, "--threads", "1", "--dtype", dtype,
                           "--out", "results/audit_engines/serve.jsonl"), cwd=ROOT, check=False)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)
            try:
                server.wait(90)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)


def pack() -> None:
    """Each results/audit_engines/*.jsonl gzipped beside itself (records are kept gzipped)."""
    for p in (ROOT / "results" / "audit_engines").glob("*.jsonl"):
        with open(p, "rb") as src, gzip.GzipFile(p.with_suffix(".jsonl.gz"), "wb", mtime=0) as dst:
            dst.write(src.read())


if __name__ == "__main__":
    try:
        main()
    finally:
        pack()
