"""Evaluation prompts shipped in ``data/`` (see ``data/README.md`` for sources and licenses)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .errors import VerispecError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SPEC_BENCH_GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
_MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def spec_bench() -> list[dict]:
    """Spec-Bench questions, each with ``question_id``, ``category``, ``group`` and ``turns``."""
    path = DATA_DIR / "spec_bench" / "question.jsonl"
    if not path.exists():
        raise VerispecError(f"Spec-Bench data not found at {path}")
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    for r in rows:
        r["group"] = "mt_bench" if r["category"] in _MT_BENCH else r["category"]
    return rows


def spec_bench_prompts(n: int, groups=SPEC_BENCH_GROUPS) -> list[tuple[str, str]]:
    """``n`` first-turn prompts taken round-robin over ``groups``: ``[(group, prompt)]``."""
    unknown = set(groups) - set(SPEC_BENCH_GROUPS)
    if unknown:
        raise VerispecError(f"unknown Spec-Bench group(s) {sorted(unknown)}; choose from {', '.join(SPEC_BENCH_GROUPS)}")
    by_group = defaultdict(list)
    for r in spec_bench():
        by_group[r["group"]].append(r["turns"][0])
    out = []
    for i in range(n):
        g = groups[i % len(groups)]
        out.append((g, by_group[g][i // len(groups)]))
    return out
