"""Evaluation prompts: the sets shipped in ``data/`` (see ``data/README.md`` for sources and licenses) and a
user's own JSONL file, behind one loader (``load_prompts``)."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .errors import VerispecError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SPEC_BENCH_GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
_MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
REPETITIVE_GROUPS = ("second_turn", "edit_text", "edit_code")
GSM8K_INSTRUCTION = "Solve the problem step by step, then give the final answer as a number after '####'.\n\n"
DATASETS_HELP = (
    "'spec-bench' (6 categories: " + ", ".join(SPEC_BENCH_GROUPS) + "; pick some with 'spec-bench:qa,rag'), "
    "'gsm8k', 'humaneval', 'repetitive' (requests whose answers repeat earlier text: " + ", ".join(REPETITIVE_GROUPS)
    + "; pick some with 'repetitive:edit_code'), or a JSONL file of your own prompts (PATH.jsonl or jsonl:PATH; one "
    "object per line with 'prompt' (or 'turns', first turn used, or 'messages', a conversation), optional 'id', "
    "'category', 'chat')"
)


@dataclass(frozen=True)
class Problem:
    task: str  # data set: "spec-bench", "gsm8k", "humaneval" or the user's file name
    id: str
    prompt: str | list[dict]  # what the model is given: a text, or a conversation (``{"role", "content"}`` messages)
    chat: bool  # send through the chat template
    reference: dict = field(default_factory=dict)  # what scoring needs (GSM8K, HumanEval)
    category: str = ""  # Spec-Bench category (or the user's); the data set's name otherwise

    @property
    def group(self) -> str:
        return self.category or self.task


def spec_bench() -> list[dict]:
    """Spec-Bench questions, each with ``question_id``, ``category``, ``group`` and ``turns``."""
    path = DATA_DIR / "spec_bench" / "question.jsonl"
    if not path.exists():
        raise VerispecError(f"Spec-Bench data not found at {path}")
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    for r in rows:
        r["group"] = "mt_bench" if r["category"] in _MT_BENCH else r["category"]
    return rows


def _check_groups(groups) -> None:
    unknown = set(groups) - set(SPEC_BENCH_GROUPS)
    if unknown:
        raise VerispecError(f"unknown Spec-Bench group(s) {sorted(unknown)}; choose from {', '.join(SPEC_BENCH_GROUPS)}")


def spec_bench_prompts(n: int, groups=SPEC_BENCH_GROUPS, from_end: bool = False) -> list[tuple[str, str]]:
    """``n`` first-turn prompts taken round-robin over ``groups``: ``[(group, prompt)]``; ``from_end`` takes each
    group's last questions instead of its first (tuning on them keeps the benchmark's first questions unseen)."""
    by_group = defaultdict(list)
    for p in spec_bench_problems(None, groups):
        by_group[p.category].append(p.prompt)
    pick = (lambda i: -1 - i // len(groups)) if from_end else (lambda i: i // len(groups))
    return [(groups[i % len(groups)], by_group[groups[i % len(groups)]][pick(i)]) for i in range(n)]


def spec_bench_problems(limit: int | None, groups=SPEC_BENCH_GROUPS) -> list[Problem]:
    """The first ``limit`` questions of each group (first turn, chat template), grouped in ``groups`` order."""
    _check_groups(groups)
    by_group = defaultdict(list)
    for r in spec_bench():
        by_group[r["group"]].append(r)
    out = []
    for g in groups:
        for r in by_group[g][:limit]:
            out.append(Problem("spec-bench", f"spec-bench/{r['question_id']}", r["turns"][0], True, category=g))
    return out


def gsm8k(n: int | None) -> list[Problem]:
    path = DATA_DIR / "gsm8k" / "test.jsonl"
    if not path.exists():
        raise VerispecError(f"GSM8K data not found at {path}")
    out = []
    for i, line in enumerate(path.open(encoding="utf-8")):
        if n is not None and i >= n:
            break
        row = json.loads(line)
        gold = row["answer"].split("####")[-1].strip()
        out.append(Problem("gsm8k", f"gsm8k/{i}", GSM8K_INSTRUCTION + row["question"], True, {"answer": gold}))
    return out


def humaneval(n: int | None) -> list[Problem]:
    path = DATA_DIR / "humaneval" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise VerispecError(f"HumanEval data not found at {path}")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if n is not None and i >= n:
                break
            row = json.loads(line)
            # plain completion of the function (no chat template): the model continues the code
            out.append(Problem("humaneval", row["task_id"], row["prompt"], False,
                               {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}))
    return out


def jsonl_problems(path: str | Path, limit: int | None = None) -> list[Problem]:
    """A user's prompts: one JSON object per line with ``prompt`` (or ``turns``), optional ``id``,
    ``category`` and ``chat`` (default true)."""
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"prompt file not found: {path}")
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise VerispecError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            text = row.get("prompt") if isinstance(row, dict) else None
            if text is None and isinstance(row, dict) and row.get("turns"):
                text = row["turns"][0]
            if text is None and isinstance(row, dict) and row.get("messages") is not None:
                text = row["messages"]
                if not (isinstance(text, list) and text and all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in text)):
                    raise VerispecError(f"{path}:{n}: 'messages' must be a non-empty list of {{'role', 'content'}} "
                                        "strings")
            elif not isinstance(text, str) or not text.strip():
                raise VerispecError(f"{path}:{n}: needs a non-empty 'prompt' (or 'turns') string, or 'messages'")
            out.append(Problem(path.stem, str(row.get("id", f"{path.stem}/{len(out)}")), text,
                               bool(row.get("chat", True)), category=str(row.get("category", ""))))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise VerispecError(f"no prompts in {path}")
    return out


def repetitive_problems(limit: int | None, groups=REPETITIVE_GROUPS) -> list[Problem]:
    """The repetitive workload (``scripts/make_repetitive.py``): the first ``limit`` requests of each group, each a
    conversation, grouped in ``groups`` order."""
    unknown = set(groups) - set(REPETITIVE_GROUPS)
    if unknown:
        raise VerispecError(f"unknown repetitive group(s) {sorted(unknown)}; choose from {', '.join(REPETITIVE_GROUPS)}")
    rows = jsonl_problems(DATA_DIR / "repetitive" / "requests.jsonl")
    return [Problem("repetitive", p.id, p.prompt, True, category=p.category)
            for g in groups for p in [p for p in rows if p.category == g][:limit]]


def load_prompts(spec: str, limit: int | None = None) -> list[Problem]:
    """Problems named by ``spec`` (see ``DATASETS_HELP``); ``limit`` is per category for Spec-Bench, per set else."""
    if limit is not None and limit < 1:
        raise VerispecError(f"the prompt limit must be >= 1, got {limit}")
    name, _, arg = spec.partition(":")
    if name == "spec-bench":
        groups = tuple(g for g in arg.split(",") if g) or SPEC_BENCH_GROUPS
        return spec_bench_problems(limit, groups)
    if name in ("gsm8k", "humaneval") and not arg:
        return (gsm8k if name == "gsm8k" else humaneval)(limit)
    if name == "repetitive":
        return repetitive_problems(limit, tuple(g for g in arg.split(",") if g) or REPETITIVE_GROUPS)
    if name == "jsonl" and arg:
        return jsonl_problems(arg, limit)
    if spec.endswith(".jsonl"):
        return jsonl_problems(spec, limit)
    raise VerispecError(f"unknown data set {spec!r}: use {DATASETS_HELP}")
