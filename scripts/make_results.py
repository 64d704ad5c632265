"""Regenerate docs/results.md and its figures: runs (or resumes) the benchmark runs below with
``verispec bench``, then renders their records. Finished runs are not repeated (their files are resumed).

    python scripts/make_results.py            # run what is missing, then render
    python scripts/make_results.py --render   # render from the existing results files only
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROSE_FILE = Path(__file__).resolve().parent / "results_prose.md"  # the passages of prose, by key


def _prose(path: Path) -> dict[str, str]:
    """The passages of ``path``: each ``<!-- key -->`` line opens one, which runs to the next (blank lines at its end
    dropped)."""
    parts = re.split(r"^<!-- (.+?) -->\n", path.read_text(encoding="utf-8"), flags=re.M)[1:]
    return {key: text.rstrip("\n") for key, text in zip(parts[::2], parts[1::2])}


PROSE = _prose(PROSE_FILE)
sys.path.insert(0, str(ROOT))

from verispec import cli
from verispec.bench.plots import categories, latency, per_candidate, width
from verispec.bench.records import NO_DRAFT, Results
from verispec.bench.report import (
    shadow_summary,
    share_of_bias_gain,
    summarize,
    table_audit,
    table_categories,
    table_drafts,
    table_peers,
    table_shadow,
    table_trees,
    table_verifiers_by_category,
    table_width,
)
from verispec.bench.runner import BenchConfig, static_notes
from verispec.bench.stats import fmt

TABLE1_VERIFIERS = ["specinfer", "resispec", "swor", "reserve", "topk"]
ISO_TREES = ["30x1", "5x2", "2x4", "6,1,1,1,1", "3,1,1,1,1,1,1,1,1,1"]  # 30 drafted nodes each
WIDTH_TREES = ["1x3", "2x3", "3x3", "4x3"]  # N candidates per node, depth 3 (3x3 is the shadow run's tree)

# plain decoding with the stock linear kernel and with verispec's (see verispec.backends.kernels)
KERNEL = ["--methods", "hf-generate", "ar", "--drafts", "none", "--datasets", "spec-bench", "--limit", "1",
          "--temperatures", "0", "--max-new-tokens", "48"]

RUNS = {
    "kernel_stock": KERNEL,
    "kernel": KERNEL,
    "peers": ["--methods", "hf-generate", "hf-assisted", "ar", "fixed", "--drafts", "int8", "ngram",
              "--datasets", "spec-bench", "--limit", "2", "--temperatures", "0", "0.6", "--max-new-tokens", "48"],
    "drafts": ["--methods", "ar", "fixed", "--drafts", "layerskip:8", "layerskip:15", "layerskip:0-11,18-29", "ngram",
               "int8", "--datasets", "spec-bench", "--limit", "1", "--temperatures", "0", "0.6",
               "--max-new-tokens", "32"],
    "table1": ["--methods", "ar", *[f"{v}@3x5" for v in TABLE1_VERIFIERS], "--drafts", "int8",
               "--datasets", "spec-bench:summarization,qa,translation", "--limit", "2", "--temperatures", "0.6", "1.0",
               "--max-new-tokens", "32", "--audit-cases", "100"],
}


TUNED = ROOT / "results" / "tune_eagle.json"
TUNE_COMMAND = "verispec tune-tree --draft eagle --children topk --temperature 0 --prompts 6 --out results/tune_eagle.json"
HEAD_INFO = ROOT / "verispec" / "heads" / "smollm2-135m.json"  # the shipped head's sidecar
# `verispec eval-draft --draft eagle:HEAD --corpus runs/e3 --per-group 5 --check 3 --json` for the shipped head and
# for the EAGLE-3-style head trained in issue 12 (docs/archive/findings.md has the commands)
AGREEMENT = {"EAGLE-1 head (shipped until 2026-12-03)": ROOT / "results" / "agreement_shipped.json",
             "EAGLE-3-style head (not shipped)": ROOT / "results" / "agreement_eagle3.json",
             "shipped head (since 2026-12-05)": ROOT / "results" / "head_agreement.json"}
AGREEMENT_COMMANDS = {  # as run (docs/archive/findings.md, "Head variants")
    "EAGLE-1 head (shipped until 2026-12-03)": "verispec eval-draft --draft eagle:verispec/heads/smollm2-135m.pt --corpus runs/e3 "
                              "--per-group 5 --check 3 --json > results/agreement_shipped.json",
    "EAGLE-3-style head (not shipped)": "verispec eval-draft --draft eagle:runs/final/head.pt --corpus runs/e3 "
                                        "--per-group 5 --json > results/agreement_eagle3.json",
    "shipped head (since 2026-12-05)": "verispec eval-draft --draft eagle --per-group 10 --depths 3 --corpus "
                                       "data/corpus/smollm2-135m --threads 1 --json > results/head_agreement.json"}
CURVE = ROOT / "results" / "head_curve"  # `verispec eval-draft --json` reports of heads trained on more and more of one corpus
CURVE_CORPUS = ("verispec train-draft --until corpus --rounds 128 --gen-batch 128 --feature-layers 3,15,27 --depths 3 "
                "--out data/corpus/smollm2-135m")
CURVE_TRAIN = ("verispec train-draft --corpus data/corpus/smollm2-135m --out runs/curve-rR --rounds R --gen-batch 128 "
               "--feature-layers 3,15,27 --depths 3 --epochs 2 --patience 4 --checkpoint-every 150")
CURVE_5M = ROOT / "results" / "head_curve_5m"  # the same kind of reports: `bash scripts/head_curve.sh` (issue 27)
CURVE_5M_TEXT = (
    PROSE["CURVE_5M_TEXT"])
CAPACITY = ROOT / "results" / "head_capacity"  # `verispec eval-draft --json` reports of heads differing in decoder layers
CAPACITY_TRAIN = ("verispec train-draft --corpus data/corpus/smollm2-135m --out runs/cap-LN --rounds 32 --gen-batch 128 "
                  "--feature-layers 3,15,27 --depths 3 --epochs 1 --patience 4 --checkpoint-every 150 "
                  "--decoder-layers N --threads 1")
EPOCHS = ROOT / "results" / "head_epochs"  # the 1-layer head of head_capacity trained on: reports of the same kinds
EPOCHS_TRAIN = ("verispec train-draft --corpus data/corpus/smollm2-135m --out runs/cap-L1-eE --rounds R --gen-batch 128 "
                "--feature-layers 3,15,27 --depths 3 --epochs 1 --patience 4 --checkpoint-every 150 "
                "--init BEFORE")
EPOCHS_BEFORE = {2: "runs/cap-L1/head.pt", 3: "runs/cap-L1-e2/head.pt",  # else the last epoch's run
                 4: "data/heads/smollm2-135m-eagle3-3epochs.pt", 5: "data/heads/smollm2-135m-eagle3-4epochs.pt",
                 6: "data/heads/smollm2-135m-eagle3-5epochs.pt", 8: "verispec/heads/smollm2-135m.pt"}
# options an epoch's run added to EPOCHS_TRAIN: the sixth went on from the fifth on the rounds written since (on a
# GPU), at a lower peak rate (the fifth spent most of its schedule recovering from a warm-up to 1e-3)
EPOCHS_FLAGS = {6: "--first-round 37 --lr 3e-4 --precision bfloat16",
                # the seventh and eighth: two passes in one schedule over the rounds written since the sixth
                8: "--first-round 53 --lr 3e-4 --epochs 2 --checkpoint-every 100"}
VARIANTS = ROOT / "results" / "head_variants.json"  # `python scripts/experiments/head_variants.py RUN... --out ...`

DYNAMIC = "dyn:4,2,3"  # EAGLE-2 dynamic tree: depth <= 4, top-2 expansion, the 3 most probable nodes kept
TABLE2_TREE = "3,1"  # 3 candidates, each followed by one more token: small enough to verify cheaply on this CPU
TABLE2_VERIFIERS = ["specinfer", "resispec", "swor", "reserve", "topk"]
SHADOW_TREE = "3x3"  # 3 i.i.d. candidates per node, depth 3 (39 drafted nodes: a step costs about 2 plain ones here)
SHADOWS = ["specinfer", "resispec", "reserve", "ordered", "traversal"]


def spec_bench(*temperatures: str) -> list[str]:
    """Every Spec-Bench category, 3 questions each, 128 new tokens (T = 0 and 0.6 unless given)."""
    return ["--datasets", "spec-bench", "--limit", "3", "--temperatures", *(temperatures or ("0", "0.6")),
            "--max-new-tokens", "128"]


def table2_run() -> list[str]:
    return ["--methods", "ar", *[f"{v}@{TABLE2_TREE}" for v in TABLE2_VERIFIERS], f"topk@{DYNAMIC}",
            "--drafts", "eagle", "--datasets", "spec-bench", "--limit", "1", "--temperatures", "0.6", "1.0",
            "--max-new-tokens", "48", "--audit-cases", "100"]


def speed_run(*temperatures: str) -> list[str]:
    """What a user feels: the defaults against plain decoding and the peers, every Spec-Bench category (T = 0 and 0.6
    unless given)."""
    return ["--methods", "hf-generate", "hf-assisted", "llama-cpp", "ar", "default", "--drafts", "auto", "ngram",
            *spec_bench(*temperatures)]


# the same on an AVX-512 EPYC after the GGUF-block kernel's block passes, the head's output layer read from its Q8_0
# blocks and the native rotary kernel (llama-cpp-python was not installed on that machine, so llama.cpp is left out)
RUNS["speed_avx512"] = ["--methods", "hf-generate", "hf-assisted", "ar", "default", "--drafts", "auto", "ngram",
                        *spec_bench()]
SPEED_AVX512_HEADING = "## Speed of the defaults on an AVX-512 CPU, after the kernel and head changes of 2026-12-05"
SPEED_AVX512_LEAD = (
    PROSE["SPEED_AVX512_LEAD 0"],
    PROSE["SPEED_AVX512_LEAD 1"],
)
# the same machine after the lean forward's fewer calls (fbafde5: a layer's seven linear layers as four native calls;
# c1f8867: one native call writes a step's keys and attends), with llama-cpp-python installed this time
RUNS["speed_calls"] = speed_run()
SPEED_CALLS_HEADING = "## Speed of the defaults on an AVX-512 CPU, after the forward's fewer calls (2026-12-06)"
SPEED_CALLS_LEAD = (
    PROSE["SPEED_CALLS_LEAD 0"],
    PROSE["SPEED_CALLS_LEAD 1"],
)

# the same machine after the decoder layers ran in one native call (5ed62f4)
RUNS["speed_layers"] = speed_run()
SPEED_LAYERS_HEADING = "## Speed of the defaults on an AVX-512 CPU, after the decoder layers in one call (2026-12-06)"
SPEED_LAYERS_LEAD = (
    PROSE["SPEED_LAYERS_LEAD 0"],
    PROSE["SPEED_LAYERS_LEAD 1"],
)

# the same machine after the lean forward's own RMS norm (5d18cb3)
RUNS["speed_norm"] = speed_run()
SPEED_NORM_HEADING = "## Speed of the defaults on an AVX-512 CPU, after the lean forward's own norm (2026-12-06)"
SPEED_NORM_LEAD = (
    PROSE["SPEED_NORM_LEAD 0"],
    PROSE["SPEED_NORM_LEAD 1"],
)

# the same machine after the head's step costs were measured as the loop pays them (d21f7b3) and SiLU times up moved
# into the one call (ec02b29)
RUNS["speed_loopcosts"] = speed_run()
SPEED_LOOPCOSTS_HEADING = ("## Speed of the defaults on an AVX-512 CPU, the head's step costs as the loop pays them "
                           "(2026-12-06)")
SPEED_LOOPCOSTS_LEAD = (
    PROSE["SPEED_LOOPCOSTS_LEAD 0"],
    PROSE["SPEED_LOOPCOSTS_LEAD 1"],
)

# the same machine after the chain rule's verdict at a greedy target was read off the argmaxes (afe76f7)
RUNS["speed_verify"] = speed_run()
SPEED_VERIFY_HEADING = ("## Speed of the defaults on an AVX-512 CPU, the greedy chain's verdict off its argmaxes "
                        "(2026-12-06)")
SPEED_VERIFY_LEAD = (
    PROSE["SPEED_VERIFY_LEAD 0"],
    PROSE["SPEED_VERIFY_LEAD 1"],
)


# the same machine after prompt lookup's drafts read its n-gram index (3e14ce8) and the head's step costs were measured
# again by `tune-tree` after the greedy verdict (its sidecar)
RUNS["speed_lookup"] = speed_run()
SPEED_LOOKUP_HEADING = ("## Speed of the defaults on an AVX-512 CPU, prompt lookup from its n-gram index "
                        "(2026-12-06)")
SPEED_LOOKUP_LEAD = (
    PROSE["SPEED_LOOKUP_LEAD 0"],
    PROSE["SPEED_LOOKUP_LEAD 1"],
)


# the same machine and code at T = 0.6 over three seeds: one seed left the sampled cells to one draw of texts, whose
# lengths differ between methods (an answer ending early moves a category's ratio by itself)
RUNS["speed_seeds"] = [*speed_run("0.6"), "--seeds", "0", "1", "2"]
SPEED_SEEDS_HEADING = "## Speed at T = 0.6 over three seeds (2026-12-06)"
SPEED_SEEDS_LEAD = (
    PROSE["SPEED_SEEDS_LEAD 0"],
    PROSE["SPEED_SEEDS_LEAD 1"],
)


# after a float32 prompt's rows went to the linear kernel measured faster for many rows (5bcdbab), every temperature
# over three seeds (run on another machine: an Intel Xeon with AVX-512, without llama-cpp-python)
RUNS["speed_prompt"] = [*speed_run(), "--seeds", "0", "1", "2"]
SPEED_PROMPT_HEADING = "## Speed of the defaults, a prompt's rows on the kernel measured faster for them (2026-12-06)"
SPEED_PROMPT_LEAD = (
    PROSE["SPEED_PROMPT_LEAD 0"],
    PROSE["SPEED_PROMPT_LEAD 1"],
)

# the same with each seed a round and the methods' order reversed every other round (issue 67), on an AVX-512 EPYC
# with llama-cpp-python, after the serving fixes of ac2f5a4 (oneDNN's bfloat16 row counts; float32 runs here)
RUNS["speed_rounds"] = [*speed_run(), "--seeds", "0", "1", "2"]
SPEED_ROUNDS_HEADING = "## Speed of the defaults in three rounds of alternating order (2026-12-07)"
SPEED_ROUNDS_LEAD = (
    PROSE["SPEED_ROUNDS_LEAD 0"],
)

# speculation's own share on an Intel Xeon (AVX-512 with FP16) in three rounds (issue 66: on every CPU measured), at
# 4f6d187: `default` against `ar`, with the hybrid draft and prompt lookup alone (no peers: the question is the share)
RUNS["speed_xeon"] = ["--methods", "ar", "default", "--drafts", "auto", "ngram", *spec_bench(),
                      "--seeds", "0", "1", "2"]
SPEED_XEON_HEADING = "## Speculation's own share on an Intel Xeon, in three rounds (2026-12-07)"
SPEED_XEON_LEAD = (
    PROSE["SPEED_XEON_LEAD 0"],
)

# the same on the same Intel Xeon after the head's own layers began to draft from Q8_0 blocks (3a1f88e)
RUNS["speed_q8"] = RUNS["speed_xeon"]
SPEED_Q8_HEADING = ("## Speculation's own share on an Intel Xeon, the head from Q8_0 blocks, in three rounds "
                    "(2026-12-07)")
SPEED_Q8_LEAD = (
    PROSE["SPEED_Q8_LEAD 0"],
)

# the same on an AVX-512 AMD EPYC after a head depth went into one native call and the head's step costs and tree were
# measured again (ee59eb8)
RUNS["speed_fused"] = RUNS["speed_xeon"]
SPEED_FUSED_HEADING = ("## Speculation's own share on an AVX-512 AMD EPYC, a head depth in one native call, in three "
                       "rounds (2026-12-08)")
SPEED_FUSED_LEAD = (
    PROSE["SPEED_FUSED_LEAD 0"],
)
# the latest share run on each CPU, newest first, that "Where it stands" reads
SHARE_RUNS = (("speed_fused", SPEED_FUSED_HEADING), ("speed_q8", SPEED_Q8_HEADING))

# every speed run, oldest first: (run, figure tag, heading, lead); "" and () give speed_section's own. The last
# LATEST_SPEED are the page's first sections after "Where it stands"; the others open Earlier runs, in this order.
SPEED_RUNS = (("speed", "", "", ()), ("speed_bf16", "", "", ()),
              *((name, name[len("speed"):], heading, lead) for name, heading, lead in (
                  ("speed_avx512", SPEED_AVX512_HEADING, SPEED_AVX512_LEAD),
                  ("speed_calls", SPEED_CALLS_HEADING, SPEED_CALLS_LEAD),
                  ("speed_layers", SPEED_LAYERS_HEADING, SPEED_LAYERS_LEAD),
                  ("speed_norm", SPEED_NORM_HEADING, SPEED_NORM_LEAD),
                  ("speed_loopcosts", SPEED_LOOPCOSTS_HEADING, SPEED_LOOPCOSTS_LEAD),
                  ("speed_verify", SPEED_VERIFY_HEADING, SPEED_VERIFY_LEAD),
                  ("speed_lookup", SPEED_LOOKUP_HEADING, SPEED_LOOKUP_LEAD),
                  ("speed_seeds", SPEED_SEEDS_HEADING, SPEED_SEEDS_LEAD),
                  ("speed_prompt", SPEED_PROMPT_HEADING, SPEED_PROMPT_LEAD),
                  ("speed_xeon", SPEED_XEON_HEADING, SPEED_XEON_LEAD),
                  ("speed_fused", SPEED_FUSED_HEADING, SPEED_FUSED_LEAD),
                  ("speed_q8", SPEED_Q8_HEADING, SPEED_Q8_LEAD),
                  ("speed_rounds", SPEED_ROUNDS_HEADING, SPEED_ROUNDS_LEAD))))
LATEST_SPEED = 3  # the latest share run of each CPU, then the rounds beside every peer ("Where it stands": the last)


# free draft sources (issue 66): each alone under `default`, on Spec-Bench and on the repetitive workload
RUNS["free_drafts"] = ["--methods", "ar", "default", "--drafts", "auto", "ngram", "suffix", "recycle", "hybrid:recycle",
                       *spec_bench("0", "0.6")]
RUNS["repetitive"] = ["--methods", "ar", "default", "--drafts", "auto", "ngram", "suffix", "--datasets", "repetitive",
                      "--limit", "6", "--temperatures", "0", "0.6", "--max-new-tokens", "128", "--seeds", "0", "1", "2"]
FREE_DRAFTS_LEAD = (
    PROSE["FREE_DRAFTS_LEAD 0"],
)
REPETITIVE_HEADING = "## The repetitive workload"
REPETITIVE_LEAD = (
    PROSE["REPETITIVE_LEAD 0"],
)


def depth_table(res: Results) -> str:
    """Per temperature and draft, from the step records of `default`: the share of steps that drafted, the acceptance
    at each depth (of the steps that drafted that deep and accepted every depth before it, the share that accepted
    it), and the drafting's milliseconds per drafting step."""
    from verispec.bench.report import markdown

    cells: dict[tuple, list[dict]] = {}
    for steps in res.steps.values():
        c = steps[0]["cell"]
        if c["method"] == "default":
            cells.setdefault((c["T"], c["draft"]), []).extend(steps)
    body = []
    for (t, d), steps in sorted(cells.items()):
        drafting = [s for s in steps if s["drafted"]]
        acc = []
        for depth in range(1, 5):
            reached = [s for s in drafting if s["draft_depth"] >= depth and s["accepted_length"] >= depth]
            took = sum(s["accepted_length"] >= depth + 1 for s in reached)
            acc.append(f"{took / len(reached):.2f} ({len(reached)})" if reached else "-")
        ms = 1000 * sum(s["draft_s"] for s in drafting) / len(drafting) if drafting else 0.0
        body.append([f"{t:g}", d, f"{len(drafting) / len(steps):.2f}", *acc, f"{ms:.2f}"])
    return markdown(["T", "draft", "steps drafting", "depth 1 (steps)", "depth 2", "depth 3", "depth 4",
                     "draft ms per drafting step"], body)


def draft_cost_lines() -> list[str]:
    """What drafting a chain costs the drafts that run no model, their few tokens a row against whole rows, from
    results/draft_cost.json (``scripts/experiments/draft_cost.py``)."""
    from verispec.bench.report import markdown

    file = ROOT / "results" / "draft_cost.json"
    if not file.exists():
        return []
    data = json.loads(file.read_text())
    body = [[f"{r['T']:g}", r["draft"], str(r["depth"]), str(r["drafted"]), f"{r['dense_ms']:.3f}",
             f"{r['sparse_ms']:.3f}", f"{r['dense_ms'] / r['sparse_ms']:.2f}x"] for r in data["rows"]]
    return ["What drafting a chain costs (`propose`, the median of alternated calls after a 300-token Spec-Bench "
            "context): each draft on its few tokens a row, as it drafts now, against the same draft answering whole "
            f"rows of the vocabulary, as every draft did before (`{' '.join(data['command'])}` at git "
            f"{data['git']}, {data['machine'].get('cpu')}):", "",
            markdown(["T", "draft", "chain", "drafted", "whole rows, ms", "a few tokens a row, ms", "ratio"], body),
            ""]


def free_drafts_section(res: Results, heading: str, lead: tuple[str, ...], costs: bool = False) -> list[str]:
    rows, cats = summarize(res), summarize(res, by_category=True)
    return [heading, "", *run_lines(res), "", *[x for paragraph in lead for x in (paragraph, "")],
            table_peers(rows), "", "Acceptance by depth:", "", depth_table(res), "",
            *(draft_cost_lines() if costs else []), "By category:", "",
            by_category_table(cats, (("speedup_ar", "vs ar"),)), "", *step_time_table(res)]


ANSWER_CACHE_HEADING = "## The server's answer cache on repeated requests"


def answer_cache_ratios() -> tuple[dict, list[list[str]]] | None:
    """results/answer_cache.json (``scripts/experiments/answer_cache.py``) and its table: per temperature and pass,
    per-request tokens/s with the cache over without, the geometric mean over requests and rounds with its 95 %
    interval."""
    import math
    import statistics

    file = ROOT / "results" / "answer_cache.json"
    if not file.exists():
        return None
    data = json.loads(file.read_text())
    logs: dict[tuple, list[float]] = {}
    rounds: dict[float, int] = {}
    for rec in data["records"]:
        t = rec["temperature"]
        rounds[t] = rounds.get(t, 0) + 1
        on, off = rec["runs"][str(data["cache"])], rec["runs"]["0"]
        for name in ("first", "repeat"):
            for (n_on, s_on), (n_off, s_off) in zip(on[name], off[name]):
                logs.setdefault((t, name), []).append(math.log((n_on / s_on) / (n_off / s_off)))
    body = []
    for (t, name), xs in sorted(logs.items()):
        m = statistics.fmean(xs)
        half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs))
        body.append([f"{t:g}", name, str(len(xs)), str(rounds[t]),
                     f"{math.exp(m):.2f}x [{math.exp(m - half):.2f}, {math.exp(m + half):.2f}]"])
    return data, body


def answer_cache_section() -> list[str]:
    from verispec.bench.report import markdown

    got = answer_cache_ratios()
    if got is None:
        return []
    data, body = got
    return [ANSWER_CACHE_HEADING, "",
            f"Run: `{' '.join(data['command'])}` at git {data['git']}, {data['machine'].get('cpu')}, "
            f"{data['machine'].get('cpu_count')} cores, {data['date']}.", "",
            "`verispec serve` with its answer cache (`--answer-cache " + str(data["cache"]) + "`) against the same "
            "server without it (`--answer-cache 0`), each started fresh on 127.0.0.1 with one slot (`--max-batch "
            "1`, float32), the default draft and method. Each round sends the requests (Spec-Bench, "
            f"{data['limit']} per category, {data['max_tokens']} tokens) once, the first pass, then all again, the "
            "repeat pass; rounds alternate which server goes first. Each cell is the per-request tokens/s with the "
            "cache over without it (prefill included), the geometric mean over requests and rounds with its 95 % "
            "interval. On the first pass the cache holds only the answers to the requests before it; on the repeat "
            "pass it also holds the request's own earlier answer. With the cache, the default draft's prompt lookup "
            "is the suffix draft over the context and the cache (`drafters.with_answer_cache`); without it, the "
            "n-gram index: the first pass measures that change too. At T = 0 a repeated request's answer is its "
            "earlier one token for token; at T > 0 it is another sample, which follows the cached one only until "
            "they part.", "",
            markdown(["T", "pass", "pairs", "rounds", "with the cache / without"], body), ""]


def repeats_standing() -> list[str]:
    """"Where it stands" on text that repeats: `default` against `ar` on the repetitive workload, and the server's
    answer cache on repeated requests."""
    from verispec.bench.report import markdown

    out = []
    if path("repetitive").exists():
        res = Results.load(path("repetitive"))
        rows = {(r.T, r.draft): r for r in summarize(res) if r.category == "all" and r.method == "default"}
        temps = sorted({t for t, _ in rows})
        body = [[f"`{d}`", *[rows[t, d].show("speedup_ar", ".2f", "x") if (t, d) in rows else "-" for t in temps]]
                for d in sorted({d for _, d in rows}, key=lambda d: (d != "auto", d))]
        out += ["### Where text repeats", "",
                "`default` with each draft against `ar` on the repetitive workload (second turns, text and code "
                "edits; 18 requests, 128 new tokens, three seeds as rounds in alternating order; tokens/s counts "
                "the prefill of their long prompts):", "",
                markdown(["draft", *[f"T = {t:g}" for t in temps]], body), "",
                f"From {link(REPETITIVE_HEADING)} ({_short(res)}).", ""]
    got = answer_cache_ratios()
    if got is not None:
        data, body = got
        repeat = {row[0]: row[4] for row in body if row[1] == "repeat"}
        out += ["The server drafting from the answers it has served, against the same server without them, on a "
                "request sent a second time: " + ", ".join(f"{v} at T = {t}" for t, v in repeat.items()) +
                f" (from {link(ANSWER_CACHE_HEADING)}, git {data['git'][:7]}, {data['machine'].get('cpu')}).", ""]
    return out


def speed_sections(runs, figs: Path) -> list[str]:
    """The sections of ``runs`` (entries of ``SPEED_RUNS``) whose records exist."""
    out = []
    for run_name, tag, heading, lead in runs:
        if path(run_name).exists():
            out += speed_section(Results.load(path(run_name)), figs, heading, lead, tag=tag)
    return out

def hybrid_run() -> list[str]:
    """The default's draft against prompt lookup and the two switched per step (``hybrid``), all under ``auto``."""
    return ["--methods", "ar", "default", "--drafts", "eagle", "ngram", "hybrid", *spec_bench()]


def shadow_run() -> list[str]:
    """Verifiers compared on the very same steps (one exact driver, the others as shadows)."""
    return ["--methods", f"specinfer@{SHADOW_TREE}", "--shadow", *SHADOWS, "--shadow-seeds", "2", "--drafts", "int8", "eagle",
            "--datasets", "spec-bench:summarization,qa,translation", "--limit", "10", "--temperatures", "0.6", "1.0",
            "--max-new-tokens", "64"]


def shadow_trees_run(trees: list[str], temperatures: tuple[str, ...] = ("0.6", "1.0")) -> list[str]:
    """Trees compared with the shadow verifiers on the same prompts as the shadow run (each tree drives its own
    trajectory with specinfer; the verifiers are compared on that tree's steps)."""
    return ["--methods", *[f"specinfer@{t}" for t in trees], "--shadow", *SHADOWS, "--shadow-seeds", "2",
            "--drafts", "int8", "--datasets", "spec-bench:summarization,qa,translation", "--limit", "10",
            "--temperatures", *temperatures, "--max-new-tokens", "64"]


def llama_run(target: str, greedy: bool = False) -> list[str]:
    """The llama.cpp backend: verispec's loop on llama.cpp's own logits, against llama.cpp's decoding (``greedy``:
    plain decoding and the default only, at T = 0)."""
    methods = ["llama-cpp", "ar", "default"] if greedy else ["llama-cpp", "llama-cpp-lookup", "ar", "default",
                                                            "auto-gate"]
    return ["--target", target, "--backend", "llama", "--methods", *methods, "--drafts", "ngram",
            *(spec_bench("0") if greedy else spec_bench())]


def gate_run() -> list[str]:
    """The auto policy's confidence gate against the per-depth plan alone, with the prompt-lookup draft."""
    return ["--methods", "ar", "default", "auto-gate", "--drafts", "ngram", *spec_bench()]


def gate_names(res: Results) -> str:
    """Which rows ran the confidence gate: the runs made at commit 3c3d5c0 had it in ``default`` and called the
    plan alone ``auto-depth``; since then the gate is opt-in (``auto-gate``) and ``default`` is the plan alone."""
    if "auto-depth" in res.header["config"]["methods"]:
        return ("In this run (made when the gate was on by default) `default` ran the `auto` policy with the gate and "
                "`auto-depth` without it; measured as no faster, the gate is now opt-in (`auto:gate`, method "
                "`auto-gate`), and today's `default` is the `auto-depth` row.")
    if "auto-gate" not in res.header["config"]["methods"]:
        return "`default` runs the `auto` policy."
    return "`default` runs the `auto` policy (the plan alone), `auto-gate` the same with the confidence gate."


# need the shipped draft head
HEAD_RUNS = {"speed": speed_run, "table2": table2_run, "shadow": shadow_run, "hybrid": hybrid_run,
             # the defaults against plain decoding and Hugging Face generate with the target in bfloat16 (every
             # method on the same rounded weights), where a forward's extra rows cost almost nothing
             "speed_bf16": lambda: ["--methods", "hf-generate", "ar", "default", "--drafts", "auto", "ngram",
                                    *spec_bench(), "--dtype", "bfloat16"]}
RUNS["gate"] = gate_run()


def concurrency_run() -> list[str]:
    """Many requests at once: closed loops of 1, 2, 4 and 8 requests in flight, verispec's batched engine beside the
    servers people run (issue 25)."""
    return ["--methods", "ar", "default", "hf-generate", "hf-continuous", "llama-cpp", "llama-server", "--drafts",
            "auto", *spec_bench(), "--concurrency", "1", "2", "4", "8"]


RUNS["concurrency"] = concurrency_run()


def serving_run() -> list[str]:
    """Servers (issue 26): verispec serve beside transformers serve (both modes), llama-cpp-python's server and
    llama-server, each started per loop and driven by the same client through /v1/chat/completions; `default`
    in-process too, for what the server adds to a request. Greedy only: one temperature fits the time, and at T = 0
    the server and the library must give the same tokens."""
    return ["--methods", "default", "verispec-serve", "transformers-serve", "transformers-serve-cb",
            "llama-cpp-server", "llama-server-chat", "--drafts", "auto", *spec_bench("0"),
            "--concurrency", "1", "4", "8"]


RUNS["serving"] = serving_run()
# the goals at N = 8 against the llama.cpp servers, whose one-at-a-time or slot latencies spread widely: more prompts
RUNS["serving_n8"] = ["--methods", "verispec-serve", "llama-cpp-server", "llama-server-chat", "--drafts", "auto",
                      "--datasets", "spec-bench", "--limit", "8", "--temperatures", "0", "--max-new-tokens", "128",
                      "--concurrency", "8"]
# the same three, with the target in bfloat16 (verispec, Hugging Face and transformers serve alike; llama.cpp runs its
# Q4_1 file either way): the dtype where many rows cost little more than one
RUNS["concurrency_bf16"] = [*concurrency_run(), "--dtype", "bfloat16"]
# after the load-aware plan's group moves (5c3aa6b) and the padding taken at the batch's longest context (fe7953e),
# with the six-epoch head: the same closed loops in two rounds, the methods' order reversed in the second (one slot
# in a run's order was seen to be 20 % slower than the next, whichever method held it, so ratios pair round by round:
# --rounds); Hugging Face's static batches and continuous batching left out to fit a session (measured in the runs
# above, they trailed verispec's loops)
RUNS["concurrency_bf16_rounds"] = ["--methods", "ar", "default", "llama-cpp", "llama-server",
                                   "--drafts", "auto", *spec_bench(), "--concurrency", "1", "2", "4", "8",
                                   "--dtype", "bfloat16", "--rounds", "2"]
# the two goals at N = 8 the run above left out or cannot pair: Hugging Face's static batches of 8, and `default` at
# N = 8 against its own N = 1, with the code and head of the runs after it (two rounds, the order reversed in the
# second, as above)
RUNS["concurrency_bf16_static"] = ["--methods", "ar", "default", "hf-generate", "--drafts", "auto", *spec_bench(),
                                   "--concurrency", "1", "8", "--dtype", "bfloat16", "--rounds", "2"]
# `default` against `ar` at N = 8 alone, after the drafting overhead of a plain step was halved (ff186b9): four rounds
RUNS["concurrency_bf16_n8"] = ["--methods", "ar", "default", "--drafts", "auto", *spec_bench(), "--concurrency", "8",
                               "--dtype", "bfloat16", "--rounds", "4"]
# the closed loops on a second kind of CPU (AVX2 only, no AVX-512: the native bfloat16 kernels do not run there, so
# float32, the default): verispec's loops beside Hugging Face's static batches and transformers' continuous batching
# (its cache now sized from the requests), two rounds, the order reversed in the second
RUNS["concurrency_avx2"] = ["--methods", "ar", "default", "hf-generate", "hf-continuous", "--drafts", "auto",
                            *spec_bench(), "--concurrency", "1", "2", "4", "8", "--rounds", "2"]
# the same closed loops after verispec's float32 linear kernel (backends/native/linear.cpp) became the plan
RUNS["concurrency_native"] = ["--methods", "ar", "default", "hf-generate", "--drafts", "auto", *spec_bench(),
                              "--concurrency", "1", "2", "4", "8", "--rounds", "2"]
RUNS["concurrency_native_attention"] = RUNS["concurrency_native"]  # the same loops after the float32 attention kernel
# after the plan's margin became 5 % (its verification charge did not reach the bench's engine until b5c7e0b), with
# llama.cpp beside it
# (llama-cpp-python one request at a time, and llama-server's slots: the [llama] extra built for this CPU); Hugging
# Face's static batches left out for time (the run above measured them, and their code has not changed)
RUNS["concurrency_verified"] = ["--methods", "ar", "default", "llama-cpp", "llama-server", "--drafts", "auto",
                                *spec_bench(), "--concurrency", "1", "2", "4", "8", "--rounds", "2"]
# the same with each drafting sequence charged its verification (b5c7e0b), a greedy target's residual read off its
# point mass (08bf4c5) and a prompt's prefill attending causally without a mask, and Hugging Face's static batches
RUNS["concurrency_charged"] = ["--methods", "ar", "default", "hf-generate", "llama-cpp", "llama-server", "--drafts",
                               "auto", *spec_bench(), "--concurrency", "1", "2", "4", "8", "--rounds", "2"]
# the same after the default model's layers stream from their GGUF blocks (afa4323: a one-row forward 1.67x cheaper,
# eight rows 1.06x) and the head was re-tuned for it (503f26a); one round, llama-server the one peer (for time)
RUNS["concurrency_blocks"] = ["--methods", "ar", "default", "llama-server", "--drafts", "auto", *spec_bench(),
                              "--concurrency", "1", "2", "4", "8"]
# `default` against `ar` alone at every N, three rounds in alternating order (the one round above ran `ar` first in
# every cell, and a process's later loops ran slower: its N = 8 cell is that drift more than `default`'s)
RUNS["concurrency_rounds"] = ["--methods", "ar", "default", "--drafts", "auto", *spec_bench(),
                              "--concurrency", "1", "2", "4", "8", "--rounds", "3"]
# the same after the kernel and head changes of da2fdcd (block passes, the head's output layer from its Q8_0 blocks,
# the rotary kernel), on the same machine
RUNS["concurrency_rounds2"] = RUNS["concurrency_rounds"]
# the same machine after the linear kernel's 512-bit build (f1afceb), beside every peer but transformers' continuous
# batching (for time: measured in the AVX2 runs, its code unchanged), two rounds in alternating order
RUNS["concurrency_avx512"] = ["--methods", "ar", "default", "hf-generate", "llama-cpp", "llama-server", "--drafts",
                              "auto", *spec_bench(), "--concurrency", "1", "2", "4", "8", "--rounds", "2"]
# `default` against `ar` alone at the same code in three rounds (the two rounds of the run above left one cell below
# 1.0 that loop_split.py did not repeat)
RUNS["concurrency_rounds3"] = RUNS["concurrency_rounds"]
# the same three rounds after the lean forward's fewer calls (fbafde5, c1f8867: the same logits bit for bit)
RUNS["concurrency_calls"] = RUNS["concurrency_rounds"]
# the same after the decoder layers ran in one native call (5ed62f4)
RUNS["concurrency_layers"] = RUNS["concurrency_rounds"]
# the same after the lean forward's own RMS norm (5d18cb3)
RUNS["concurrency_norm"] = RUNS["concurrency_rounds"]
# the same after prompt lookup's drafts read its n-gram index (3e14ce8: the same laws)
RUNS["concurrency_lookup"] = RUNS["concurrency_rounds"]
# the same after each round of a closed loop drew with its own seed (6981dbd)
RUNS["concurrency_seeds"] = RUNS["concurrency_rounds"]
# the same after a float32 prompt's rows went to the linear kernel measured faster for many rows (5bcdbab)
RUNS["concurrency_prompt"] = RUNS["concurrency_rounds"]
# the same three rounds on an AMD EPYC with AVX-512 after drafts from a short list grew on that list (eff56d6)
RUNS["concurrency_sparse"] = RUNS["concurrency_rounds"]
# the same three rounds on an Intel Xeon (AVX-512 with FP16) at 4849a48 (issue 66: under load on every CPU measured)
RUNS["concurrency_xeon"] = RUNS["concurrency_rounds"]
# the same three rounds on an AMD EPYC with AVX-512 after a batch's head depth went into one native call (fd956aa)
RUNS["concurrency_fused"] = RUNS["concurrency_rounds"]
# the peers at N = 1 and 8 on the machine of concurrency_prompt (an Intel Xeon), one round to fit a session
RUNS["concurrency_peers_xeon"] = ["--methods", "ar", "default", "hf-generate", "llama-cpp", "llama-server", "--drafts",
                                  "auto", *spec_bench(), "--concurrency", "1", "8"]
# the peers at N = 1 and 8 in three rounds, the methods' order reversed every other round (issue 67)
RUNS["concurrency_peers_rounds"] = [*RUNS["concurrency_peers_xeon"], "--rounds", "3"]
RUNS["serving_n8_bf16"] = [*RUNS["serving_n8"], "--dtype", "bfloat16"]
RUNS["serving_bf16"] = [*serving_run(), "--dtype", "bfloat16"]
# ResiSpec Table 3 shape (a cell costs ~30 s here): one run per temperature and tree group, two at a time share the
# two cores
TOPOLOGY_RUNS = {"topologies": (ISO_TREES[:3], "1.0"), "topologies_chains": (ISO_TREES[3:], "1.0"),
                 "topologies_t06": (ISO_TREES[:2], "0.6"), "topologies_chains_t06": (ISO_TREES[2:], "0.6")}
RUNS.update({name: shadow_trees_run(trees, (t,)) for name, (trees, t) in TOPOLOGY_RUNS.items()})
RUNS["width"] = shadow_trees_run([t for t in WIDTH_TREES if t != SHADOW_TREE])  # Table 5 shape, with the shadow run
LLAMA_RUNS = {"llama_smollm2": lambda: llama_run("smollm2-135m"),  # need llama-cpp-python (bash scripts/install_llama.sh)
              "llama_gemma3": lambda: llama_run("gemma3-270m"),
              # greedy only, after the greedy steps lost their vocabulary-sized detours (argmax, one-hot rows, draws)
              "llama_gemma3_greedy": lambda: llama_run("gemma3-270m", greedy=True),
              "llama_smollm2_greedy": lambda: llama_run("smollm2-135m", greedy=True)}

ENV = {"kernel_stock": {"VERISPEC_STOCK_LINEAR": "1"}}  # the stock linear kernel (verispec.backends.kernels)


def path(name: str) -> Path:
    """Run NAME's records: results/NAME.jsonl while a run writes them, results/NAME.jsonl.gz as they are kept (about
    8x smaller: the records of every run together stay well under what a device machine's call carries)."""
    plain = ROOT / "results" / f"{name}.jsonl"
    return plain if plain.exists() else packed(plain)


def packed(plain: Path) -> Path:
    return plain.with_name(plain.name + ".gz")


def pack(plain: Path) -> None:
    """Gzip a finished run's records beside it (no name or time inside: the same records, the same bytes), then
    remove the plain file."""
    tmp = packed(plain).with_name(packed(plain).name + ".tmp")
    with open(plain, "rb") as src, open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", filename="",
                                                                          mtime=0) as dst:
        shutil.copyfileobj(src, dst)
    os.replace(tmp, packed(plain))
    plain.unlink()


def run(name: str, fresh: bool = False) -> None:
    """One run into results/NAME.jsonl, packed into NAME.jsonl.gz when it is done: continued where it stopped (the
    kept records unpacked first), or measured anew with ``fresh`` (the old records are replaced as the run starts,
    after its header names the clean revision it runs at)."""
    runs = {**HEAD_RUNS, **LLAMA_RUNS}
    plain = ROOT / "results" / f"{name}.jsonl"
    if not plain.exists() and packed(plain).exists() and not fresh:
        with gzip.open(packed(plain), "rb") as src, open(plain, "wb") as dst:
            shutil.copyfileobj(src, dst)
    argv = ["bench", *(runs[name]() if name in runs else RUNS[name]), "--out",
            str(plain.relative_to(ROOT)), "--overwrite" if fresh else "--resume"]
    if not plain.exists() and not fresh:
        argv.remove("--resume")
    saved = dict(os.environ)
    os.environ.update(ENV.get(name, {}))
    try:
        if cli.main(argv) != 0:
            raise SystemExit(f"run {name} failed")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    pack(plain)


def provenance(path: Path, command: str, data: dict | None = None) -> str:
    """Where a JSON report came from: the command that makes it, and the revision it was measured at -- recorded in
    the report itself by newer commands, else the commit that last changed the file (measured at or before it)."""
    if data and data.get("git"):
        machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
        where = ", ".join(str(x) for x in (machine.get("cpu"), data.get("started") or data.get("date")) if x)
        return f"`{data.get('command') or command}` at git {data['git']}" + (f" ({where})" if where else "")
    rel = str(path.relative_to(ROOT))
    rev = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%H", "--", rel], capture_output=True,
                         text=True).stdout.strip()
    return f"`{command}`; the revision it was measured at was not recorded ({rel} committed at {rev or 'no commit'})"


def run_lines(res: Results) -> list[str]:
    """A run's command, machine and revision, then the cells it left out."""
    return [f"Run: {res.describe()}", "", left_out(res)]


def left_out(res: Results) -> str:
    """The run's cells left out by design, in one sentence (or that none were)."""
    notes = res.header.get("notes")
    if notes is None:
        notes = static_notes(BenchConfig.from_dict(res.header.get("config", {})))
    return "Left out: " + "; ".join(notes) + "." if notes else "No cell of this run was left out."


def fig(p: Path | None) -> str:
    return f"![{p.stem}](figures/{p.name})" if p else "(no data)"


def by_category_table(rows, metrics=(("vs_hf_generate", "vs HF generate"), ("speedup_ar", "vs ar"))) -> str:
    """Per temperature, category, draft and method: the speed ratios with their 95 % intervals (paired per prompt)."""
    from verispec.bench.report import markdown

    body = [[f"{r.T:g}", r.category, r.draft, r.method, *[r.show(m, ".2f", "x") for m, _ in metrics],
             r.show("mean_accepted_length")]
            for r in rows if r.category != "all" and r.method not in ("ar", "hf-generate")]
    return markdown(["T", "category", "draft", "method", *[h for _, h in metrics], "accepted length"], body)


def step_time_table(res: Results) -> list[str]:
    """Where a decoding step's time goes, from the step records of ``ar`` and ``default``: per temperature, draft
    and the source that drafted the step (the hybrid's head or lookup), the target's forward, the drafting and the
    verification, and the milliseconds per emitted token against plain decoding's."""
    from verispec.bench.report import markdown

    groups: dict[tuple, list[dict]] = {}
    cell_steps: dict[tuple, int] = {}  # (T, method, draft) -> its steps, every source
    for steps in res.steps.values():
        c = steps[0]["cell"]
        if c["method"] not in ("ar", "default"):
            continue
        cell = (c["T"], c["method"], c["draft"])
        cell_steps[cell] = cell_steps.get(cell, 0) + len(steps)
        for s in steps:
            groups.setdefault((*cell, s.get("source") or ("-" if c["method"] == "ar" else c["draft"])), []).append(s)
        if c["draft"] == "auto":
            groups.setdefault((*cell, "all"), []).extend(steps)
    if not groups:
        return []

    def ms(steps: list[dict], key: str) -> float:
        return 1000 * sum(s[key] for s in steps) / len(steps)

    def per_token(steps: list[dict]) -> float:
        return 1000 * sum(s["target_s"] + s["draft_s"] + s["verify_s"] for s in steps) / sum(
            s["accepted_length"] for s in steps)

    plain = {t: per_token(v) for (t, m, _, _), v in groups.items() if m == "ar"}
    body = []
    for (t, m, d, source), steps in sorted(groups.items(),
                                           key=lambda kv: (kv[0][0], kv[0][1] != "ar", kv[0][2], kv[0][3] == "all",
                                                           kv[0][3])):
        n = len(steps)
        body.append([f"{t:g}", m, d, source, f"{n / cell_steps[t, m, d]:.2f}",
                     f"{sum(s['drafted'] for s in steps) / n:.2f}", f"{sum(s['accepted_length'] for s in steps) / n:.2f}",
                     f"{ms(steps, 'target_s'):.1f}", f"{ms(steps, 'draft_s'):.1f}", f"{ms(steps, 'verify_s'):.1f}",
                     f"{per_token(steps):.1f}", f"{plain[t] / per_token(steps):.2f}x" if t in plain else "-"])
    return ["Where a step's time goes (from the same run's step records; the loop's own bookkeeping between steps "
            "is not in them): the steps of `default` by the source that drafted them (`auto`: the head, `eagle`, or "
            "prompt lookup, `ngram`, as the hybrid chose), their share of the steps, the tokens drafted and emitted "
            "per step, the mean milliseconds of the target's forward (its rows grow with the draft), of drafting "
            "and of verifying, and the milliseconds per emitted token, against plain decoding's in the last column.",
            "", markdown(["T", "method", "draft", "source", "share of steps", "drafted", "tokens per step",
                          "target ms", "draft ms", "verify ms", "ms per token", "vs ar"], body), ""]


def speed_section(res: Results, figs: Path, heading: str = "", lead: tuple[str, ...] = (), tag: str = "") -> list[str]:
    """The speed run's section: ``heading`` replaces its title, ``lead`` paragraphs go after the run's lines, ``tag``
    ends its figures' file names."""
    rows = summarize(res)
    cats = summarize(res, by_category=True)
    title, name = _in_dtype(res)
    name += tag
    llama = any(r["cell"]["method"] == "llama-cpp" for r in res.prompts)  # it ran (not left out)
    dtype = [] if not title else [
        f"Every method here runs the target in {_dtype(res)}, Hugging Face's `generate` too (the same rounded "
        "weights, and verispec's prepacked linear layers for both); the step costs of the `auto` policy are this "
        "target's own measured forwards (docs/design.md). Hugging Face assisted generation and llama.cpp were left "
        "out: this run is the comparison in this dtype, the float32 run above has the peers.", ""]
    return [speed_title(res, heading), "", *run_lines(res), "", *([res.llama_build(), ""] if llama else []), *dtype,
            *[x for paragraph in lead for x in (paragraph, "")],
            "`default` is what `verispec generate` does with no options (draft `auto`; exact chain verification; the "
            "draft length chosen per step by the `auto` policy), here also with the prompt-lookup draft `ngram`. "
            "`auto` is `hybrid`: prompt lookup on steps where the text repeats itself, the shipped head elsewhere "
            "(`chain:5`, the `auto` policy per source). `ar` is plain decoding in verispec's loop, `hf-generate` "
            "Hugging Face `generate`, `hf-assisted` Hugging Face assisted generation with prompt lookup, all on one "
            "model object (verispec's loop runs it with its lean forward, `verispec.backends.lean`, Hugging Face's "
            "methods with the `transformers` forward; both with verispec's linear kernels), "
            "`llama-cpp` llama.cpp's plain decoding of the same model's GGUF file (Q4_1: a quantised model, so a different and cheaper "
            "target; shown for scale). Every ratio is paired per prompt with its 95 % interval.", "",
            table_peers(rows), "", "By Spec-Bench category:", "", by_category_table(cats), "",
            fig(categories(res, figs / f"speed_by_category{name}.png")), "",
            fig(latency(res, figs / f"speed_latency{name}.png", rows)),
            "", *step_time_table(res)]


def speed_title(res: Results, heading: str = "") -> str:
    """A speed run's section title: ``heading``, or one naming its peers and its target's dtype."""
    peers = "Hugging Face and llama.cpp" if "llama-cpp" in res.header["config"]["methods"] else "Hugging Face"
    return heading or f"## Speed of the defaults against plain decoding, {peers}{_in_dtype(res)[0]}"


BF16 = "bfloat16"


def _dtype(res: Results) -> str:
    return res.header["config"].get("dtype", "float32")


def _in_dtype(res: Results) -> tuple[str, str]:
    """A section title's tail and a figure name's for a run's dtype (nothing for float32, the default)."""
    return ("", "") if _dtype(res) == "float32" else (f", target in {_dtype(res)}", f"_{_dtype(res)}")


def concurrency_section(res: Results, figs: Path, heading: str = "", lead: tuple[str, ...] = (),
                        tag: str = "", explain: bool = True) -> list[str]:
    """Many requests at once (issue 25): the closed loops' table, the plot, and whether each request's greedy text
    depends on its batch. ``heading`` replaces the section's title, ``lead`` paragraphs go before the table, ``tag``
    ends the plot's file name; without ``explain``, the methods and columns are those of the latest run's section
    (``LATEST_LOOPS``), said there once."""
    from verispec.bench.plots import throughput
    from verispec.bench.report import loop_summary, table_loops

    rows = loop_summary(res)
    rounds = max((r.rounds for r in rows), default=1)
    same = []
    for method in dict.fromkeys(r.method for r in rows if r.method in ("ar", "default")):
        alone = {r["cell"]["prompt"]: r["token_ids"] for r in res.prompts
                 if r["cell"]["method"] == method and r["cell"]["T"] == 0 and r["cell"]["concurrency"] == 1}
        for n in sorted({r.concurrency for r in rows if r.concurrency > 1} if alone else ()):
            mine = [r for r in res.prompts if r["cell"]["method"] == method and r["cell"]["T"] == 0
                    and r["cell"]["concurrency"] == n]
            differ = [r["cell"]["prompt"] for r in mine if r["token_ids"] != alone.get(r["cell"]["prompt"])]
            same.append(f"`{method}` at N = {n}: {len(mine) - len(differ)} of {len(mine)} identical"
                        + (f" (differ: {', '.join(differ)})" if differ else ""))
    title, name = _in_dtype(res)
    name += tag
    llama = any(m.startswith("llama") for m in res.header["config"]["methods"])
    return [f"## {heading or 'Many requests at once: closed loops of concurrent requests' + title}", "",
            *run_lines(res), "", *([res.llama_build(), ""] if llama else []), *[x for p in lead for x in (p, "")],
            *([] if explain else [
                "Methods, columns and intervals as in the latest run's section (\"" + LATEST_LOOPS[0][2] + "\"), but "
                "here each interval" + (" draws rounds too, so the spread between rounds is in it." if rounds > 1
                                        else " holds the prompts' spread only: machine noise between runs is not in "
                                             "it."), ""]),
            *([] if not explain else [
            "Every Spec-Bench prompt of the run is a request of a closed loop that keeps N in flight (a new one starts "
            "as one finishes). `ar` and `default` run through verispec's batched engine (`verispec/engine.py`): every "
            "running request's tree in one target forward, each request verified on its own; `default` chooses the "
            "drafted depths for the whole batch from the measured cost of its forwards (load-aware speculation). "
            "`hf-generate` is Hugging Face `generate` on static left-padded batches of N prompts; `hf-continuous` "
            "transformers' own continuous batching (`generate_batch`, at most N requests scheduled together); "
            "`llama-cpp` llama-cpp-python serving one request at a time; `llama-server` llama.cpp's own server with "
            "N parallel slots over loopback. The llama.cpp rows run the Q4_1 GGUF file: another, quantised target, "
            "shown for scale. tokens/s is all tokens over the loop's wall time; each ratio is of throughputs at the "
            "same N, its 95 % interval from the prompts (a paired bootstrap of Little's law, sum(tokens) / "
            "sum(time in system), scaled to the measured ratio" + (
                "; rounds are drawn too, so the spread between rounds is in it" if rounds > 1 else
                "; machine noise between runs is not in it") + "). TPOT: "
            "time per output token after the first; TTFT: time to the first token from submission, queueing "
            "included.", ""]), table_loops(rows), "",
            *(["Greedy text against the same method's loop of one request at a time (T = 0): " + "; ".join(same) + ".",
               ""] if same else []), *_loop_work(res), *_server_load_note(res), fig(throughput(res, figs / f"throughput{name}.png")), ""]


def dtype_section(runs: list[Results]) -> list[str]:
    """verispec's own loops in float32 and in bfloat16, from two runs of the same command (across runs: a hint of
    the dtype's effect, each figure with its own run's noise)."""
    from verispec.bench.report import loop_summary, markdown

    got = {(_dtype(res), r.method, r.T, r.concurrency): r.throughput
           for res in runs for r in loop_summary(res) if r.method in ("ar", "default", "hf-generate", "llama-server")}
    keys = sorted({k[1:] for k in got if k[0] == "float32"} & {k[1:] for k in got if k[0] == BF16},
                  key=lambda k: (k[1], k[2], k[0]))
    def drift(t: float, n: int) -> float | None:  # llama-server's code is the same in both runs
        a, b = got.get(("float32", "llama-server", t, n)), got.get((BF16, "llama-server", t, n))
        return b / a if a and b else None

    rows = []
    for m, t, n in keys:
        ratio, d = got[(BF16, m, t, n)] / got[("float32", m, t, n)], drift(t, n)
        rows.append([f"{t:g}", str(n), m, f"{got[('float32', m, t, n)]:.1f}", f"{got[(BF16, m, t, n)]:.1f}",
                     f"{ratio:.2f}x", f"{ratio / d:.2f}x" if d and m != "llama-server" else "-"])
    when = {_dtype(res): (res.header.get("git", "?")[:7], res.header.get("started", "?")) for res in runs}
    return ["## float32 against bfloat16 under load", "",
            "The closed loops of \"Many requests at once\" above, run again with `--dtype bfloat16` (the section "
            "below): the weights rounded to bfloat16, linear layers on oneDNN's prepacked weights, attention in "
            "float32 (from a bfloat16 cache with the native kernels, where they build). The two runs were measured "
            f"at different times (float32: git {when['float32'][0]}, {when['float32'][1]}; bfloat16: git "
            f"{when[BF16][0]}, {when[BF16][1]}), so each ratio here is across runs (no interval; the machine's "
            "drift between runs is in it). `llama-server` runs its Q4_1 file in both, with the same code: its "
            "ratio is that drift, and the last column divides each ratio by it (a hint, not a result).", "",
            markdown(["T", "N", "method", "tokens/s, float32", "tokens/s, bfloat16", "bfloat16 / float32",
                      "over llama-server's ratio"], rows), ""]


def serving_section(res: Results, figs: Path) -> list[str]:
    """Servers driven by one client (issue 26): the loop table and plot, and what the server adds to one request."""
    from verispec.bench.plots import throughput
    from verispec.bench.report import loop_summary, table_loops
    from verispec.bench.stats import fmt, ratio_of_sums

    rows = loop_summary(res)
    alone = {r["cell"]["prompt"]: r for r in res.prompts
             if r["cell"]["method"] == "default" and r["cell"]["concurrency"] == 1}
    served = [r for r in res.prompts if r["cell"]["method"] == "verispec-serve" and r["cell"]["concurrency"] == 1
              and r["cell"]["prompt"] in alone]
    overhead = []
    if served:
        same = [r for r in served if r["token_ids"] == alone[r["cell"]["prompt"]]["token_ids"]]
        est = ratio_of_sums([r["latency_s"] for r in same], [alone[r["cell"]["prompt"]]["latency_s"] for r in same])
        overhead = [f"What the server adds to one request (N = 1, T = 0): of {len(served)} prompts, {len(same)} got "
                    "the same tokens from `verispec serve` as from the library's own loop (`default`); over those, "
                    "the time from sending the request to its last token is "
                    f"{fmt(*est, spec='.3f', suffix='x')} the library's time from submission to the last token "
                    "(a ratio of sums, paired per prompt; HTTP, JSON, the client and the server's process included).",
                    ""]
    sources = sorted({r.get("token_source") for r in res.prompts if r.get("token_source")})
    title, name = _in_dtype(res)
    return [f"## Serving: verispec serve beside the servers people run{title}", "", *run_lines(res), "",
            res.llama_build(), "",
            "Each server is started on 127.0.0.1 for its loop and stopped after it; one client sends every server the "
            "same Spec-Bench prompts as chat messages through `POST /v1/chat/completions`, streamed, N in flight, "
            "with sampling pinned (greedy; top-k and min-p off). `verispec-serve` is `verispec serve` with the "
            "default method and N slots; `transformers-serve` and `transformers-serve-cb` are `transformers serve` "
            f"on the same weights in {_dtype(res)}, without and with `--continuous-batching`; `llama-cpp-server` is "
            "llama-cpp-python's server (one request at a time) and `llama-server-chat` llama.cpp's own server with N "
            "slots, both on the Q4_1 GGUF file (another, quantised target, shown for scale). `default` is the "
            "library's batched engine in the benchmark's own process, no HTTP. Tokens are the ids a server returns "
            "where it does (verispec), else its text encoded again with the model's tokenizer (" +
            ", ".join(sources) + " in this run). Ratios and intervals as in the closed loops above.", "",
            table_loops(rows), "", *overhead, fig(throughput(res, figs / f"serving_throughput{name}.png")), ""]


def serving_n8_section(res: Results) -> list[str]:
    """Eight requests in flight with more prompts: the N = 8 goals against the llama.cpp servers, with narrower
    intervals than the serving run's 18 prompts give."""
    from verispec.bench.report import loop_summary, table_loops

    return [f"### Eight requests in flight, more prompts{_in_dtype(res)[0]}", "", *run_lines(res), "",
            "The same client and servers as above at N = 8 only, on 48 Spec-Bench prompts (8 a category): the "
            "llama.cpp servers' latencies spread widely from prompt to prompt, so the 18 prompts above leave wide "
            "intervals there.", "", table_loops(loop_summary(res)), ""]


DRILLS = ROOT / "results" / "serve_drills.json"


def drills_section() -> list[str]:
    """The server under faults and bad input (issue 26): what scripts/serve_drills.py sent and saw."""
    from verispec.bench.report import markdown

    if not DRILLS.exists():
        return []
    rep = json.loads(DRILLS.read_text())
    rows = [[r["drill"], str(r["sent"]), r["expected"], r["seen"], "yes" if r["ok"] else "**no**"]
            for r in rep["drills"]]
    return ["## Serving under faults and bad input", "",
            f"Made by {provenance(DRILLS, 'python scripts/serve_drills.py', rep)}, against "
            f"`{rep['server']}` on the default model and draft; {rep['wall_s']:.0f} s in all. 'Alone' is the same "
            "greedy request sent to the same server with nothing else in flight. A failure inside one request's step "
            "cannot be provoked from outside a real server: tests/test_serve.py tests it (a 500 for that request, the "
            "others finish).", "", markdown(["drill", "requests", "expected", "seen", "as expected"], rows), ""]


def _loop_work(res: Results) -> list[str]:
    """What verispec's loops did: steps, drafted and accepted tokens, and the seconds of target forwards summed over
    requests -- the same work done in more forward time is the machine, not the method."""
    from collections import defaultdict

    from verispec.bench.report import markdown

    work = defaultdict(lambda: [0, 0, 0, 0.0])
    for steps in res.steps.values():
        for st in steps:
            c = st["cell"]
            if c.get("method") in ("ar", "default") and "concurrency" in c:
                w = work[(c["T"], c["concurrency"], c["method"])]
                w[0] += 1
                w[1] += st["drafted"]
                w[2] += st["accepted_length"] - 1
                w[3] += st["target_s"]
    if not work:
        return []
    rows = [[f"{t:g}", str(n), m, str(w[0]), str(w[1]), str(w[2]), f"{w[3]:.1f}", f"{1000 * w[3] / w[0]:.1f}"]
            for (t, n, m), w in sorted(work.items())]
    return ["What verispec's loops did (all requests together; a step's forward time counts once per request in "
            "it):", "", markdown(["T", "N", "method", "request steps", "drafted", "accepted", "forward s",
                                  "ms per request step"], rows), ""]


def _server_load_note(res: Results) -> list[str]:
    """Cells of a peer whose server ran as a child process, measured before the load meter counted a finished
    child's CPU time as the cell's own: their 'busy machine' mark is the server itself."""
    marked = [c for c in res.cells
              if c["cell"]["method"] == "llama-server" and c.get("load", {}).get("own_cores", 1) < 0.1]
    if not marked:
        return []
    others = [c["load"]["others_cores"] for c in marked]
    return ["The `llama-server` rows are marked busy machine because this run's load meter counted the server, a "
            "child process of the benchmark, as other work: in those cells the benchmark process itself used "
            f"{max(c['load']['own_cores'] for c in marked):.3f} cores or less and \"others\" "
            f"{min(others):.2f}" + (f"-{max(others):.2f}" if f"{max(others):.2f}" != f"{min(others):.2f}" else "")
            + " of the 2, which is the server. The meter now counts a finished "
            "child's CPU time as the cell's own.", ""]


def source_table(res: Results) -> str:
    """Per temperature, for the switching draft: how often each source drafted, and what its steps gave."""
    from collections import defaultdict

    from verispec.bench.report import markdown

    by = defaultdict(lambda: [0, 0, 0])  # steps, drafted tokens, accepted length
    total = defaultdict(int)
    for steps in res.steps.values():
        for st in steps:
            cell = st["cell"]
            if cell.get("draft") != "hybrid" or cell.get("method") != "default":
                continue
            acc = by[(cell["T"], st.get("source") or "-")]
            acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + st["drafted"], acc[2] + st["accepted_length"]
            total[cell["T"]] += 1
    body = [[f"{T:g}", src, f"{n / total[T]:.2f}", f"{d / n:.2f}", f"{a / n:.2f}"]
            for (T, src), (n, d, a) in sorted(by.items())]
    return markdown(["T", "source", "share of steps", "drafted / step", "accepted length"], body)


def hybrid_section(res: Results, figs: Path) -> list[str]:
    rows = summarize(res)
    cats = summarize(res, by_category=True)
    return ["## A hybrid draft: prompt lookup where the text repeats itself, the head elsewhere", "",
            *run_lines(res), "",
            "Every row runs `default` (the `auto` policy, exact chain verification) with a different draft: `eagle` "
            "(the shipped head, its tuned `chain:1`), `ngram` (prompt lookup, `chain:5`) and `hybrid` (`chain:5`): "
            "each step drafts by prompt lookup when the context's last 2 or more tokens occurred before, by the "
            "head otherwise (`verispec/drafters/hybrid.py`), and the `auto` policy keeps its acceptance and step "
            "costs per source. Ratios paired per prompt with 95 % intervals.", "",
            table_peers(rows), "", "Which source drafted:", "", source_table(res), "",
            "By Spec-Bench category:", "", by_category_table(cats, (("speedup_ar", "vs ar"),)), "",
            fig(categories(res, figs / "hybrid_by_category.png")), ""]


def gate_section(res: Results) -> list[str]:
    rows = summarize(res)
    cats = summarize(res, by_category=True)
    return ["## The auto policy's confidence gate (prompt-lookup draft)", "", *run_lines(res), "",
            "The gate drafts each further token only while the draft's confidence in it, calibrated online against "
            "acceptance, makes one more depth pay at the measured step costs (`verispec/policies.py`, `AutoDepth`); "
            "without it the `auto` policy plans a depth before each step from per-depth acceptance. "
            + gate_names(res) + " Same draft (`ngram`), same tree (`chain:5`), exact chain verification; ratios "
            "paired per prompt.", "",
            table_peers(rows), "", "By Spec-Bench category:", "", by_category_table(cats, (("speedup_ar", "vs ar"),)),
            ""]


def variants_section(variants: dict, figs: Path) -> list[str]:
    """Head variants trained on the same corpus: held-out agreement per depth at the end, and against data seen."""
    from verispec.bench.plots import _pyplot

    depths = max(len(v["points"][-1]["agreement"]) for v in variants.values() if v["points"])
    lines = ["| variant | feature layers | trained depths | sequences seen | minutes | "
             + " | ".join(f"agree d{k}" for k in range(1, depths + 1)) + " | "
             + " | ".join(f"chain d{k}" for k in range(1, depths + 1)) + " |", "|" + "---|" * (5 + 2 * depths)]
    plt = _pyplot()
    figure, axes = plt.subplots(1, depths, figsize=(4.2 * depths, 3.6), squeeze=False)
    for name, v in variants.items():
        if not v["points"]:
            continue
        last, c = v["points"][-1], v["config"]
        pad = ["-"] * (depths - len(last["agreement"]))
        lines.append(f"| {name} | {c['feature_layers']} | {c['depths']} | {last['sequences_seen']} | "
                     f"{v['elapsed_s'] / 60:.0f} | " + " | ".join([f"{x:.3f}" for x in last["agreement"]] + pad)
                     + " | " + " | ".join([f"{x:.3f}" for x in last["chain"]] + pad) + " |")
        for k, ax in enumerate(axes[0]):
            pts = [(p["sequences_seen"], p["agreement"][k]) for p in v["points"] if len(p["agreement"]) > k]
            ax.plot(*zip(*pts), marker="o", label=f"{name} (layers {c['feature_layers']})")
            ax.set_title(f"held-out agreement, depth {k + 1}")
            ax.set_xlabel("training sequences seen")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    path = figs / "head_variants.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return ["### Head variants on the same corpus", "",
            "Held-out agreement per depth (the head's own features from depth 2 on) of heads trained with "
            "`verispec train-draft` on the same self-written corpus and schedule, differing in the option named; "
            "validation on the held-out corpus round at every checkpoint. The curve is agreement against "
            "sequences seen within one learning-rate schedule, a proxy for a data-size curve. A run stopped before "
            "the end of its schedule shows its last checkpoint (e1: step 200 of 300).", "",
            *lines, "", fig(path), ""]


def curve_section(figs: Path, folder: Path = CURVE, heading: str = "The head against the data it was trained on",
                  text: str | None = None, name: str = "head_curve",
                  reference: tuple[str, Path] = ("EAGLE-1 head", AGREEMENT["EAGLE-1 head (shipped until 2026-12-03)"])
                  ) -> list[str]:
    """Agreement on held-out Spec-Bench questions against the response tokens a head was trained on (one report a
    head, ``folder/*.json``: ``results/head_curve`` by default, with its own ``text``), beside the depth-1 agreement
    of the ``reference`` head (a label and its report)."""
    from verispec.bench.plots import _pyplot

    reports = sorted((json.loads(p.read_text()) for p in folder.glob("*.json")),
                     key=lambda r: r["training"]["response_tokens"])
    if not reports:
        return []
    spec = "spec-bench (held out)"
    depths = max(r["depths"] for r in reports)
    lines = ["| response tokens trained on | sequences | checkpoint (step) | "
             + " | ".join(f"agree d{k}" for k in range(1, depths + 1)) + " | "
             + " | ".join(f"chain d{k}" for k in range(1, depths + 1)) + " | self-written held out, agree d1 |",
             "|" + "---|" * (4 + 2 * depths)]
    for r in reports:
        tr, st = r["training"], r["sets"][spec]
        own = r["sets"].get("self-written (held-out rounds)")
        lines.append(f"| {tr['response_tokens']:,} | {tr['sequences']} | {tr['best_step']} of {tr['steps']} | "
                     + " | ".join(f"{x:.3f}" for x in st["agreement"]) + " | "
                     + " | ".join(f"{x:.3f}" for x in st["chain_acceptance"]) + " | "
                     + (f"{own['agreement'][0]:.3f}" if own else "-") + " |")
    plt = _pyplot()
    curves = [r for r in reports if r["training"].get("curve") and r["training"].get("batch")]
    if curves:  # beside it, each head's held-out curve: what more passes over its data could still give
        figure, (ax, right) = plt.subplots(1, 2, figsize=(11.0, 4.0))
        for r in curves:
            tr = r["training"]
            seen = [c["step"] * tr["batch"] * tr["response_tokens"] / tr["sequences"] for c in tr["curve"]]
            right.plot(seen, [c["val_top1_1"] for c in tr["curve"]], label=f"{tr['response_tokens'] / 1e6:.1f}M")
        right.set_xlabel("response tokens seen in training")
        right.set_ylabel("depth-1 agreement, held-out corpus rounds")
        right.legend(fontsize=8, title="head trained on", title_fontsize=8)
    else:
        figure, ax = plt.subplots(figsize=(6.4, 4.0))
    x = [r["training"]["response_tokens"] for r in reports]
    for k in range(min(depths, 3)):
        ax.plot(x, [r["sets"][spec]["agreement"][k] for r in reports], marker="o", label=f"depth {k + 1}")
    if reference[1].exists():
        ax.axhline(json.loads(reference[1].read_text())["sets"][spec]["agreement"][0], color="grey", linestyle="--",
                   label=f"{reference[0]}, depth 1")
    ax.axhline(0.5, color="grey", linestyle=":", label="goal, depth 1")
    ax.set_xscale("log")
    ax.set_xlabel("response tokens trained on")
    ax.set_ylabel("agreement on held-out Spec-Bench")
    ax.legend(fontsize=8)
    figure.tight_layout()
    path = figs / f"{name}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    made = "; ".join(provenance(folder, "verispec eval-draft --json", r) for r in reports)
    if text is not None:
        return [f"### {heading}", "", f"Made by {made}.", "", text, "", *lines, "", fig(path), ""]
    return [f"### {heading}", "",
            f"Made by {made}.", "",
            "Heads of one recipe trained on the first rounds of one self-written corpus, each the checkpoint best on "
            "the corpus's held-out rounds; agreement per drafted depth on the held-out Spec-Bench answers as in the "
            "table above. The corpus (committed, its text only: data/README.md): `" + CURVE_CORPUS + "`; a head on its "
            "first R rounds: `" + CURVE_TRAIN + "`. The heads above trained on the same command's rounds written "
            "to runs/eagle3-smollm2-135m, which was lost with its checkout; each round is seeded by its number, and "
            "the committed corpus is that command run again from round 0.", "",
            *lines, "", fig(path), ""]


def capacity_section() -> list[str]:
    """Heads differing only in their decoder layers, trained on the same data and schedule and measured on the same
    sequences (``results/head_capacity/*.json``): agreement per depth, and each one's gain over the first (fewest
    layers) with a paired interval over sequences."""
    from verispec.bench.agreement import agreement_difference
    from verispec.bench.stats import fmt

    reports = sorted((json.loads(p.read_text()) for p in CAPACITY.glob("*.json")), key=lambda r: r["decoder_layers"])
    if not reports:
        return []
    spec, own = "spec-bench (held out)", "self-written (held-out rounds)"
    base = reports[0]
    depths = base["depths"]
    n_base = base["decoder_layers"]
    lines = ["| decoder layers | head parameters | train-draft minutes | "
             + " | ".join(f"Spec-Bench agree d{k}" for k in range(1, depths + 1))
             + f" | d1 gain over {n_base} layer{'s' if n_base > 1 else ''} | self-written agree d1 | gain |",
             "|" + "---|" * (6 + depths)]
    for r in reports:
        gains = [fmt(*agreement_difference(r["sets"][s], base["sets"][s]), spec="+.3f") if r is not base else "-"
                 for s in (spec, own)]
        lines.append(f"| {r['decoder_layers']} | {r['head_parameters'] / 1e6:.1f}M | "
                     f"{(r['training'].get('session_s') or float('nan')) / 60:.0f} | "
                     + " | ".join(f"{x:.3f}" for x in r["sets"][spec]["agreement"]) + f" | {gains[0]} | "
                     f"{r['sets'][own]['agreement'][0]:.3f} | {gains[1]} |")
    made = "; ".join(provenance(CAPACITY, "verispec eval-draft --json", r) for r in reports)
    n, m = base["sets"][spec]["sequences"], base["sets"][own]["sequences"]
    return ["### A deeper head", "", f"Made by {made}.", "",
            "Heads of one recipe on the same data (the committed corpus's " + f"{base['training']['response_tokens']:,}"
            " response tokens, one epoch), differing only in their decoder layers: `" + CAPACITY_TRAIN + "`. "
            f"Agreement as above, on {n} held-out Spec-Bench answers and {m} sequences of the corpus's held-out "
            "round; a gain is the agreement difference at depth 1 with a 95 % bootstrap interval over sequences, "
            "both heads measured on the same ones. Both trained at once, one thread each, so the minutes (the whole "
            "train-draft run; the corpus and its features were already there) compare with each other only.",
            "", *lines, ""]


def _rounds_trained(training: dict) -> str:
    """The corpus rounds a head trained with (its eval-draft report's training record): a count, or the range
    ``first-last`` for a head trained on later rounds only (``--first-round``)."""
    n = training.get("rounds")
    first = training.get("first_round") or 0
    if first:
        return f"{first}-{n - 1}"
    return str(n) if n else "32"  # the heads before this record was kept all trained with --rounds 32


def epochs_section() -> list[str]:
    """The one-epoch head of ``capacity_section`` trained one epoch more at a time (``results/head_epochs/eN.json``):
    agreement per depth with paired gains over the epoch before, and where each loses its depth-1 agreement (by the
    target's own top-1 probability, ``scripts/experiments/agreement_by_confidence.py``: ``confidence_N.json``),
    beside the corpus's trigram table."""
    from verispec.bench.agreement import agreement_difference
    from verispec.bench.stats import fmt

    paths = {1: CAPACITY / "L1.json", **{int(p.stem[1:]): p for p in EPOCHS.glob("e[0-9]*.json")}}
    if len(paths) < 2 or not paths[1].exists():
        return []
    reports = {n: json.loads(paths[n].read_text()) for n in sorted(paths)}
    spec, own = "spec-bench (held out)", "self-written (held-out rounds)"
    depths = reports[1]["depths"]
    lines = ["| epochs | rounds | response tokens | train-draft minutes | "
             + " | ".join(f"Spec-Bench agree d{k}" for k in range(1, depths + 1))
             + " | d1 gain over the epoch before | self-written held-out round | agree d1 | gain |",
             "|" + "---|" * (8 + depths)]
    before = None
    for n, r in reports.items():
        gain = fmt(*agreement_difference(r["sets"][spec], before["sets"][spec]), spec="+.3f") if before else "-"
        # the self-written set is the round the head held out: paired only where the heads held out the same one
        # (older reports do not name it; their sequences then tell)
        held = [x["sets"][own].get("rounds") for x in (r, before or {"sets": {own: {}}})]
        try:
            own_gain = "-" if before is None or None not in held and held[0] != held[1] else \
                fmt(*agreement_difference(r["sets"][own], before["sets"][own]), spec="+.3f")
        except ValueError:  # not the same sequences
            own_gain = "-"
        tr = r["training"]
        lines.append(f"| {n} | {_rounds_trained(tr)} | {tr.get('response_tokens') or 0:,} | "
                     + (f"{tr['session_s'] / 60:.0f}" if tr.get("session_s") else "-") + " | "
                     + " | ".join(f"{x:.3f}" for x in r["sets"][spec]["agreement"]) + f" | {gain} | "
                     + (", ".join(str(x) for x in r["sets"][own]["rounds"]) if "rounds" in r["sets"][own]
                        else "not recorded") + " | "
                     f"{r['sets'][own]['agreement'][0]:.3f} | {own_gain} |")
        before = r
    made = "; ".join(provenance(paths[n], "verispec eval-draft --json", r) for n, r in reports.items())
    more = sorted(n for n in reports if n > 1)
    runs = [EPOCHS_BEFORE.get(n, f"runs/cap-L1-e{n - 1}/head.pt") for n in more]
    rounds = [reports[n]["training"].get("rounds") or 32 for n in more]  # --rounds R of each command
    out = ["### Longer training", "", f"Made by {made}.", "",
           "The one-layer head of the table above trained one epoch more at a time, each from the weights of the one "
           "before with a new warm-up and cosine schedule: `" + EPOCHS_TRAIN + "` with "
           + ", ".join(f"E = {n}, R = {k}, BEFORE = {b}" + (f" and `{EPOCHS_FLAGS[n]}`" if n in EPOCHS_FLAGS else "")
                       for n, b, k in zip(more, runs, rounds)) + ". A head "
           "trained over more rounds (the corpus grew) holds out another round of it, and the split of 37 rounds "
           "holds out one that the heads before never trained on. Spec-Bench: the same answers for every head, "
           "paired intervals; the self-written gain is paired only between heads that held out the same round. The "
           "minutes are each run's (its one epoch, features already computed): the first with one thread beside "
           "another training, the later ones with two threads and the machine otherwise idle"
           + "".join(f"; epoch {n}: {reports[n]['training']['note']}" for n in more
                     if reports[n]["training"].get("note")) + ".", "", *lines, ""]
    shipped_p = EPOCHS / "shipped.json"
    if shipped_p.exists():
        shipped, last = json.loads(shipped_p.read_text()), reports[max(reports)]
        ships = shipped_report() == last
        where = ("That head is the one shipped now (`verispec/heads/smollm2-135m.pt`; its tree and step costs "
                 "below)." if ships else f"That head is kept as data/heads/smollm2-135m-eagle3-{max(reports)}epochs.pt "
                 "(not shipped: the default's tree and step costs, `tune-tree`, and the speed run have not been "
                 "measured with it).")
        out += [f"Against the EAGLE-1 head shipped before it on the same answers (made by "
                f"{provenance(shipped_p, 'verispec eval-draft --json', shipped)}): it agrees "
                + " / ".join(f"{x:.3f}" for x in shipped["sets"][spec]["agreement"]) + f" at depths 1-{depths}; the "
                f"{max(reports)}-epoch head gains "
                + ", ".join(fmt(*agreement_difference(last["sets"][spec], shipped["sets"][spec], k), spec="+.3f")
                            for k in range(1, depths + 1))
                + ". " + where, ""]
    conf = {n: json.loads(p.read_text()) for n in reports if (p := EPOCHS / f"confidence_{n}.json").exists()}
    if conf:
        first = next(iter(conf.values()))
        tri = first.get("trigram")
        head = ["the target's top-1 probability", "share of positions", *[f"head, {n} epoch{'s' * (n > 1)}" for n in conf]]
        head += ["trigram table"] if tri else []
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i, b in enumerate(first["bins"]):
            lo, hi = b["target_top1"]
            cells = [f"{lo:.1f}-{hi:.1f}", f"{b['share']:.3f}", *[f"{c['bins'][i]['agreement']:.3f}" for c in conf.values()]]
            cells += [f"{tri['bins'][i]['agreement']:.3f}"] if tri else []
            rows.append("| " + " | ".join(cells) + " |")
        total = ["all", "1.000", *[f"{c['agreement']:.3f}" for c in conf.values()]] + ([f"{tri['agreement']:.3f}"] if tri else [])
        rows.append("| " + " | ".join(total) + " |")
        made = "; ".join(provenance(EPOCHS / f"confidence_{n}.json", c.get("command", "?"), c) for n, c in conf.items())
        out += [f"Where depth-1 agreement is lost, made by {made}: the {first['positions']:,} response positions of "
                "the same Spec-Bench answers by the target's own top-1 probability for the token drafted there (its "
                f"mean: {first['target_top1_mean']:.3f}), and the head's agreement in each bin. The trigram table "
                "reads no features: the commonest token after the two before it in the training rounds (else after "
                "the one before). Where the target is sure (top-1 >= 0.8, "
                f"{first['bins'][-1]['share']:.0%} of the positions), the heads agree at "
                + ", ".join(f"{c['bins'][-1]['agreement']:.3f}" for c in conf.values()) + ".", "",
                *rows, ""]
    return out


def head_section(figs: Path) -> list[str]:
    out = []
    reports = {k: json.loads(p.read_text()) for k, p in AGREEMENT.items() if p.exists()}
    if reports:
        depths = max(r["depths"] for r in reports.values())
        head = ["head", "set", "sequences", *[f"agree d{k}" for k in range(1, depths + 1)],
                *[f"chain d{k}" for k in range(1, depths + 1)]]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for who, rep in reports.items():
            for name, st in rep["sets"].items():
                if name.startswith(" "):
                    continue
                cells = [f"{x:.3f}" for x in st["agreement"]] + ["-"] * (depths - len(st["agreement"]))
                chain = [f"{x:.3f}" for x in st["chain_acceptance"]] + ["-"] * (depths - len(st["chain_acceptance"]))
                lines.append(f"| {who} | {name} | {st['sequences']} | " + " | ".join(cells + chain) + " |")
        made = "; ".join(f"{who}: " + provenance(AGREEMENT[who], AGREEMENT_COMMANDS[who], rep) for who, rep in reports.items())
        out += ["## The draft head: agreement with the target", "", f"Made by {made}.", "",
                "Top-1 agreement of the head with the target per drafted depth, on response tokens only, the head fed "
                "its own predicted features from depth 2 on exactly as in the decoding loop (`verispec eval-draft`). "
                "Spec-Bench: the target's own greedy answers to the last questions of each category (never in any "
                "training set); self-written: the held-out rounds of the training corpus. chain dk: the share of "
                "positions whose depths 1..k all agree (what a greedy chain of k accepts).", "",
                *lines, ""]
        for who, rep in reports.items():
            c = rep.get("in_loop_check")
            if c:
                out += [f"In the decoding loop ({who}, greedy chain of {rep['depths']} on held-out questions) against "
                        "teacher forcing at the very same positions: "
                        + "; ".join(f"depth {k + 1}: {a:.3f} vs {b:.3f} ({n} decisions)"
                                    for k, (a, b, n) in enumerate(zip(c["in_loop"], c["teacher_forced"], c["positions"]))
                                    if n) + f"; decisions that differ: {c['mismatches']}.", ""]
    out += curve_section(figs)
    out += curve_section(figs, CURVE_5M, "The head against five million tokens of its own text", CURVE_5M_TEXT,
                         "head_curve_5m", ("shipped head (6 epochs, rounds 0-52)", EPOCHS / "e6.json"))
    out += capacity_section()
    out += epochs_section()
    if VARIANTS.exists():
        out += variants_section(json.loads(VARIANTS.read_text()), figs)
    if HEAD_INFO.exists():
        info = json.loads(HEAD_INFO.read_text())
        tr = info.get("training", {})
        tokens = f"{tr['corpus_tokens']} tokens, " if "corpus_tokens" in tr else ""
        minutes = tr.get("training_s", tr.get("elapsed_s", float("nan"))) / 60
        took = tr["note"] if tr.get("note") else f"{minutes:.0f} minutes of training on this CPU (its last run)"
        out += [f"Shipped head: `{info.get('command', '?')}`; {tr.get('sequences', '?')} training sequences, "
                f"{tokens}{took}; extra memory {info.get('extra_memory_fraction', float('nan')):.0%} of the "
                f"target's; default tree `{info.get('default_tree', '?')}`.", ""]
    if TUNED.exists():
        tune = json.loads(TUNED.read_text())
        fwd = tune["target_forward_s"]
        out += [f"Step costs measured by {provenance(TUNED, TUNE_COMMAND, tune)} (T = {tune['temperature']:g}): the "
                "target's forward over n tree tokens, and the head's cost per drafted depth.", "",
                "| tokens | " + " | ".join(fwd) + " | head per depth |", "|" + "---|" * (len(fwd) + 2),
                "| ms | " + " | ".join(f"{1000 * v:.1f}" for v in fwd.values())
                + f" | {1000 * tune['draft_s_per_depth']:.1f} |", "",
                f"Per-candidate acceptance of the head's top-k tree on held-out Spec-Bench questions: "
                f"{', '.join(f'{x:.3f}' for x in tune['conditional_acceptance'])} (the head's 1st, 2nd, ... choice among "
                f"a node's children, each given the ones before it were rejected); best tree "
                f"`{tune['best']['tree']}` (predicted {tune['best']['accepted']:.2f} tokens per step, "
                f"{tune['best']['predicted_speedup']:.2f}x over plain decoding)"
                + (f"; best chain `{tune['best_chain']['tree']}` ({tune['best_chain']['accepted']:.2f} tokens, "
                   f"{tune['best_chain']['predicted_speedup']:.2f}x), the shipped tree (the methods that draft the "
                   "tuned tree verify a chain)" if "best_chain" in tune else "") + ".", ""]
        if tune.get("step_costs_from") == "loop":
            costs, parts = tune["step_costs"][1:], tune["step_costs_by_parts"][1:]
            out += [f"A step drafting a chain of 1..{len(costs)} tokens costs {', '.join(f'{c:.2f}' for c in costs)} "
                    "plain steps as the loop pays it (whole steps of `generate` with a fixed chain of each depth: "
                    "what the sidecar keeps and the `auto` policy weighs depths by), against "
                    f"{', '.join(f'{c:.2f}' for c in parts)} from the parts above (design.md, \"Step costs as the "
                    "loop pays them\").", ""]
    return out


SHARE_HEAD = (PROSE["SHARE_HEAD"])


def share_table(*runs: Results) -> str:
    """Per (T, draft, tree): the share of resispec's gain each exact shadow achieves, with its interval."""
    from verispec.bench.report import markdown

    body = []
    for res in runs:
        for name in ("reserve", "ordered", "traversal"):
            for (t, draft, method, _), val in share_of_bias_gain(res, name).items():
                body.append(((t, draft, method.partition("@")[2]), name, val))
    body.sort(key=lambda x: (x[0][0], x[0][1], x[0][2], x[1]))
    return markdown(["T", "draft", "tree", "exact rule", "share of resispec's gain"],
                    [[f"{k[0]:g}", k[1], k[2], name, fmt(*v, ".2f")] for k, name, v in body])


def shadow_section(res: Results) -> list[str]:
    rows = shadow_summary(res)
    cats = [r for r in shadow_summary(res, by_category=True)]
    return ["## Verifiers on the same steps: shadow verification (ResiSpec Table 1 and Figure 1 shapes)", "",
            *run_lines(res), "",
            f"One exact verifier (`specinfer`, tree `{SHADOW_TREE}`, children i.i.d.) drives the text; at every step "
            "each shadow verifier is run on the very same draft and target probabilities with coins of its own "
            "(no extra model forwards). Exact shadows see the states they would visit on their own (every exact "
            "rule emits the target's law), so paired per-step differences measure the difference in acceptance "
            "with far less noise than separate runs (docs/algorithms.md). `resispec` is not exact: its row measures "
            "its acceptance on the target's own states. Intervals: 95 %, over prompts.", "",
            table_shadow(rows), "", "By category:", "", table_shadow(cats), "", SHARE_HEAD, "", share_table(res), ""]


# the rules published since traversal (issue 68) beside the older exact rules, as shadows on the same steps: a chain
# (block verification's ground, and HSD's) and a binary tree, from the int8 draft and the shipped head
RUNS["shadow_rules"] = ["--methods", "chain@chain:4", "specinfer@2x3",
                        "--shadow", "specinfer", "block", "hsd", "traversal", "reserve", "match", "canonical",
                        "--shadow-seeds", "2", "--drafts", "int8", "eagle", "--datasets",
                        "spec-bench:summarization,qa,translation", "--limit", "4", "--temperatures", "0.6", "1.0",
                        "--max-new-tokens", "64"]


def shadow_rules_section(res: Results) -> list[str]:
    return ["### The rules published since traversal, on the same steps", "", *run_lines(res), "",
            PROSE["SHADOW_RULES 0"], "", table_shadow(shadow_summary(res)), ""]


def trees_section(figs: Path) -> list[str]:
    """ResiSpec Table 3 and Table 5 shapes from the shadow runs over trees (the 3 x 3 width point is the shadow
    run's int8 cells: the same prompts, draft and settings)."""
    out = []
    runs = [Results.load(path(name)) for name in TOPOLOGY_RUNS if path(name).exists()]
    if runs:
        rows = [r for res in runs for r in shadow_summary(res)]
        out += ["## Tree topologies at equal verification cost (ResiSpec Table 3 shape)", "",
                "Runs: " + "; ".join(res.describe() for res in runs), "",
                "Every tree has 30 drafted nodes, so every step costs one target forward over 31 positions. "
                "Each tree drives its own text with `specinfer` (children i.i.d.); the other verifiers are shadows "
                "on that tree's steps, so the columns of one row are paired, while rows (trees) are separate runs "
                "on the same 30 prompts. Accepted length with its 95 % interval over prompts; the last columns are "
                "the paired per-step differences from `specinfer`.", "",
                table_trees(rows), "", SHARE_HEAD, "", share_table(*runs), ""]
    if path("width").exists():
        res = Results.load(path("width"))
        rows = shadow_summary(res)
        sources = res.describe()
        if path("shadow").exists():
            shadow = Results.load(path("shadow"))
            rows += [r for r in shadow_summary(shadow) if r.draft in res.header["config"]["drafts"]]
            sources += f"; N = 3 from the shadow run, {shadow.describe()}"
        out += ["## Accepted length as the number of candidates grows (ResiSpec Table 5 shape)", "",
                f"Runs: {sources}", "",
                "Complete trees N x 3 (N i.i.d. candidates at every node, depth 3), each driven by `specinfer` with "
                "the other verifiers as shadows on its steps; eta is the gain in mean accepted length per extra "
                "candidate between successive N (from the means; the intervals are those of the lengths).", "",
                table_trees(rows), "", table_width(rows), "", fig(width(sources, figs / "width.png", rows)), ""]
    return out


def llama_section(res: Results, model: str) -> list[str]:
    rows = summarize(res)
    cats = summarize(res, by_category=True)
    return [f"## The llama.cpp backend: {model}", "", *run_lines(res), "", res.llama_build(), "",
            "verispec's loop on llama.cpp's logits (`--backend llama`; the GGUF model is the target, exactness is "
            "relative to it) against llama.cpp's plain decoding (`llama-cpp`)"
            + (" and llama-cpp-python's prompt-lookup speculative decoding (`llama-cpp-lookup`, its default of 10 "
               "proposed tokens)" if "llama-cpp-lookup" in res.header["config"]["methods"] else "")
            + " of the same file. "
            "The draft is prompt lookup on a chain of 5 under the `auto` policy. " + gate_names(res) + " The per-step split is in the columns draft ms (drafting), "
            "target ms (llama.cpp's decode and the copy of its logits), verify ms (verification, commit and the "
            "rest of the loop).", "",
            table_peers(rows), "", "By Spec-Bench category:", "",
            by_category_table(cats, (("vs_llama_cpp", "vs llama.cpp"), ("speedup_ar", "vs ar"))), ""]


BATCH_COSTS = ROOT / "results" / "llama_batch_costs.json"  # python scripts/experiments/llama_batch_costs.py


def llama_costs_section() -> list[str]:
    """The batch-cost table, and what prompt lookup would give where a forward over a few tokens costs one."""
    from verispec.bench.report import markdown

    if not BATCH_COSTS.exists():
        return []
    costs = json.loads(BATCH_COSTS.read_text())
    sizes = costs["sizes"]
    body = []
    for name, m in costs["models"].items():
        body.append([name, "every row", f"{m['one_token_ms']:.1f}", *[f"{x:.2f}x" for x in m["all_logits"][1:]]])
        body.append([name, "last row only", f"{m['one_token_ms']:.1f}", *[f"{x:.2f}x" for x in m["last_logits"][1:]]])
    out = ["## llama.cpp: what a decode of k tokens costs", "",
           f"{provenance(BATCH_COSTS, 'python scripts/experiments/llama_batch_costs.py', costs)} ({costs['threads']} "
           "threads, one decode of k chained tokens after a "
           "120-token context, median of 9, against one token). Verification needs the logits of every row; "
           "llama.cpp then runs its output layer once per row, which on Gemma 3 (a 262k-token vocabulary) is most "
           "of a token's cost. A decode asking for the last row's logits only (what the issue's first table "
           "measured) is much cheaper and says little about verification.", "",
           markdown(["model", "logits of", "1 token (ms)", *[str(k) for k in sizes[1:]]], body), ""]
    proj = []
    for name in costs["models"]:
        tune = ROOT / "results" / f"tune_llama_{name.split('-')[0]}.json"
        if not tune.exists():
            continue
        t = json.loads(tune.read_text())
        a = t["conditional_acceptance"][0]
        fwd = {int(k): v for k, v in t["target_forward_s"].items()}
        per_depth = t["draft_s_per_depth"] / fwd[1]
        best = max(range(9), key=lambda d: sum(a ** i for i in range(d + 1)) / (1 + d * per_depth))
        tokens = sum(a ** i for i in range(best + 1))
        proj.append([name, f"{a:.2f}", f"{per_depth:.3f}", f"{t['best']['tree']}",
                     f"{t['best']['predicted_speedup']:.2f}x", f"chain:{best}", f"{tokens / (1 + best * per_depth):.2f}x"])
    if proj:
        made = "; ".join(provenance(ROOT / "results" / f"tune_llama_{n.split('-')[0]}.json",
                                    f"verispec tune-tree --backend llama --target {n} --draft ngram --children topk "
                                    f"--prompts 6 --out results/tune_llama_{n.split('-')[0]}.json",
                                    json.loads((ROOT / "results" / f"tune_llama_{n.split('-')[0]}.json").read_text()))
                         for n in costs["models"] if (ROOT / "results" / f"tune_llama_{n.split('-')[0]}.json").exists())
        out += [f"From {made}: the draft's first-candidate acceptance `a` on held-out "
                "Spec-Bench questions (greedy), its cost per drafted depth relative to one target token, the tree "
                "the tuner picks at the measured costs and its predicted speedup over plain decoding; then the "
                "projection for a target whose decode is bound by memory bandwidth, where a forward over up to 16 "
                "tokens costs about one token: a chain of d drafted tokens yields `1 + a + ... + a^d` tokens "
                "(acceptance taken as independent of depth, as the tuner does) for `1 + d x draft cost`, maximised "
                "over d <= 8. A projection, not a measurement.", "",
                markdown(["model", "a", "draft cost / depth", "tuned tree", "predicted here", "bandwidth-bound chain",
                          "projected speedup"], proj), ""]
    return out


EARLIER_LOOPS = (  # closed-loop runs after the first two, oldest first: (run, plot tag, heading, lead)
    ("concurrency_bf16_rounds", "_rounds",
     "Many requests at once, target in bfloat16: the plan's group moves and measured costs, in two rounds",
     (PROSE["EARLIER_LOOPS 0 3 0"],)),
    ("concurrency_bf16_static", "_static",
     "Many requests at once, target in bfloat16: Hugging Face's static batches at N = 8, in two rounds",
     (PROSE["EARLIER_LOOPS 1 3 0"],)),
    ("concurrency_bf16_n8", "_n8",
     "Many requests at once, target in bfloat16: `default` against `ar` at N = 8, in four rounds",
     (PROSE["EARLIER_LOOPS 2 3 0"],)),
    ("concurrency_avx2", "_avx2",
     "Many requests at once on an AVX2 CPU (float32): every N, with transformers' continuous batching",
     (PROSE["EARLIER_LOOPS 3 3 0"],)),
    ("concurrency_native", "_native",
     "Many requests at once on an AVX2 CPU (float32), with verispec's own linear kernel",
     (PROSE["EARLIER_LOOPS 4 3 0"],)),
    ("concurrency_native_attention", "_native_attention",
     "Many requests at once on an AVX2 CPU (float32), with verispec's own attention kernel too",
     (PROSE["EARLIER_LOOPS 5 3 0"],
      PROSE["EARLIER_LOOPS 5 3 1"])),
    ("concurrency_verified", "_verified",
     "Many requests at once on an AVX2 CPU (float32), a 5 % margin, beside llama.cpp",
     (PROSE["EARLIER_LOOPS 6 3 0"],
      PROSE["EARLIER_LOOPS 6 3 1"])),
    ("concurrency_charged", "_charged",
    "Many requests at once on an AVX2 CPU (float32), verification charged, beside llama.cpp and static batches",
    (PROSE["EARLIER_LOOPS 7 3 0"],
     PROSE["EARLIER_LOOPS 7 3 1"])),
    ("concurrency_blocks", "_blocks",
    "Many requests at once on an AVX2 CPU (float32), the default model's layers from their GGUF blocks",
    (PROSE["EARLIER_LOOPS 8 3 0"],
     PROSE["EARLIER_LOOPS 8 3 1"])),
    ("concurrency_rounds", "_rounds3",
    "Many requests at once on an AVX-512 CPU (float32): `default` against `ar` in three rounds",
    (PROSE["EARLIER_LOOPS 9 3 0"],
     PROSE["EARLIER_LOOPS 9 3 1"])),
    ("concurrency_rounds2", "_rounds3b",
    "Many requests at once on an AVX-512 CPU (float32): `default` against `ar` in three rounds, after the kernel "
    "and head changes",
    (PROSE["EARLIER_LOOPS 10 3 0"],
     PROSE["EARLIER_LOOPS 10 3 1"])),
    ("concurrency_rounds3", "_rounds3c",
     "Many requests at once on an AVX-512 CPU (float32), the 512-bit linear kernel: `default` against `ar` in three "
     "rounds",
     (PROSE["EARLIER_LOOPS 11 3 0"],
      PROSE["EARLIER_LOOPS 11 3 1"])),
    ("concurrency_calls", "_calls",
     "Many requests at once on an AVX-512 CPU (float32), after the forward's fewer calls: `default` against `ar` in "
     "three rounds",
     (PROSE["EARLIER_LOOPS 12 3 0"],
      PROSE["EARLIER_LOOPS 12 3 1"],)),
    ("concurrency_layers", "_layers",
     "Many requests at once on an AVX-512 CPU (float32), after the decoder layers in one call: `default` against "
     "`ar` in three rounds",
     (PROSE["EARLIER_LOOPS 13 3 0"],
      PROSE["EARLIER_LOOPS 13 3 1"],)),
    ("concurrency_norm", "_norm",
     "Many requests at once on an AVX-512 CPU (float32), after the lean forward's own norm: `default` against `ar` in "
     "three rounds",
     (PROSE["EARLIER_LOOPS 14 3 0"],
      PROSE["EARLIER_LOOPS 14 3 1"],)),
    ("concurrency_lookup", "_lookup",
     "Many requests at once on an AVX-512 CPU (float32), prompt lookup from its n-gram index: `default` against `ar` "
     "in three rounds",
     (PROSE["EARLIER_LOOPS 15 3 0"],
      PROSE["EARLIER_LOOPS 15 3 1"],)),
    ("concurrency_seeds", "_seeds",
     "Many requests at once on an AVX-512 CPU (float32), a seed a round: `default` against `ar` in three rounds",
     (PROSE["EARLIER_LOOPS 16 3 0"],
      PROSE["EARLIER_LOOPS 16 3 1"],)),
)


# the newest closed loops (issue 25), shown first, the first one explaining methods and columns: (run, plot tag,
# heading, lead) each
LATEST_LOOPS = ((
    "concurrency_avx512", "_avx512",
    "Many requests at once on an AVX-512 CPU (float32), the 512-bit linear kernel, beside every peer",
    (PROSE["LATEST_LOOPS 0 3 0"],
     PROSE["LATEST_LOOPS 0 3 1"])), (
    "concurrency_peers_xeon", "_peers_xeon",
    "Many requests at once on an Intel Xeon (float32), a prompt's rows on the kernel measured faster for them, beside "
    "every peer at N = 1 and 8",
    (PROSE["LATEST_LOOPS 1 3 0"],
     PROSE["LATEST_LOOPS 1 3 1"])), (
    "concurrency_prompt", "_prompt",
    "Many requests at once on an AVX-512 CPU (float32), a prompt's rows on the kernel measured faster for them: "
    "`default` against `ar` in three rounds",
    (PROSE["LATEST_LOOPS 2 3 0"],
     PROSE["LATEST_LOOPS 2 3 1"])), (
    "concurrency_peers_rounds", "_peers_rounds",
    "Many requests at once on an AVX-512 EPYC (float32), beside every peer at N = 1 and 8 in three rounds",
    (PROSE["LATEST_LOOPS 3 3 0"],)), (
    "concurrency_sparse", "_sparse",
    "Many requests at once on an AVX-512 EPYC (float32), drafts from a short list grown on that list: `default` "
    "against `ar` in three rounds",
    (PROSE["LATEST_LOOPS 4 3 0"],)), (
    "concurrency_xeon", "_xeon",
    "Many requests at once on an Intel Xeon (float32): `default` against `ar` in three rounds",
    (PROSE["LATEST_LOOPS 5 3 0"],)), (
    "concurrency_fused", "_fused",
    "Many requests at once on an AVX-512 EPYC (float32), a batch's head depth in one native call: `default` against "
    "`ar` in three rounds",
    (PROSE["LATEST_LOOPS 6 3 0"],)))


def earlier_loops(figs: Path) -> list[str]:
    """The closed-loop runs before the latest, oldest first, each read as the latest one's section says."""
    out = []
    if path("concurrency").exists():
        out += concurrency_section(Results.load(path("concurrency")), figs, explain=False)
    if path("concurrency_bf16").exists():
        out += dtype_section([Results.load(path(n)) for n in ("concurrency", "concurrency_bf16")])
        out += concurrency_section(Results.load(path("concurrency_bf16")), figs, explain=False)
    for run_name, tag, heading, lead in EARLIER_LOOPS:
        if path(run_name).exists():
            out += concurrency_section(Results.load(path(run_name)), figs, heading, lead, tag=tag, explain=False)
    return out


def link(heading: str) -> str:
    """A markdown link to a section of this page by its heading, with the fragment GitHub gives it (lower case,
    punctuation dropped, spaces as hyphens)."""
    text = heading.lstrip("#").strip()
    return f"[{text}](#" + "".join(c for c in text.lower() if c.isalnum() or c in " -_").replace(" ", "-") + ")"


def _short(res: Results) -> str:
    """A run's revision and CPU, for a line naming where a figure comes from."""
    return f"git {res.header.get('git', '?')[:7]}, {res.header.get('machine', {}).get('cpu', '?')}"


def latest_speed(temperature: float) -> tuple[Results, str] | None:
    """The latest float32 speed run (``SPEED_RUNS``) with cells at ``temperature``, and its section's title."""
    for run_name, _, heading, _ in reversed(SPEED_RUNS):
        if path(run_name).exists():
            res = Results.load(path(run_name))
            if _dtype(res) == "float32" and any(r["cell"]["T"] == temperature for r in res.prompts):
                return res, speed_title(res, heading)
    return None


def _latest_loops(with_peer: str | None) -> tuple[Results, str] | None:
    """The latest closed-loop run (``LATEST_LOOPS``, then ``EARLIER_LOOPS``), one with ``with_peer`` among its methods
    if given, and its section's title."""
    for run_name, _, heading, _ in (*reversed(LATEST_LOOPS), *reversed(EARLIER_LOOPS)):
        if path(run_name).exists():
            res = Results.load(path(run_name))
            if with_peer is None or with_peer in res.header["config"]["methods"]:
                return res, "## " + heading
    return None


def standing_section() -> list[str]:
    """Where the project stands: the latest measurement of each question this page answers, read from the records
    of the sections it names (never typed in)."""
    from verispec.bench.report import loop_summary, markdown, paired_ratio, usable

    out = ["## Where it stands", "",
           "The latest measurement of each question below, read from the records of the section named under each "
           "table (its command, machine and revision are there). Every ratio is paired, per prompt or per closed "
           "loop and round, with its 95 % interval.", ""]
    runs = {t: latest_speed(t) for t in (0.0, 0.6)}
    if all(runs.values()):
        def default(res: Results, t: float, **kw):
            return next(r for r in summarize(res, **kw) if r.T == t and r.method == "default" and r.draft == "auto"
                        and (kw or r.category == "all"))

        def share(res: Results, t: float, decoding: bool = False, base: tuple = ("ar", NO_DRAFT)) -> str:
            """`default`'s tokens/s over ``base``'s (method, draft) at ``t``, paired per prompt."""
            kept, _ = usable(res)
            cells = ([r for r in kept if r["cell"]["T"] == t and (r["cell"]["method"], r["cell"]["draft"]) == md]
                     for md in (("default", "auto"), base))
            return fmt(*paired_ratio(*cells, decoding), suffix="x")

        def lookup_share(res: Results, t: float) -> str:  # the head's share: against prompt lookup alone
            return share(res, t, base=("default", "ngram"))

        def lowest(res: Results, t: float) -> str:
            cats = [r for r in summarize(res, by_category=True) if r.T == t and r.method == "default"
                    and r.draft == "auto" and r.category != "all"]
            r = min(cats, key=lambda r: r.value("vs_hf_generate"))
            return f"{r.category}: {r.show('vs_hf_generate', '.2f', 'x')}"

        against = (("plain decoding in verispec's loop (`ar`): speculation's own share", "speedup_ar"),
                   ("Hugging Face `generate`", "vs_hf_generate"),
                   ("Hugging Face assisted generation with its best draft", "vs_best_hf_assisted"),
                   ("llama-cpp-python (the Q4_1 GGUF: a quantised target, for scale)", "vs_llama_cpp"))
        body = [[what, *[default(res, t).show(metric, ".2f", "x") for t, (res, _) in runs.items()]]
                for what, metric in against]
        body = [row for row in body if any(cell != "-" for cell in row[1:])]  # a peer the runs left out
        body.insert(1, ["the same, decoding alone: each prompt's prefill (no draft shortens it) left out of both",
                        *[share(res, t, decoding=True) for t, (res, _) in runs.items()]])
        body.append(["verispec's loop with prompt lookup alone: the head's share",
                     *[lookup_share(res, t) for t, (res, _) in runs.items()]])
        body.append(["the lowest Spec-Bench category against `generate`",
                     *[lowest(res, t) for t, (res, _) in runs.items()]])
        seeds = {t: res.header["config"].get("seeds") or [res.header["config"].get("seed", 0)]
                 for t, (res, _) in runs.items()}
        out += ["### One request at a time", "",
                "The tokens/s of `default` (what `verispec generate` does with no options) over each one's, on the "
                "same Spec-Bench prompts (3 questions of each of 6 categories, 128 new tokens; each seed a round, "
                "the methods' order reversed every other round):", "",
                markdown(["`default` against", *[f"T = {t:g}" + (f" ({len(seeds[t])} seeds)" if len(seeds[t]) > 1
                                                                   else "") for t in runs]], body), "",
                "From " + ("; ".join(f"T = {t:g}: {link(title)} ({_short(res)})" for t, (res, title) in runs.items())
                           if len({title for _, title in runs.values()}) > 1 else
                           f"{link(runs[0.0][1])} ({_short(runs[0.0][0])})") + ".", ""]
        shares = [(Results.load(path(name)), heading) for name, heading in SHARE_RUNS if path(name).exists()]
        if shares:
            rows = [[f"{res.header.get('machine', {}).get('cpu', '?')}, git {res.header.get('git', '?')[:7]}",
                     *[cell for t in (0.0, 0.6) for cell in (share(res, t), share(res, t, decoding=True),
                                                             lookup_share(res, t))]] for res, _ in shares]
            out += ["Speculation's own share, the latest run on each CPU (`default` against `ar` on the same prompts, "
                    "three seeds as rounds; decoding alone leaves each prompt's prefill out of both; the head's share "
                    "is `default` against `default` with prompt lookup alone):", "",
                    markdown(["CPU", *[f"T = {t:g}: {what}" for t in (0.0, 0.6) for what in
                                       ("tokens/s", "decoding alone", "the head's share")]], rows), "",
                    "From " + "; ".join(f"{link(speed_title(res, heading))}" for res, heading in shares) + ".", ""]
    out += repeats_standing()
    plain = _latest_loops(None)
    if plain:
        res, title = plain
        rows = {(r.T, r.concurrency): r for r in loop_summary(res) if r.method == "default"}
        temps = sorted({t for t, _ in rows})
        body = [[f"{n}", *[rows[t, n].show("vs_ar", ".2f", "x") if (t, n) in rows else "-" for t in temps]]
                for n in sorted({n for _, n in rows})]
        out += ["### Many requests at once", "",
                "Closed loops of Spec-Bench requests (N in flight, a new one starting as one finishes) through the "
                "batched engine: `default`, whose load-aware plan chooses the drafted depths for the whole batch, "
                "against the same engine decoding plainly (`ar`), in total throughput:", "",
                markdown(["N", *[f"T = {t:g}" for t in temps]], body), "",
                f"From {link(title)} ({_short(res)}).", ""]
    peers = _latest_loops("llama-server")
    if peers:
        res, title = peers
        cols = (("vs_hf_generate", "Hugging Face `generate`, static batches of N"),
                ("vs_llama_cpp", "llama-cpp-python, one request at a time"),
                ("vs_llama_server", "`llama-server` with N slots"), ("vs_own_1", "`default` itself at N = 1"))
        rows = {r.T: r for r in loop_summary(res) if r.method == "default" and r.concurrency == 8}
        if rows:
            body = [[what, *[r.show(metric, ".2f", "x") for r in rows.values()]] for metric, what in cols]
            body.insert(0, ["tokens/s", *[f"{r.throughput:.1f}" for r in rows.values()]])
            out += ["`default` at N = 8 against the peers serving the same requests (the llama.cpp rows run the "
                    "Q4_1 GGUF, a quantised target):", "",
                    markdown(["`default` at N = 8 against", *[f"T = {t:g}" for t in rows]], body), "",
                    f"From {link(title)} ({_short(res)}).", ""]
    head = shipped_report()
    if head:
        rep, spec = head, "spec-bench (held out)"
        agree = rep["sets"][spec]["agreement"]
        out += ["### The draft head", "",
                "The shipped head agrees with the target on held-out Spec-Bench answers "
                + " / ".join(f"{x:.3f}" for x in agree) + f" of the time at depths 1-{len(agree)} (top-1, "
                f"`verispec eval-draft`; {link('## The draft head: agreement with the target')}).", ""]
    rows = audit_engine_rows()
    if rows:
        where = link("## Engines' speculative sampling against the target's law")
        engines = [r for r in rows if not r["control"]]
        names = ", ".join(dict.fromkeys(r["engine"] for r in engines))
        out += ["### Speculative sampling, audited by sampling", "",
                f"`verispec audit-engine` drew the first two tokens "
                f"{' or '.join(f'{n:,}' for n in sorted({r['samples'] for r in rows}))} times per setting from {names}: {sum(not r['differs'] for r in engines)} of {len(engines)} rows keep the "
                f"target's law, and {sum(r['differs'] for r in rows if r['control'])} of "
                f"{sum(bool(r['control']) for r in rows)} rows of samplers wrong on purpose are flagged "
                f"({where}).", ""]
    return out


def shipped_report() -> dict | None:
    """The ``eval-draft`` report (``EPOCHS``) of the head shipped now: the one whose training matches the shipped
    head's sidecar (its sequences and steps)."""
    if not HEAD_INFO.exists():
        return None
    info = json.loads(HEAD_INFO.read_text()).get("training", {})
    for p in [AGREEMENT["shipped head (since 2026-12-05)"], *sorted(EPOCHS.glob("*.json"))]:  # the clean re-run first
        if not p.exists():
            continue
        rep = json.loads(p.read_text())
        tr = rep.get("training") or {}
        if tr and all(tr.get(k) == info.get(k) is not None for k in ("sequences", "steps")):
            return rep
    return None


def verify_cost_section() -> list[str]:
    """What each rule's verification costs per step against the target forward it verifies (results/verify_cost.json,
    made by scripts/experiments/verify_cost.py)."""
    from verispec.bench.report import markdown

    path = ROOT / "results" / "verify_cost.json"
    if not path.exists():
        return []
    rep = json.loads(path.read_text())
    trees = list(dict.fromkeys(r["tree"] for r in rep["rows"]))
    by = {(r["verifier"], r["tree"]): r for r in rep["rows"]}
    rules = list(dict.fromkeys(r["verifier"] for r in rep["rows"]))

    def cell(rule, tree):
        r = by.get((rule, tree))
        return "-" if r is None else f"{r['verify_ms']:.2f} ms ({100 * r['share_of_forward']:.0f} %)"

    forward = {r["tree"]: r["forward_ms"] for r in rep["rows"]}
    return ["## What a rule's verification costs per step", "",
            f"Made by {provenance(path, 'python scripts/experiments/verify_cost.py', rep)}. Each cell: the mean time "
            f"of `step_verdict` (the target's laws from its logits at T = {rep['temperature']:g}, then the rule) on a "
            f"draft of that shape over {rep['vocab']:,} tokens, and in brackets its share of the default model's "
            "forward over the same rows (one sequence, float32, 256 tokens of context: "
            + ", ".join(f"{t} {forward[t]:.1f} ms" for t in trees) + "). The rules took turns within each round; "
            "`-`: a chain-only rule on a tree, or hub pairs (two children a node) on a tree of three.", "",
            markdown(["verifier", *trees], [[rule, *(cell(rule, t) for t in trees)] for rule in rules]), ""]


HEAD_DEPTH_COSTS = ("head_depth_cost_fused.json", "head_depth_cost.json")  # newest first: one table each


def head_depth_cost_section() -> list[str]:
    """What a depth of the shipped head costs, part by part, warm and right after a target forward, its layers from
    float16 panels and from Q8_0 blocks (``HEAD_DEPTH_COSTS`` in results/, made by
    scripts/experiments/head_depth_cost.py on each machine)."""
    from verispec.bench.report import markdown

    reports = [(p, json.loads(p.read_text())) for p in (ROOT / "results" / name for name in HEAD_DEPTH_COSTS)
               if p.exists()]
    if not reports:
        return []
    out = ["### What a depth of the draft head costs", "",
           "Each cell: the bytes of the packed weights the part reads, then its time at one sequence with those "
           "weights in the caches (`warm`: the same call just before) / right after one decoding row of the target, "
           "as in a decoding step; medians, the two heads taking turns. The head's own layers (`fuse` and `fc`, its "
           "decoder layer) read from float16 panels or from Q8_0 blocks (`EagleHead.draft_from_blocks`, what "
           "`build_drafter` drafts with); its output layer is the target's own Q8_0 rows of the 16,384 tokens it "
           "drafts, in both.", ""]
    for path, rep in reports:
        kinds = list(dict.fromkeys(r["weights"] for r in rep["rows"]))
        parts = list(dict.fromkeys(r["part"] for r in rep["rows"]))
        by = {(r["weights"], r["part"]): r for r in rep["rows"]}
        body = [[part, *(f"{by[k, part]['bytes'] / 1e6:.1f} MB: {by[k, part]['warm']:.2f} / "
                         f"{by[k, part]['after a target forward']:.2f} ms" for k in kinds)] for part in parts]
        whole = {k: by[k, parts[-1]] for k in kinds}
        out += [f"Made by {provenance(path, 'python scripts/experiments/head_depth_cost.py', rep)}: a target row "
                f"{rep['target_row_ms']:.1f} ms on a {rep['context']}-token context, medians of {rep['repeats']}.", "",
                markdown(["part", *kinds], body), "",
                f"A first depth after a target forward: {whole[kinds[0]]['after a target forward']:.2f} ms from "
                f"{kinds[0]}, {whole[kinds[1]]['after a target forward']:.2f} ms from {kinds[1]}, "
                f"{whole[kinds[1]]['bytes'] / 1e6:.1f} MB read in that time. The 0.6 ms a depth that issue 66 aims at "
                f"would need them from memory at {whole[kinds[1]]['bytes'] / 0.6e-3 / 1e9:.0f} GB/s, with nothing "
                "else to do.", ""]
    return out


@functools.cache
def never_lose() -> list[dict]:
    """Every exact rule over i.i.d. children at one node against the optimum (computed once a render)."""
    from verispec.audit.run import never_lose_rows
    from verispec.verifiers import VERIFIERS

    specs = [s for s in VERIFIERS.values() if s.exact and s.node_rule and s.default_children == "iid"
             and not s.greedy_only]
    return never_lose_rows(specs, cases=100, seed=0)


@functools.cache
def chain_rows() -> list[dict]:
    """The chain rules against block verification on random chains (computed once a render)."""
    from verispec.audit.run import CHAIN_RULES, chain_optimum_rows
    from verispec.verifiers import get_verifier

    return chain_optimum_rows([get_verifier(n) for n in CHAIN_RULES], cases=60, seed=0)


def optimum_section() -> list[str]:
    """Each exact rule over i.i.d. children against the acceptance optimum at one node: computed, not measured (exact
    acceptance by enumeration, the same seeded cases every time)."""
    from verispec.audit.run import format_never_lose

    return ["## Exact rules against the acceptance optimum at one node", "",
            "Computed, not measured (`verispec audit` prints the same table; `verispec.audit.run.never_lose_table`, "
            "100 seeded random nodes: vocabularies of 3-5 tokens, k = 2 or 3 i.i.d. candidates, a fifth of them with "
            "p close to q). Each rule's acceptance at a node is exact, by enumerating its random outcomes; "
            "alpha*_iid (Hu et al. 2025) is the most any exact rule can accept there. `match` (sampler-match) is the "
            "floor; `canonical` keeps the candidate with the largest p/q, and a third candidate can lower its "
            "acceptance, which the sequential rules never do.", "", format_never_lose(never_lose()), ""] \
        + pairs_section() + chain_optimum_section() + claims_section()


# SpecHub's pairs on the real model (issue 68): tokens a step on a binary tree of depth 3, each rule with its children
RUNS["pairs_tree"] = ["--methods", "specinfer@2x3", "swor@2x3", "spechub@2x3", "--drafts", "int8", "eagle",
                      "--datasets", "spec-bench", "--limit", "2", "--temperatures", "0.6", "1.0",
                      "--max-new-tokens", "64"]


@functools.cache
def pair_table() -> list[dict]:
    """Two candidates a node, each rule with its own children (computed once a render)."""
    from verispec.audit.run import pair_rows

    return pair_rows(cases=100, seed=0)


@functools.cache
def pair_real() -> dict | None:
    """results/pair_acceptance.json: two candidates a node on the real model's nodes (None if missing)."""
    real = ROOT / "results" / "pair_acceptance.json"
    return json.loads(real.read_text()) if real.exists() else None


def pairs_section() -> list[str]:
    """SpecHub's hub pairs against i.i.d. pairs and pairs without replacement: computed on random nodes, exact on the
    real model's nodes (results/pair_acceptance.json), and measured as tokens a step on a binary tree."""
    from verispec.audit.run import format_pairs
    from verispec.bench.report import markdown
    from verispec.bench.stats import fmt

    out = ["### Two candidates a node: SpecHub's pairs through the hub", "", PROSE["PAIRS_LEAD 0"], "",
           format_pairs(pair_table()), ""]
    data = pair_real()
    if data:
        names = ("specinfer", "swor", "spechub", "alpha*_iid", "alpha*_hub")
        body = [[r["draft"], f"{r['temperature']:g}", str(r["positions"]), *(fmt(*r[n], ".4f") for n in names),
                 fmt(*r["spechub - specinfer"], "+.4f"), fmt(*r["spechub - swor"], "+.4f")] for r in data["rows"]]
        source = provenance(ROOT / "results" / "pair_acceptance.json", "python scripts/experiments/pair_acceptance.py",
                            data)
        out += [PROSE["PAIRS_REAL 0"].format(source=source), "",
                markdown(["draft", "T", "positions", *names, "spechub - specinfer", "spechub - swor"], body), ""]
    if path("pairs_tree").exists():
        out += [PROSE["PAIRS_TREE 0"], "", *run_lines(Results.load(path("pairs_tree"))), "", markdown(
            ["T", "draft", "verifier", "children", "tokens a step", "against specinfer (paired)"],
            [[f"{r['T']:g}", r["draft"], f"`{r['verifier']}`", r["children"], f"{r['mean']:.3f}",
              "-" if r["verifier"] == "specinfer" else fmt(*r["ratio"], ".3f", "x")] for r in pairs_tree_rows()]), ""]
    return out


def spechub_claim() -> list[str]:
    """SpecHub's claims row: exactness and its lead over RRS, beside the audit, the node tables and the tree run."""
    from verispec.bench.stats import fmt

    hub = {r["verifier"]: r for r in pair_table()}["spechub"]
    text = (f"exact (the audit); it reaches the optimum of its pairs at every node (mean share "
            f"{hub['mean_share_of_optimum']:.4f}); on 100 random nodes it accepts more than `specinfer` at "
            f"{hub['specinfer_above']} and less at {hub['specinfer_below']}, more than `swor` at {hub['swor_above']} "
            f"and less at {hub['swor_below']}")
    data = pair_real()
    if data:
        gains = [r["spechub - specinfer"][0] for r in data["rows"]]
        over_swor = [r["spechub - swor"][0] for r in data["rows"]]
        text += (f"; on the real model's nodes {min(gains):+.3f} to {max(gains):+.3f} acceptance over `specinfer` "
                 f"and {min(over_swor):+.3f} to {max(over_swor):+.3f} over `swor`")
    if path("pairs_tree").exists():
        rows = pairs_tree_rows()
        base = {(r["T"], r["draft"]): r["mean"] for r in rows if r["verifier"] == "specinfer"}
        text += "; tokens a step on a binary tree of depth 3 over `specinfer`'s: " + ", ".join(
            f"{r['mean'] - base[(r['T'], r['draft'])]:+.2f}, {fmt(*r['ratio'], '.3f', 'x')} ({r['draft']}, "
            f"T = {r['T']:g})" for r in rows if r["verifier"] == "spechub")
    return ["`spechub` (Sun et al. 2024)", "exact; 0.05-0.27 more tokens a step than RRS and 0.02-0.16 more than "
            "RRS without replacement", text,
            PROSE["SPECHUB_VERDICT 0"]]


@functools.cache
def pairs_tree_rows() -> list[dict]:
    """Per (T, draft, rule) of the pairs_tree run: its mean tokens a step and their ratio to ``specinfer``'s on the same
    prompts (paired bootstrap: estimate, low, high)."""
    from verispec.bench.records import cell_id
    from verispec.bench.report import usable
    from verispec.bench.stats import ratio_of_rates

    res = Results.load(path("pairs_tree"))
    prompts, _ = usable(res)
    sums: dict[tuple, dict[tuple, tuple[float, int]]] = {}
    for r in prompts:
        c = r["cell"]
        steps = res.steps.get(cell_id(c), [])
        sums.setdefault((c["T"], c["draft"], c["method"]), {})[(c["seed"], c["prompt"])] = (
            sum(s["accepted_length"] for s in steps), len(steps))
    children = {"specinfer": "iid", "swor": "swor", "spechub": "hub"}
    rows = []
    for (t, draft, method), mine in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                        list(children).index(kv[0][2].split("@")[0]))):
        base = sums.get((t, draft, "specinfer@2x3"), {})
        keys = [k for k in mine if k in base and mine[k][1] and base[k][1]]
        name = method.split("@")[0]
        rows.append({"T": t, "draft": draft, "verifier": name, "children": children[name],
                     "mean": sum(mine[k][0] for k in mine) / max(1, sum(mine[k][1] for k in mine)),
                     "ratio": ratio_of_rates([mine[k][0] for k in keys], [mine[k][1] for k in keys],
                                             [base[k][0] for k in keys], [base[k][1] for k in keys])})
    return rows


def chain_optimum_section() -> list[str]:
    """The chain rules against block verification, and the case that settles HSD's claim: computed, not measured."""
    from verispec.audit.run import format_chain_optimum, hsd_against_block

    case = hsd_against_block()
    block, hsd = case["block"], case["hsd"]
    return ["### On a chain: block verification's optimum, and HSD", "",
            "Computed, not measured (`verispec audit` prints the same table; `verispec.audit.run.chain_optimum_table`, "
            "60 seeded random chains of 2 and 3 drafted tokens over 2-4 token vocabularies, children drawn from q and "
            "top-k in turn). Each rule's expected tokens a step (accepted and the one emitted after) by enumerating "
            "its random outcomes, as a share of block verification's, the most any exact rule keeps from one chain; "
            "and its total variation from the target's law over the step's tokens.", "",
            format_chain_optimum(chain_rows()), "",
            "HSD's claim (lossless, and ahead of block verification on a single chain) settled by the smallest case "
            "(`verispec.audit.run.hsd_against_block`; docs/algorithms.md, \"HSD as its script computes it\"): two "
            "tokens, the chain drawn from q = (.5, .5), then (.6, .4) after token 0, under p = (.9, .1), then "
            f"(.4, .6). HSD keeps {hsd['expected_tokens']:.2f} tokens a step against block verification's "
            f"{block['expected_tokens']:.2f}, and its law of the first two tokens is "
            f"({', '.join(f'{x:.2f}' for x in hsd['law'])}) against the target's "
            f"({', '.join(f'{x:.2f}' for x in case['target'])}) (block: total variation {block['tv']:.0e}; HSD "
            f"{hsd['tv']:.2f}). Where HSD keeps more than block verification it is not exact; with top-k children it "
            "is block verification, and on such chains token-by-token `chain` already keeps as much.", ""]


def claims_section() -> list[str]:
    """Each rule's published headline claim beside verispec's computation of the same quantity, with a verdict."""
    from verispec.bench.report import markdown

    node = {r["verifier"]: r for r in never_lose()}
    chain = {(r["verifier"], r["children"]): r for r in chain_rows()}
    hsd_i, hsd_t, chain_i = chain[("hsd", "iid")], chain[("hsd", "topk")], chain[("chain", "iid")]
    exact_chain = [r for r in chain_rows() if r["claims_exact"]]
    rows = [
        ["`block` (Sun et al. 2024)", "exact, and the most tokens any exact rule keeps from one chain",
         f"exact; no exact rule kept more on {exact_chain[0]['cases'] * 2} random chains (best share of block's "
         f"tokens {max(r['best_share_of_block'] for r in exact_chain if r['verifier'] != 'block'):.4f})", "holds"],
        ["`traversal` (Weng et al. 2025)", "exact; on a single chain, as many tokens as block verification",
         f"exact; {chain[('traversal', 'iid')]['mean_share_of_block']:.4f} of block's tokens on chains drawn from q, "
         f"{chain[('traversal', 'topk')]['mean_share_of_block']:.4f} on top-k chains", "holds"],
        ["`hsd` (Zhou et al. 2026)", "lossless; +12 % tokens a step over token-by-token verification on EAGLE-3 "
         "chains; ahead of block verification on a single chain",
         f"not exact: total variation up to {hsd_i['max_tv']:.3f} on chains drawn from q, where it keeps "
         f"{hsd_i['mean_share_of_block']:.4f} of block's tokens (at most {hsd_i['best_share_of_block']:.4f}; "
         f"token-by-token keeps {chain_i['mean_share_of_block']:.4f}); on top-k chains, as EAGLE-3 drafts, it is "
         f"block verification ({hsd_t['mean_share_of_block']:.4f}) and token-by-token keeps as much "
         f"({chain[('chain', 'topk')]['mean_share_of_block']:.4f}), so no exact rule gains there",
         "does not hold: its lead over block is its bias, and on point-mass chains no exact rule can gain"],
        ["`canonical` (Khisti et al. 2024)", "a selection of one candidate, then single-draft verification, "
         "loses nothing against the best multi-draft rule (given the best selection, an optimisation)",
         f"with verispec's closed-form selection: {node['canonical']['mean_share_of_alpha_star']:.3f} of the "
         f"optimum alpha*_iid on average, {node['canonical']['worst_share_of_alpha_star']:.3f} at worst",
         "not comparable: the claim is for the optimised selection, which verispec does not compute per node"],
        ["`match` (sampler-match; no paper)", "exact, whatever the children (the floor engines use)",
         f"exact; {node['match']['mean_share_of_alpha_star']:.3f} of alpha*_iid at a node, "
         f"{chain[('match', 'iid')]['mean_share_of_block']:.4f} of block's tokens on chains drawn from q", "holds"],
        ["`resispec` (ResiSpec)", "exact (the paper proves it so) while raising acceptance over residual drift",
         "not exact: `verispec audit` flags it, and a one-candidate case shows it (docs/algorithms.md); its extra "
         "acceptance on the real model's steps (\"Verifiers on the same steps\") is that bias", "does not hold"],
        spechub_claim(),
        ["GBV (Thomas and Pal 2026), UniVer (Weng et al. 2026)",
         "exact; +15 % throughput over the best multi-path methods; optimal within its class, +4.2-8.5 % accepted "
         "length over RRS without replacement",
         "not implemented: only their abstracts were at hand (the stored papers and code searched hold no text of "
         "their algorithms and no code), and an abstract does not fix a rule", "not measured"],
    ]
    return ["### Published claims against the enumeration", "",
            "Each rule's headline claim beside what verispec computes of the same quantity on the seeded random "
            "cases above (exact by enumeration, so a verdict holds for those cases; the real model's steps are in "
            "\"Verifiers on the same steps\").", "",
            markdown(["rule", "claim", "verispec's computation", "verdict"], rows), ""]


# results/audit_engines/NAME.jsonl.gz, in order
AUDIT_ENGINES = ("engines", "filtered", "serve", "llama", "prompts", "llama_server", "hf_prompts")


def audit_rows(name: str) -> list[dict]:
    """The rows of ``verispec audit-engine --out`` kept as results/audit_engines/NAME.jsonl.gz (none if missing)."""
    p = ROOT / "results" / "audit_engines" / f"{name}.jsonl.gz"
    if not p.exists():
        return []
    with gzip.open(p, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def audit_engine_rows() -> list[dict]:
    return [r for name in AUDIT_ENGINES for r in audit_rows(name)]


def audit_engines_section() -> list[str]:
    """Every engine's speculative sampling against its target's law (``verispec audit-engine``, made by
    ``python scripts/audit_engines.py``: results/audit_engines/*.jsonl.gz, one row per engine, prompt and setting)."""
    from verispec.audit.engines import EngineCheck, format_checks

    rows = audit_engine_rows()
    if not rows:
        return []
    fields = set(EngineCheck.__dataclass_fields__)
    checks = [EngineCheck(**{k: v for k, v in r.items() if k in fields}) for r in rows]
    made = "; ".join(dict.fromkeys(
        f"`{r['command']}` at git {r['git']} ({r['machine'].get('cpu')})" for r in rows))
    engines = [c for c in checks if not c.control]
    controls = [c for c in checks if c.control]
    differ = [c for c in engines if c.differs]
    missed = [c for c in controls if not c.differs]
    detect = [c.detectable_tv for c in engines if c.detectable_tv == c.detectable_tv]
    return ["## Engines' speculative sampling against the target's law", "",
            f"Made by `python scripts/audit_engines.py`, which ran {made}.", "",
            "`verispec audit-engine` (docs/audit-engine.md): the first 2 tokens after the prompt, drawn N times with "
            "seeds 0 .. N-1 from each engine with its speculation on, against the exact law of those tokens from the "
            "same target's logits by teacher forcing (SmolLM2-135M-Instruct, float32; for llama-cpp-lookup and "
            "llama-server-draft the Q4_1 GGUF file llama.cpp runs, a target of its own, its logits from llama.cpp "
            "itself through llama-cpp-python; prompt 0 is 'Name an "
            "animal.', prompt 1 'Continue the pattern: red, blue, red, blue, red,', each through the chat template, and "
            "for llama-cpp-lookup prompt 2 the plain text 'red, blue, green, red, blue, green, red, blue, green, red,' "
            "without it: through the chat template its prompt lookup rarely drafts). Chi-square over the outcomes expected 5 times or more, the rest merged; a "
            "law differs at p < 0.001. TV: the engine's total variation from the law over those cells, corrected for "
            "the plug-in's upward bias, with a 95 % interval from the triangle inequality that starts at 0 for an "
            "exact engine (docs/audit-engine.md); rows marked * were made before, with the plug-in estimate (biased "
            "upward: an exact engine's rows sit near 0.04) and a percentile interval that lies above it (read those "
            "beside the detectable TV, not beside 0). Smallest detectable TV: the total variation of the "
            "least sharpening of the law that the same test rejects in 80 % of simulations at this N. Rows marked "
            "ctl- are negative controls, samplers wrong on purpose, which the report must flag (the temperature "
            "applied twice is no fault at T = 1, so it runs at 0.6 only). N is "
            f"{' or '.join(f'{n:,}' for n in sorted({c.samples for c in checks}))} per row"
            + (": rows under the 5,000 aimed at are those of engines too slow for it here (the verispec and Hugging "
               "Face rows took about an hour together on 2 cores)." if min(c.samples for c in checks) < 5000 else ".")
            + "", "",
            format_checks(checks), "",
            f"Verdict: {len(engines) - len(differ)} of {len(engines)} engine rows keep the target's law "
            + (f"({', '.join(sorted({c.engine for c in differ}))} differ)" if differ else "(none differs)")
            + f", and {len(controls) - len(missed)} of {len(controls)} control rows are flagged"
            + (f" (missed: {', '.join(c.engine for c in missed)}: the report is invalid)" if missed else "")
            + (f". At this N the test detects total variations of {min(detect):.3f}-{max(detect):.3f} shaped "
               "like a temperature fault; smaller faults can pass." if detect else "."), ""] + _served_bf16() \
        + _llama_server_flash()


def _served_bf16() -> list[str]:
    """The server's first rows, served in bfloat16 against a float32 law: a target that differs, found."""
    from verispec.audit.engines import EngineCheck, format_checks

    rows = audit_rows("serve_bf16")
    if not rows:
        return []
    fields = set(EngineCheck.__dataclass_fields__)
    checks = [EngineCheck(**{k: v for k, v in r.items() if k in fields}) for r in rows]
    return ["The server's rows were first made against a server started without `--dtype` (`verispec serve --host "
            "127.0.0.1 --port PORT --threads 2`, by scripts/audit_engines.py at git " + rows[0]["git"] + "), whose "
            "`auto` computes in bfloat16 on this CPU, while the law came from the float32 model. The same harness "
            "told the two targets apart where the law is sharper (the weights rounded to bfloat16 are a target of "
            "their own, whose law every exact rule keeps, but not the float32 one's). The server's rows above served "
            "float32 and drafted a fixed chain of 3 (`--dtype float32 --policy fixed --tree chain:3`; `audit-engine "
            "--dtype` computes the law in the served dtype): with its default plan, 8 requests at once drafted 0.04-0.05 "
            "tokens a sample (results/audit_engines/serve_default_plan.jsonl.gz, at git 465366a: same law at both "
            "temperatures), too few to test its speculation.", "",
            format_checks(checks), ""]


def _llama_server_flash() -> list[str]:
    """llama-server's first rows, its law read without the flash attention the server runs with: a law that differs,
    found, and where the difference comes from (results/llama_flash_attention_law.json)."""
    from verispec.audit.engines import EngineCheck, format_checks

    rows = audit_rows("llama_server_fa_off_law")
    path = ROOT / "results" / "llama_flash_attention_law.json"
    if not rows or not path.exists():
        return []
    rep = json.loads(path.read_text())
    fields = set(EngineCheck.__dataclass_fields__)
    checks = [EngineCheck(**{k: v for k, v in r.items() if k in fields}) for r in rows]
    tvs = [r[f"tv_T{t}"] for r in rep["rows"] for t in ("1", "0.6")]
    first = rep["rows"][0]
    top = first["top_T1"][0]
    served = dict(first.get("server_top_T1", {}))
    on = next((pr for tok, pr in served.get("fa on", []) if tok == top[0]), None)
    return ["llama-server-draft's rows were first made against a law read by llama-cpp-python with flash attention "
            "off, while the server ran with it on (`-fa on`, as verispec runs llama.cpp: design.md, \"llama.cpp with "
            "flash attention on\"), at git " + rows[0]["git"] + ". Three of four rows differed. So did the same "
            "server with no draft model at all, on the first token alone, which no draft touches (T = 0.6 and 1, "
            "N = 3,000). The difference is the flash attention: on this GGUF file llama.cpp's next-token law with "
            f"it and without it are {min(tvs):.3f}-{max(tvs):.3f} apart in total variation on the two prompts at T = 1 "
            f"and 0.6 (made by {provenance(path, 'python scripts/experiments/llama_flash_attention_law.py', rep)}); "
            f"after 'Name an animal.' the likeliest token has probability {top[1]:.3f} without it and {top[2]:.3f} with "
            "it" + (f", and the server itself reports {on:.3f} with `-fa on`" if on is not None else "")
            + ". The rows in the table above read the law with flash attention on, as the server computes it. The "
            "first rows:", "", format_checks(checks), ""]


def render(figs: Path = ROOT / "docs" / "figures") -> str:
    """docs/results.md from the committed records, its figures drawn into ``figs`` (a test draws them elsewhere)."""
    figs.mkdir(parents=True, exist_ok=True)
    out = ["# Measured results", "",
           "Generated by `python scripts/make_results.py` from the records in `results/*.jsonl.gz` (one record per "
           "decoding step and per prompt; see `verispec/bench/records.py`). Every number below is derived from those "
           "records by `verispec/bench/report.py`; `verispec report results/NAME.jsonl.gz` prints the full tables. "
           "Each run names its command, machine and full revision (`+dirty`: it ran with uncommitted changes). "
           "Speeds are ratios measured within one run: every method runs on the same prompts in one process, "
           "interleaved prompt by prompt. tokens/s counts wall time including prefill (the draft's own prefill of "
           "the prompt counts as drafting time). Default target SmolLM2-135M-Instruct, in float32 unless a run's command says "
           "`--dtype bfloat16`.", ""]

    out += standing_section()
    out += speed_sections(SPEED_RUNS[-LATEST_SPEED:], figs)
    if path("free_drafts").exists():
        out += free_drafts_section(Results.load(path("free_drafts")), "## Drafts that run no model (Spec-Bench)",
                                   FREE_DRAFTS_LEAD, costs=True)
    if path("repetitive").exists():
        out += free_drafts_section(Results.load(path("repetitive")), REPETITIVE_HEADING, REPETITIVE_LEAD)
    out += answer_cache_section()
    for i, (run_name, tag, heading, lead) in enumerate(LATEST_LOOPS):
        if path(run_name).exists():
            out += concurrency_section(Results.load(path(run_name)), figs, heading, lead, tag=tag, explain=i == 0)
    if path("serving").exists():
        out += serving_section(Results.load(path("serving")), figs)
    if path("serving_n8").exists():
        out += serving_n8_section(Results.load(path("serving_n8")))
    if path("serving_bf16").exists():
        out += serving_section(Results.load(path("serving_bf16")), figs)
    if path("serving_n8_bf16").exists():
        out += serving_n8_section(Results.load(path("serving_n8_bf16")))
    out += drills_section()
    if path("hybrid").exists():
        out += hybrid_section(Results.load(path("hybrid")), figs)
    if path("gate").exists():
        out += gate_section(Results.load(path("gate")))
    out += head_section(figs)
    out += head_depth_cost_section()
    if path("shadow").exists():
        out += shadow_section(Results.load(path("shadow")))
    if path("shadow_rules").exists():
        out += shadow_rules_section(Results.load(path("shadow_rules")))
    out += trees_section(figs)
    out += optimum_section()
    out += audit_engines_section()
    out += verify_cost_section()
    for name, model in (("llama_smollm2", "SmolLM2-135M-Instruct (Q4_1)"), ("llama_gemma3", "Gemma 3 270M (Q4_K_M)"),
                        ("llama_gemma3_greedy", "Gemma 3 270M (Q4_K_M), greedy, after the greedy fast paths"),
                        ("llama_smollm2_greedy", "SmolLM2-135M-Instruct (Q4_1), greedy, after the greedy fast paths")):
        if path(name).exists():
            out += llama_section(Results.load(path(name)), model)
    out += llama_costs_section()

    if path("kernel").exists() and path("kernel_stock").exists():
        stock, tall = Results.load(path("kernel_stock")), Results.load(path("kernel"))
        speed = {(name, r.method): r.tokens_per_s for name, res in (("stock", stock), ("tall", tall))
                 for r in summarize(res) if r.category == "all"}
        body = [[m, f"{speed[('stock', m)]:.1f}", f"{speed[('tall', m)]:.1f}", f"{speed[('tall', m)] / speed[('stock', m)]:.2f}x"]
                for m in ("hf-generate", "ar")]
        out += ["## Plain decoding: the stock linear kernel against verispec's", "",
                f"Runs: {stock.describe()} (with `VERISPEC_STOCK_LINEAR=1`), and {tall.describe()}", "",
                "On this CPU `x @ W^T` with 1-8 rows takes a slow path; verispec runs its models' float32 linear "
                "layers as `W @ x^T` for up to 16 rows (one row as two equal columns). Every user of the model "
                "object gets it, Hugging Face `generate` included, so the speedups above are over the faster "
                "baseline. Greedy, 48 tokens, one Spec-Bench prompt per category.", "",
                "| method | tokens/s, stock kernel | tokens/s, verispec kernel | ratio |", "|---|---|---|---|",
                *["| " + " | ".join(row) + " |" for row in body], ""]

    out += ["# Earlier runs", "", "First the speed runs before the latest (above), then the closed loops of many "
            "requests before the latest, each oldest first: each section names what changed since the one before "
            "it. Then runs made before the head shipped now (their headers name the commit), which compare verifiers, "
            "trees and drafts among themselves.", ""]
    out += speed_sections(SPEED_RUNS[:-LATEST_SPEED], figs)
    out += earlier_loops(figs)
    if path("table2").exists():
        res = Results.load(path("table2"))
        rows = summarize(res)
        out += ["## ResiSpec Table 2 shape: the verifiers as add-ons on the eagle draft", "", *run_lines(res),
                "", "Draft `eagle` with the tree chosen by `verispec tune-tree` (children i.i.d. for `specinfer`, "
                "`resispec` and `reserve`, without replacement for `swor`, the top-k for `topk`), and `topk` on "
                f"the EAGLE-2 dynamic tree `{DYNAMIC}`. `resispec` is the published rule and is **not exact**.", "",
                table_verifiers_by_category(rows), "", fig(per_candidate(res, figs / "table2_per_candidate.png", rows)),
                "", table_audit(res.audits), ""]

    res = Results.load(path("peers"))
    rows, cats = summarize(res), summarize(res, by_category=True)
    out += ["## Speedup against plain decoding and the Hugging Face peers", "", *run_lines(res), "",
            "This run and the ones below it predate verispec's linear kernel (see above): all their methods ran "
            "with the stock kernel, so their ratios hold among themselves.", "",
            "`ar` is the target's plain decoding in verispec's loop, `hf-generate` Hugging Face `generate`, "
            "`hf-assisted` Hugging Face assisted generation with the same draft (the int8 copy as assistant model; "
            "prompt lookup for `ngram`), `fixed` exact chain speculative sampling of 5 drafted tokens.", "",
            table_peers(rows), "", "By Spec-Bench category (speedup over `ar`):", "", table_categories(cats), "",
            fig(categories(res, figs / "speedup_by_category.png")), ""]

    res = Results.load(path("drafts"))
    rows = summarize(res)
    out += ["## Draft study: the training-free drafts on the default target", "", *run_lines(res), "",
            "Each draft with a fixed chain of 5 and the exact `chain` verifier. Draft cost: drafting time per "
            "drafted token (one draft forward per depth) over the target's time per forward in `ar`, leaving out "
            "each prompt's first step (it includes the draft's own prefill of the prompt).", "",
            table_drafts(rows), "", fig(latency(res, figs / "drafts_latency.png", rows)), ""]

    res = Results.load(path("table1"))
    rows, cats = summarize(res), summarize(res, by_category=True)
    out += ["## ResiSpec Table 1 shape: verifiers on a complete 3 x 5 tree", "", *run_lines(res), "",
            "Draft `int8`, 363 drafted nodes per step, children i.i.d. (`swor`: without replacement, `topk`: the "
            "top 3). L = mean accepted length per step (accepted drafted tokens + 1). `resispec` is the published "
            "rule and is **not exact** (see the audit below): its extra acceptance is bias, not speed for free.", "",
            table_verifiers_by_category([r for r in cats if r.category != "all"] + [r for r in rows]), "",
            "### Per-candidate acceptance (ResiSpec Figure 1)", "",
            fig(per_candidate(res, figs / "per_candidate.png", rows)), "",
            "### Per-step latency split (ResiSpec Figure 3)", "",
            fig(latency(res, figs / "latency.png", rows)), "",
            "### Exactness (ResiSpec Table 4 shape)", "",
            "The paper reports KL of its rule's law from the target's on real data; here the exhaustive audit "
            "computes each verifier's exact output law on random small cases (prefix-dependent tables, every draw "
            "and accept/reject outcome enumerated in float64), so bias cannot hide in sampling noise.", "",
            table_audit(res.audits), ""]

    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render", action="store_true", help="only render docs/results.md from existing results")
    shipped = (ROOT / "verispec" / "heads" / "smollm2-135m.pt").exists()
    try:
        import llama_cpp  # noqa: F401
        llama = True
    except ImportError:
        llama = False
    ap.add_argument("--runs", nargs="+", default=[*RUNS, *(HEAD_RUNS if shipped else []), *(LLAMA_RUNS if llama else [])],
                    choices=[*RUNS, *HEAD_RUNS, *LLAMA_RUNS],
                    help="runs to do (the head runs need the shipped draft head, the llama ones llama-cpp-python; "
                         "default: all that can run)")
    ap.add_argument("--fresh", action="store_true",
                    help="measure the runs anew, replacing their records (default: continue each where it stopped)")
    args = ap.parse_args()
    if not args.render:
        for name in args.runs:
            run(name, fresh=args.fresh)
    (ROOT / "docs" / "results.md").write_text(render() + "\n", encoding="utf-8")
    print("wrote docs/results.md")


if __name__ == "__main__":
    main()
