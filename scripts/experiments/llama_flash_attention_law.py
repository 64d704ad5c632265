"""The next-token law of the default model's GGUF file under llama.cpp with flash attention on and off: the minimal
reproduction of why ``llama-server-draft`` first differed from "the target's law" in ``verispec audit-engine``
(issue 69). The audit's law came from llama-cpp-python with flash attention off while the server ran with it on; the
server without any draft model differed the same way.

    python scripts/experiments/llama_flash_attention_law.py [--out results/llama_flash_attention_law.json]

For each of ``audit-engine``'s two default prompts (through the chat template): the next-token law at T = 1 and 0.6
from llama-cpp-python with ``flash_attn`` on and off, their total variation, the top tokens; and the top-5
probabilities ``llama-server`` itself reports (``n_probs``) with ``-fa on`` and ``-fa off``, started on 127.0.0.1 and
stopped here. Needs the llama extra and its server (``bash scripts/install_llama.sh``; ``scripts/llama_build.py
server``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from verispec import load  # noqa: E402
from verispec.bench.peers import gguf_path, llama_model, llama_server_binary, lookup_draft  # noqa: E402
from verispec.bench.records import git_revision, machine  # noqa: E402
from verispec.bench.serving import free_port, server_process  # noqa: E402


PROMPTS = ("Name an animal.", "Continue the pattern: red, blue, red, blue, red,")  # ``audit-engine``'s defaults


def logits(path: str, prompt: list[int], flash: bool) -> torch.Tensor:
    # as the audit's law is read (``LlamaCppAdapter``): with a draft, so that every position's logits are kept
    llm = llama_model(path, 1024, torch.get_num_threads(), lookup_draft(10), flash_attn=flash)
    llm.eval(list(prompt))
    return torch.tensor(llm.scores[llm.n_tokens - 1], dtype=torch.float64)


def server_top(binary: str, path: str, prompt: list[int], flash: bool) -> list[tuple[int, float]]:
    port = free_port()
    command = [binary, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "1024", "-t",
               str(torch.get_num_threads()), "-fa", "on" if flash else "off", "--no-webui"]
    with server_process("llama-server-fa", command, port):
        body = {"prompt": list(prompt), "n_predict": 1, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "n_probs": 5, "seed": 0, "return_tokens": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got = json.loads(r.read())
    top = got["completion_probabilities"][0]["top_logprobs"]
    return [(int(t["id"]), math.exp(t["logprob"])) for t in top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "llama_flash_attention_law.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load("smollm2-135m", dtype="float32")
    path, binary = gguf_path(target.name), llama_server_binary()
    rows = []
    for i, text in enumerate(PROMPTS):
        prompt = target.encode_prompt(text)
        x = {flash: logits(path, prompt, flash) for flash in (True, False)}
        row = {"prompt": i, "text": text}
        for t in (1.0, 0.6):
            p = {flash: torch.softmax(x[flash] / t, -1) for flash in x}
            row[f"tv_T{t:g}"] = 0.5 * float((p[True] - p[False]).abs().sum())
            top = torch.topk(p[False], 5).indices.tolist()
            row[f"top_T{t:g}"] = [[tok, float(p[False][tok]), float(p[True][tok])] for tok in top]
        if binary:
            row["server_top_T1"] = {"fa on": server_top(binary, path, prompt, True),
                                    "fa off": server_top(binary, path, prompt, False)}
        rows.append(row)
        print(json.dumps(row))
    Path(args.out).write_text(json.dumps({
        "command": "python scripts/experiments/llama_flash_attention_law.py", "git": git_revision(),
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "gguf": Path(path).name,
        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
