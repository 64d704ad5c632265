"""Are llama.cpp's features usable by the EAGLE head? Teacher-forced agreement of the shipped head with llama.cpp's
greedy next tokens (SmolLM2 Q4_1), fed llama.cpp's own final hidden states (embeddings, no pooling) against the
float32 Hugging Face model's, on the llama.cpp greedy Spec-Bench answers recorded in results/llama_smollm2.jsonl.gz.

    python scripts/experiments/llama_head_features.py      # needs llama-cpp-python (bash scripts/install_llama.sh); about a minute
"""

import llama_cpp
import numpy as np
import torch

from verispec.backends import load
from verispec.bench.peers import gguf_path
from verispec.bench.records import read_records
from verispec.datasets import load_prompts
from verispec.eagle import EagleHead, shipped_head
from verispec.eagle.corpus import Record, features
from verispec.eagle.train import head_loss, new_counts, summarize_counts

torch.set_num_threads(2)
hf = load("smollm2-135m")
head = EagleHead.load(shipped_head("smollm2-135m"), hf)
llm = llama_cpp.Llama(model_path=gguf_path("smollm2-135m"), embedding=True,
                      pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE, n_ctx=4096, n_batch=4096, n_ubatch=4096,
                      verbose=False, n_threads=2)


def rows(get, n: int, width: int) -> torch.Tensor:
    """Rows 0..n-1 of a llama.cpp per-token output (embeddings or logits)."""
    return torch.tensor(np.stack([np.ctypeslib.as_array(get(llm.ctx, i), shape=(width,)).copy() for i in range(n)]))


probs = {p.id: p for p in load_prompts("spec-bench", 3)}
recs = []
for r in read_records("results/llama_smollm2.jsonl.gz"):
    if r.get("type") == "prompt" and r["cell"]["method"] == "llama-cpp" and r["cell"]["T"] == 0.0:
        p = probs[r["cell"]["prompt"]]
        ids = hf.encode_prompt(p.prompt, chat=p.chat)
        recs.append(Record(ids + r["token_ids"], [[len(ids), len(ids) + len(r["token_ids"])]], p.group, -1))
counts = {"hf": new_counts(3), "llama": new_counts(3)}
with torch.no_grad():
    for rec in recs:
        llm.reset()
        llm.eval(rec.tokens)
        n = len(rec.tokens)
        E = rows(llama_cpp.llama_get_embeddings_ith, n, llm.n_embd())
        L = rows(llama_cpp.llama_get_logits_ith, n, llm.n_vocab())
        p, i = torch.softmax(L.float(), -1).topk(1, dim=-1)
        d = features(hf, rec, 1, head.feature_layers)
        d["p"], d["i"] = p.half(), i.int()  # labels: llama.cpp's own greedy next tokens, for both feature sources
        head_loss(head, d, 3, counts=counts["hf"])
        d = dict(d, feat=E.half())
        head_loss(head, d, 3, counts=counts["llama"])
for k, c in counts.items():
    print("features from", k, {a: [round(x, 3) for x in b] for a, b in summarize_counts(c).items()})
print(len(recs), "answers")
