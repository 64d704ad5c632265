"""Write data/repetitive/requests.jsonl: the repetitive workload, requests whose answers repeat earlier text.

Speculation is deployed for exactly these, and Spec-Bench (first turns, fresh questions) underweights them. Three
categories of 6 requests each, every request a conversation (``messages``):

* ``second_turn``: MT-bench's second turns (Spec-Bench's questions 81-86, writing: "Rewrite your previous
  response ...", "rephrase it ..."), after the first turn and the default model's own greedy answer to it (192
  tokens at most, decoded here with ``ar`` at T = 0, so the conversation is the model's own);
* ``edit_text``: "correct the spelling and return the full text" of a passage with a typo in every seventh long
  word, the passages being the default model's own greedy answers to MT-bench questions 91-96 (first turns);
* ``edit_code``: "rename the function and return the complete code" of HumanEval problems 0-5 (prompt and
  canonical solution).

Deterministic: run again, it writes the same file (on the same kernels: the answers are the model's greedy text).

    python scripts/make_repetitive.py
"""

from __future__ import annotations

import gzip
import json

import verispec
from verispec.datasets import DATA_DIR, spec_bench

OUT = DATA_DIR / "repetitive" / "requests.jsonl"
FIRST_ANSWER_TOKENS = 192


def typos(text: str, every: int = 7) -> str:
    """Swap two middle letters of every ``every``-th word of at least 5 letters."""
    words, n = text.split(" "), 0
    for i, w in enumerate(words):
        if len(w) >= 5 and w.isalpha():
            n += 1
            if n % every == 0:
                m = len(w) // 2
                words[i] = w[:m - 1] + w[m] + w[m - 1] + w[m + 1:]
    return " ".join(words)


def main() -> None:
    target = verispec.load()
    none = verispec.build_drafter("none", target)

    def answer(messages):
        ids = target.encode_prompt(messages)
        return verispec.generate(target, none, "chain", ids, tree="none", temperature=0.0,
                                 max_new_tokens=FIRST_ANSWER_TOKENS).text.strip()

    rows = {r["question_id"]: r for r in spec_bench()}
    out = []
    for qid in range(81, 87):
        first = [{"role": "user", "content": rows[qid]["turns"][0]}]
        messages = first + [{"role": "assistant", "content": answer(first)},
                            {"role": "user", "content": rows[qid]["turns"][1]}]
        out.append({"id": f"second_turn/{qid}", "category": "second_turn", "messages": messages})
        print(f"second turn {qid}", flush=True)
    for qid in range(91, 97):
        passage = typos(answer([{"role": "user", "content": rows[qid]["turns"][0]}]))
        content = f"Correct the spelling mistakes in the following text and return the full corrected text.\n\n{passage}"
        out.append({"id": f"edit_text/{qid}", "category": "edit_text",
                    "messages": [{"role": "user", "content": content}]})
        print(f"edit text {qid}", flush=True)
    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f][:6]
    for p in problems:
        code = (p["prompt"] + p["canonical_solution"]).strip("\n")
        name = p["entry_point"]
        content = (f"Rename the function `{name}` to `{name}_v2` and return the complete code.\n\n"
                   f"```python\n{code}\n```")
        out.append({"id": f"edit_code/{p['task_id']}", "category": "edit_code",
                    "messages": [{"role": "user", "content": content}]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")
    print(f"wrote {len(out)} requests to {OUT}")


if __name__ == "__main__":
    main()
