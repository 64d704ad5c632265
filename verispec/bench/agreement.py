"""How often a draft head agrees with its target, measured the way the decoding loop would see it.

* ``teacher_forced``: per depth 1..D, on the response tokens of given sequences, the head's top-1 agreement with
  the target and the greedy chain acceptance (``verispec.eagle.train.depth_counts``: from depth 2 on the head
  reads its own outputs, as in the loop), with each sequence's counts, so that two heads measured on the same
  sequences compare paired (``agreement_difference``, an interval over sequences);
* ``spec_bench_answers``: the target's greedy answers to held-out Spec-Bench questions (each category's *last*
  questions, which the benchmarks never use), the sequences to measure on;
* ``in_loop_check``: the acceptance per depth of a greedy chain in the real decoding loop, beside the
  teacher-forced chain acceptance at the very same positions of the very same text. They must agree up to
  rounding (the loop computes features incrementally, one tree at a time); a gap would mean the loop feeds the
  head something other than what it was trained on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .. import cache
from ..datasets import SPEC_BENCH_GROUPS, spec_bench_prompts
from ..decode import generate
from ..drafters import NoDrafter
from ..drafters.eagle import EagleDrafter
from ..eagle.corpus import Record, features, read_corpus
from ..eagle.head import EagleHead
from ..eagle.train import TrainConfig, _labels, _split, depth_counts, depth_outputs, new_counts, summarize_counts
from ..tree import Tree
from ..verifiers import get_verifier
from .stats import ratio_of_sums

FIXED_PROMPT = "Explain why the sky is blue in a short paragraph."  # a shipped head records its acceptance here
FIXED_TOKENS = 64


def teacher_forced(head: EagleHead, records: list[Record], depths: int = 4) -> dict[str, list[float]]:
    """Per-depth agreement and greedy chain acceptance of ``head`` on the response tokens of ``records``, and
    ``per_sequence``: each record's ``[agreeing positions, positions]`` per depth."""
    counts, each = new_counts(depths), []
    with torch.no_grad():  # counting only (the target's features come from inference mode, no gradient is wanted)
        for r in records:
            one = depth_counts(head, features(head.target, r, 1, head.feature_layers), depths)
            each.append([one["agree"], one["n"]])
            for key in counts:
                counts[key] = [a + b for a, b in zip(counts[key], one[key])]
    return {**summarize_counts(counts), "per_sequence": each}


def agreement_difference(a: dict, b: dict, depth: int = 1) -> tuple[float, float, float]:
    """Agreement at ``depth`` of set report ``a`` minus that of ``b`` (``teacher_forced`` of two heads on the same
    sequences), with a 95 % paired bootstrap interval over sequences."""
    pa, pb = a["per_sequence"], b["per_sequence"]
    if len(pa) != len(pb) or any(x[1][depth - 1] != y[1][depth - 1] for x, y in zip(pa, pb)):
        raise ValueError("the two reports were not measured on the same sequences")
    return ratio_of_sums([x[0][depth - 1] - y[0][depth - 1] for x, y in zip(pa, pb)], [x[1][depth - 1] for x in pa])


def spec_bench_answers(target, per_group: int = 2, max_new_tokens: int = 96, cache: str | Path | None = None,
                       progress=None) -> list[Record]:
    """The target's greedy answers to the last ``per_group`` Spec-Bench questions of each category, as records
    (prompt + answer, the answer as the span); cached in ``cache`` (JSONL) when given."""

    key = {"target": target.name, "per_group": per_group, "max_new_tokens": max_new_tokens}
    path = Path(cache) if cache else None
    if path is not None and path.exists():
        lines = [json.loads(line) for line in path.open()]
        if lines and lines[0] == key:
            return [Record(d["tokens"], d["spans"], d["shape"], -1) for d in lines[1:]]
    out = []
    for group, prompt in spec_bench_prompts(per_group * len(SPEC_BENCH_GROUPS), from_end=True):
        res = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(),
                       max_new_tokens=max_new_tokens, temperature=0.0)
        ids = res.prompt_ids + res.token_ids
        out.append(Record(ids, [[len(res.prompt_ids), len(ids)]], group, -1))
        if progress is not None:
            progress(1)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: a reader never sees half
        with tmp.open("w") as f:
            f.write(json.dumps(key) + "\n")
            for r in out:
                f.write(json.dumps({"tokens": r.tokens, "spans": r.spans, "shape": r.shape}) + "\n")
        tmp.replace(path)
    return out


def in_loop_check(target, head: EagleHead, prompts: list[str | list[int]], depths: int = 2,
                  max_new_tokens: int = 64) -> dict:
    """Greedy decoding with a chain of ``depths`` drafted by ``head``: the loop's acceptance at each depth against
    the teacher-forced chain acceptance at the same positions of the text it produced.

    Returns ``{"in_loop": [...], "teacher_forced": [...], "positions": [...], "mismatches": int}``: per depth, the
    rate of acceptance among the steps that reached it, and the number of (step, depth) decisions where the two
    disagree."""

    loop = [[0, 0] for _ in range(depths)]  # [reached, accepted]
    forced = [[0, 0] for _ in range(depths)]
    mismatches = 0
    for prompt in prompts:
        res = generate(target, EagleDrafter(head), get_verifier("chain"), prompt, tree=Tree.chain(depths),
                       policy="fixed",
                       max_new_tokens=max_new_tokens, temperature=0.0)
        ids = res.prompt_ids + res.token_ids
        data = features(target, Record(ids, [[len(res.prompt_ids), len(ids)]], "", -1), 1, head.feature_layers)
        hits = _chain_hits(head, data, depths)
        length = len(res.prompt_ids)  # context length before the step
        for step in res.steps:
            j = length - 2  # the committed pair (g_{L-2}, x_{L-1}) predicts the first drafted token
            accepted = step.accepted_length - 1
            for d in range(min(step.draft_depth, depths)):
                if length + d >= len(ids):  # the text ended (EOS or budget) before this depth's token
                    break
                loop[d][0] += 1
                loop[d][1] += d < accepted
                tf = hits.get((d + 1, j))
                if tf is not None:
                    forced[d][0] += 1
                    forced[d][1] += tf
                    mismatches += tf != (d < accepted)
                if d >= accepted:
                    break
            length += len(step.emitted)
    rate = lambda c: [a / n if n else float("nan") for n, a in c]  # noqa: E731
    return {"in_loop": rate(loop), "teacher_forced": rate(forced), "positions": [n for n, _ in loop],
            "mismatches": mismatches}


def _chain_hits(head: EagleHead, data: dict, depths: int) -> dict[tuple[int, int], bool]:
    """(depth, pair index j) -> whether the head's top-1 at that depth is the target's top-1."""


    out = {}
    T = len(data["tokens"])
    with torch.no_grad():
        for k, rows, _, logits in depth_outputs(head, data, depths):
            _, _, top1 = _labels(head, data, (rows + k).clamp(max=T - 1))
            for j, h in zip(rows.tolist(), (logits.argmax(-1) == top1).tolist()):
                out[(k, j)] = h
    return out


def fixed_prompt_acceptance(target, head: EagleHead) -> float:
    """Mean accepted length per step, greedy, chain of 5, on ``FIXED_PROMPT`` (deterministic)."""

    out = generate(target, EagleDrafter(head), get_verifier("chain"), FIXED_PROMPT, tree=Tree.chain(5), policy="fixed",
                   max_new_tokens=FIXED_TOKENS, temperature=0.0)
    return out.mean_accepted_length


def _held_out(head: EagleHead, folder: Path) -> tuple[TrainConfig, list[Record], list[int]]:
    """The split a head was trained with (its own training options, from its file; else the corpus folder's):
    the corpus rounds it saw, so that the held-out rounds are the ones it held out, however far the corpus has grown
    since."""
    cfg = head.meta.get("config")
    if not cfg:
        cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    config = TrainConfig(**{k: v for k, v in cfg.items() if k in TrainConfig.__dataclass_fields__})
    records = config.selects(read_corpus(folder))
    _, val = _split(records, config)
    return config, records, val


def training_record(head: EagleHead) -> dict:
    """What a head's file says of its training: data sizes, steps, minutes, the corpus rounds it trained with and its
    held-out curve (``held_out_curve``; None for heads written before that was kept)."""
    return {**{k: head.meta.get(k) for k in ("response_tokens", "corpus_tokens", "sequences", "steps", "best_step",
                                             "session_s", "curve")},
            "rounds": (head.meta.get("config") or {}).get("rounds"),
            "batch": (head.meta.get("config") or {}).get("batch"),  # sequences a step
            "first_round": (head.meta.get("config") or {}).get("first_round", 0)}


def agreement_report(target, head: EagleHead, depths: int = 4, per_group: int = 2, max_new_tokens: int = 96,
                     corpus: str | Path | None = None, check: int = 0, held_out_records: int = 200,
                     progress=None) -> dict:
    """``teacher_forced`` on held-out Spec-Bench answers (and, given a train-draft run folder, on its held-out
    rounds), plus, with ``check`` > 0, ``in_loop_check`` on that many held-out questions."""
    tick = progress or (lambda n=1: None)
    kept = cache.path("answers", f"{target.name}-{per_group}x{max_new_tokens}.jsonl")
    answers = spec_bench_answers(target, per_group, max_new_tokens, cache=kept, progress=tick)
    out = {"head": head.meta.get("target", "?"), "feature_layers": list(head.feature_layers),
           "decoder_layers": len(head.body.layers), "head_parameters": sum(p.numel() for _, p in head.own_parameters()),
           "depths": depths,
           "training": training_record(head),
           "sets": {}}
    by_group: dict[str, list[Record]] = {}
    for r in answers:
        by_group.setdefault(r.shape, []).append(r)
    out["sets"]["spec-bench (held out)"] = {"sequences": len(answers), **teacher_forced(head, answers, depths)}
    for g in SPEC_BENCH_GROUPS:
        out["sets"][f"  {g}"] = {"sequences": len(by_group.get(g, [])),
                                 **teacher_forced(head, by_group.get(g, []), depths)}
    if corpus is not None:
        _, records, val = _held_out(head, Path(corpus))
        rounds = sorted({records[i].round for i in val})
        held = [records[i] for i in val][:held_out_records]
        out["sets"]["self-written (held-out rounds)"] = {"sequences": len(held), "rounds": rounds,
                                                         **teacher_forced(head, held, depths)}
    if check:
        prompts = [p for _, p in spec_bench_prompts(check, from_end=True)]
        out["in_loop_check"] = in_loop_check(target, head, prompts, depths=depths, max_new_tokens=max_new_tokens)
        tick(check)
    return out


def format_agreement(report: dict) -> str:
    d = report["depths"]
    head = ["set", "sequences", *[f"agree d{k}" for k in range(1, d + 1)], *[f"chain d{k}" for k in range(1, d + 1)]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda x: "-" if x != x else f"{x:.3f}"  # noqa: E731
    for name, s in report["sets"].items():
        lines.append(f"| {name} | {s['sequences']} | " + " | ".join(map(f, s["agreement"])) + " | "
                     + " | ".join(map(f, s["chain_acceptance"])) + " |")
    text = ("Agreement with the target per drafted depth on response tokens (agree: top-1 agreement; chain: greedy "
            "chain acceptance, among positions whose earlier depths all agreed)\n\n" + "\n".join(lines))
    if "in_loop_check" in report:
        c = report["in_loop_check"]
        text += ("\n\nIn the decoding loop (greedy chain) against teacher forcing at the same positions: "
                 + "; ".join(f"depth {k + 1}: {f(a)} vs {f(b)} ({n} steps)" for k, (a, b, n) in
                             enumerate(zip(c["in_loop"], c["teacher_forced"], c["positions"])))
                 + f"; decisions that differ: {c['mismatches']}")
    return text
