"""Figures and tables derived only from the records of a results file (``verispec.bench``).

Definitions (the same everywhere):

* accepted length per step: accepted drafted tokens + the one recovered or bonus token (plain decoding: 1.0);
* tokens/s: generated tokens / wall time of the cell, prefill included (Hugging Face's ``generate`` gives no
  other split), summed over the cells of a row;
* speedup: a row's tokens/s over the baseline's, both over the (seed, prompt) cells they share, in the same run;
  ``ar`` is the target's plain decoding in verispec's loop, ``hf-generate`` Hugging Face's, ``hf-assisted``
  Hugging Face assisted generation with the same draft, ``llama-cpp`` llama.cpp's plain decoding of the GGUF file
  (a quantised model, so a target of its own: its rows are speed beside verispec's, not the same law);
* per-candidate acceptance: P(candidate i accepted | candidates 1..i-1 rejected) over all tree nodes visited;
* draft cost: drafting time per drafted tree level over the target's time per forward in ``ar``, leaving out
  each prompt's first step (its drafting time includes the draft model's own prefill of the prompt);
* outside share: the part of a step spent outside the target's forward (drafting, verification, commits);
* eta (ResiSpec Table 5): marginal gain in accepted length per extra candidate, between successive widths N.

Every comparison carries a 95 % interval from a bootstrap that resamples prompts (paired: a resampled prompt
brings both sides' cells; ``verispec.bench.stats``). Cells that ran while other work competed for the cores
(``records.contended``) are left out, and the report says how many.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from ..errors import VerispecError
from ..methods import resolve
from ..metrics import mean_accepted_length, per_candidate_acceptance
from ..tree import Tree
from .peers import BASELINES, PEERS
from .records import NO_DRAFT, Results, cell_id, contended, group_id
from .stats import fmt, ratio_of_loops, ratio_of_rates, ratio_of_sums

NAN = float("nan")
_COLUMNS = {b.column for b in BASELINES}


@dataclass
class Row:
    T: float
    draft: str
    method: str
    category: str  # "all" or a category
    prompts: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    steps: int
    mean_accepted_length: float
    drafted_per_step: float
    vs: dict = field(default_factory=dict)  # Baseline.column -> this row's speed over it (``peers.BASELINES``)
    draft_ms: float = NAN  # per step
    target_ms: float = NAN
    verify_ms: float = NAN
    draft_cost: float = NAN
    correct: str = "-"
    per_candidate: list[float] = field(default_factory=list)
    outside_share: float = NAN  # of a step, the time outside the target forward
    nll: float = NAN  # mean NLL per token of the text under the target (records with --distortion)
    tv: float = NAN  # mean exact TV of a lossy rule's law from the target's, over the positions it tested
    ci: dict = field(default_factory=dict)  # metric -> (low, high), 95 % over prompts

    @property
    def verifier(self) -> str:
        return self.method.partition("@")[0]

    @property
    def tree(self) -> str:
        return _tree_spec(self.method)

    def value(self, metric: str) -> float:
        """A metric by name: a field, or a ratio against a baseline (``vs``; NaN where it did not run)."""
        return self.vs.get(metric, NAN) if metric in _COLUMNS else getattr(self, metric)

    def show(self, metric: str, spec: str = ".2f", suffix: str = "") -> str:
        """``estimate [low, high]`` of a metric."""
        low, high = self.ci.get(metric, (NAN, NAN))
        return fmt(self.value(metric), low, high, spec, suffix)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else NAN


def _rate(prompts: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in prompts)
    return sum(r["tokens"] for r in prompts) / wall if wall > 0 else NAN


def _key(r: dict) -> tuple:
    return r["cell"]["seed"], r["cell"]["prompt"]


def paired_ratio(mine: list[dict], base: list[dict], decoding: bool = False) -> tuple[float, float, float]:
    """tokens/s of ``mine`` over ``base`` (prompt records) on the (seed, prompt) cells both have, with a paired
    bootstrap interval: (estimate, low, high). At T = 0 every seed decodes the same text, so a prompt's seeds are one
    sample timed several times, not several samples: they are pooled into one pair per prompt (sums of tokens and of
    seconds) before resampling, which leaves the estimate as it is and keeps the interval from narrowing with
    copies. ``decoding``: each cell's time without its prompt's prefill (``prefill_s``, the target's forward over the
    prompt, which no draft can shorten), for two methods of verispec's loop; NaN where a record lacks it."""
    theirs = {_key(r): r for r in base}
    pairs = [(r, theirs[_key(r)]) for r in mine if _key(r) in theirs]
    if not pairs:
        return NAN, NAN, NAN
    units: dict[tuple, list[float]] = {}  # sampling unit -> [my tokens, my seconds, base tokens, base seconds]
    for a, b in pairs:
        unit = (a["cell"]["prompt"],) if a["cell"].get("T") == 0 else _key(a)
        u = units.setdefault(unit, [0.0, 0.0, 0.0, 0.0])
        if decoding and (a.get("prefill_s") is None or b.get("prefill_s") is None):
            return NAN, NAN, NAN
        u[0] += a["tokens"]
        u[1] += a["wall_s"] - (a["prefill_s"] if decoding else 0.0)
        u[2] += b["tokens"]
        u[3] += b["wall_s"] - (b["prefill_s"] if decoding else 0.0)
    return ratio_of_rates(*(list(col) for col in zip(*units.values())))


def _pooled(groups: list[tuple[float, float]]) -> tuple[float, float, float]:
    """sum(a) / sum(b) over per-prompt (a, b), with a bootstrap interval over prompts."""
    groups = [g for g in groups if g[1] > 0]
    if not groups:
        return NAN, NAN, NAN
    return ratio_of_sums([a for a, _ in groups], [b for _, b in groups])


def usable(res: Results) -> tuple[list[dict], int]:
    """The prompt records a summary counts (cells that ran beside other work are left out), and how many were.
    If every cell ran beside other work, all are kept (the report says so) rather than none. The requests of closed
    loops are summarised by ``loop_summary``."""
    alone = [r for r in res.prompts if r["cell"].get("concurrency") is None]
    kept = [r for r in alone if not contended(r)]
    if not kept:
        return alone, 0
    return kept, len(alone) - len(kept)


def summarize(res: Results, by_category: bool = False) -> list[Row]:
    """One row per (temperature, draft, method), or per (temperature, draft, method, category)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    prompts_kept, _ = usable(res)
    for r in prompts_kept:
        c = r["cell"]
        groups[(c["T"], c["draft"], c["method"], r["category"] if by_category else "all")].append(r)
    ar_target_ms = {}
    for (t, d, m, cat), prompts in groups.items():
        if m == "ar":
            steps = [s for r in prompts for s in res.steps.get(cell_id(r["cell"]), [])]
            ar_target_ms[(t, cat)] = 1000 * _mean(s["target_s"] for s in steps if "target_s" in s)
    rows = []
    for (t, d, m, cat), prompts in groups.items():
        per_prompt = [res.steps.get(cell_id(r["cell"]), []) for r in prompts]
        steps = [s for ss in per_prompt for s in ss]
        timed = [s for s in steps if "draft_s" in s]
        row = Row(
            T=t, draft=d, method=m, category=cat, prompts=len(prompts), tokens=sum(r["tokens"] for r in prompts),
            wall_s=sum(r["wall_s"] for r in prompts), tokens_per_s=_rate(prompts), steps=len(steps),
            mean_accepted_length=mean_accepted_length(steps) if steps else NAN,
            drafted_per_step=_mean(s["drafted"] for s in steps),
            per_candidate=per_candidate_acceptance(s for s in steps if "tested" in s),
        )
        row.ci["tokens_per_s"] = _pooled([(r["tokens"], r["wall_s"]) for r in prompts])[1:]
        if steps:
            row.ci["mean_accepted_length"] = _pooled([(sum(s["accepted_length"] for s in ss), len(ss))
                                                       for ss in per_prompt])[1:]
        if timed:
            row.draft_ms = 1000 * _mean(s["draft_s"] for s in timed)
            row.target_ms = 1000 * _mean(s["target_s"] for s in timed)
            row.verify_ms = 1000 * _mean(s["verify_s"] for s in timed)
            total = row.draft_ms + row.target_ms + row.verify_ms
            row.outside_share = (row.draft_ms + row.verify_ms) / total if total > 0 else NAN
            later = [s for s in timed if s.get("i", 1) > 0]
            levels = sum(s.get("draft_depth", s.get("depth", 0)) for s in later)  # "depth" in older files
            if levels and (t, cat) in ar_target_ms:
                row.draft_cost = 1000 * sum(s["draft_s"] for s in later) / levels / ar_target_ms[(t, cat)]
        tvs = [x for s in steps for x in s.get("tv", [])]
        row.tv = _mean(tvs)
        nlls = [r["nll"] for r in prompts if r.get("nll") is not None and r["nll"] == r["nll"]]
        row.nll = _mean(nlls)
        scored = [r["correct"] for r in prompts if r.get("correct") is not None]
        if scored:
            row.correct = f"{sum(scored)}/{len(scored)}"
        for b in BASELINES:
            if b.best_draft:
                runs = [g for (t2, _, m2, c2), g in groups.items() if (t2, m2, c2) == (t, b.method, cat)]
                base = max(runs, key=_rate) if runs else None
            else:
                base = groups.get((t, d if b.same_draft else NO_DRAFT, b.method, cat))
            if base:
                est, low, high = paired_ratio(prompts, base)
                row.vs[b.column], row.ci[b.column] = est, (low, high)
        rows.append(row)
    order = {name: i for i, name in enumerate(res.header.get("config", {}).get("methods", []))}
    drafts = {name: i for i, name in enumerate([NO_DRAFT, *res.header.get("config", {}).get("drafts", [])])}
    rows.sort(key=lambda r: (r.T, r.category != "all", r.category, drafts.get(r.draft, 99), order.get(r.method, 99),
                             r.method))
    return rows


@dataclass
class ShadowRow:
    """What one shadow verifier would have accepted on the steps a method drove (``verispec.bench.shadow``)."""

    T: float
    draft: str
    method: str  # the driver
    category: str
    verifier: str
    prompts: int
    steps: int
    mean_accepted_length: float
    ci: tuple[float, float]
    per_candidate: list[float]
    diff: float = NAN  # paired per step against ``reference``
    diff_ci: tuple[float, float] = (NAN, NAN)
    reference: str = ""

    @property
    def tree(self) -> str:
        """The driver's tree (every shadow verifies the driver's drafts)."""
        return _tree_spec(self.method)

    def show(self, metric: str, spec: str = ".2f", suffix: str = "") -> str:
        """``estimate [low, high]`` of ``mean_accepted_length`` or ``diff``."""
        low, high = self.ci if metric == "mean_accepted_length" else self.diff_ci
        return fmt(getattr(self, metric), low, high, spec, suffix)


def _shadow_lengths(steps: list[dict], name: str) -> list[float]:
    """Per step, a shadow's accepted length averaged over its coin seeds."""
    out = []
    for s in steps:
        runs = s.get("shadow", {}).get(name)
        if runs:
            out.append(sum(r["accepted_length"] for r in runs) / len(runs))
    return out


def shadow_summary(res: Results, by_category: bool = False, reference: str = "specinfer") -> list[ShadowRow]:
    """One row per (temperature, draft, driving method, category, shadow verifier): its mean accepted length on the
    driven steps, per-candidate acceptance, and the paired per-step difference from ``reference`` (a shadow too)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in res.prompts:  # every cell: acceptance does not depend on the machine's load (speeds do)
        c = r["cell"]
        groups[(c["T"], c["draft"], c["method"], r["category"] if by_category else "all")].append(r)
    rows = []
    for (t, d, m, cat), prompts in groups.items():
        per_prompt = [[s for s in res.steps.get(cell_id(r["cell"]), []) if s.get("shadow")] for r in prompts]
        names = list(dict.fromkeys(n for ss in per_prompt for s in ss for n in s["shadow"]))
        for name in names:
            lengths = [_shadow_lengths(ss, name) for ss in per_prompt]
            est, low, high = _pooled([(sum(x), len(x)) for x in lengths if x])
            runs = [run for ss in per_prompt for s in ss for run in s["shadow"].get(name, [])]
            row = ShadowRow(t, d, m, cat, name, sum(1 for x in lengths if x), sum(len(x) for x in lengths), est,
                            (low, high), per_candidate_acceptance(runs))
            if reference in names and name != reference:
                paired = [(sum(a - b for a, b in zip(_shadow_lengths(ss, name), _shadow_lengths(ss, reference))),
                           len(_shadow_lengths(ss, name))) for ss in per_prompt]
                row.diff, lo, hi = _pooled(paired)
                row.diff_ci, row.reference = (lo, hi), reference
            rows.append(row)
    return rows


def share_of_bias_gain(res: Results, exact: str, biased: str = "resispec", reference: str = "specinfer",
                       by_category: bool = False) -> dict[tuple, tuple[float, float, float]]:
    """Per (T, draft, method, category): the share of ``biased``'s extra accepted length over ``reference`` that the
    exact rule ``exact`` achieves, ``(L_exact - L_ref) / (L_biased - L_ref)``, with a bootstrap interval over
    prompts (shadows on the same steps)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in res.prompts:  # acceptance only: every cell counts
        c = r["cell"]
        groups[(c["T"], c["draft"], c["method"], r["category"] if by_category else "all")].append(r)
    out = {}
    for key, prompts in groups.items():
        per = []
        for r in prompts:
            ss = [s for s in res.steps.get(cell_id(r["cell"]), []) if s.get("shadow")]
            e, b, ref = (_shadow_lengths(ss, n) for n in (exact, biased, reference))
            if e and b and ref:
                per.append((sum(e) - sum(ref), sum(b) - sum(ref)))
        if per:
            out[key] = ratio_of_sums([a for a, _ in per], [b for _, b in per])
    return out


# ---------------------------------------------------------------- formatting

def _f(x, spec=".2f", suffix="") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec) + suffix


def markdown(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def _kept(baselines, rows) -> list:
    """The baseline columns a table shows: all but optional ones no row has."""
    return [b for b in baselines if not b.optional or any(b.column in r.vs for r in rows)]


def table_summary(rows: list[Row]) -> str:
    k = min(max((len(r.per_candidate) for r in rows), default=0), 4)
    vs = _kept([b for b in BASELINES if not b.best_draft], rows)
    head = ["T", "draft", "method", "prompts", "tokens", "tokens/s", *[b.label for b in vs], "accepted length",
            "drafted/step", "draft ms", "target ms", "verify ms", "outside share", "draft cost",
            *[f"cand. {i}" for i in range(1, k + 1)], "correct", "NLL/token", "TV (decoded)"]
    optional = {"NLL/token": "nll", "TV (decoded)": "tv"}
    keep = [h for h in head if h not in optional or any(getattr(r, optional[h]) == getattr(r, optional[h])
                                                       for r in rows)]
    body = []
    for r in rows:
        pc = [_f(x, ".3f") for x in (r.per_candidate + [NAN] * k)[:k]]
        cells = [f"{r.T:g}", r.draft, r.method, str(r.prompts), str(r.tokens), r.show("tokens_per_s", ".1f"),
                 *[r.show(b.column, ".2f", "x") for b in vs],
                 r.show("mean_accepted_length"), _f(r.drafted_per_step, ".1f"), _f(r.draft_ms, ".1f"),
                 _f(r.target_ms, ".1f"), _f(r.verify_ms, ".1f"), _f(100 * r.outside_share, ".0f", "%"),
                 _f(r.draft_cost, ".2f"), *pc, r.correct, _f(r.nll, ".3f"), _f(r.tv, ".4f")]
        body.append([c for h, c in zip(head, cells) if h in keep])
    return markdown(keep, body)


def loops_csv(rows: list[LoopRow]) -> str:
    """The closed loops' rows as CSV (ratios and their intervals as columns)."""
    buf = io.StringIO()
    cols = [c for c, _, _ in LOOP_BASELINES] + ["vs_own_1", "vs_ar_1"]
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["T", "concurrency", "method", "draft", "requests", "tokens", "wall_s", "throughput", "tpot_ms_p50",
                "tpot_ms_p90", "ttft_ms_p50", "ttft_ms_p90", "mean_accepted_length", "drafted_per_step", "errors",
                "rounds", *[f"{c}{e}" for c in cols for e in ("", "_low", "_high")]])
    for r in rows:
        w.writerow([r.T, r.concurrency, r.method, r.draft, r.requests, r.tokens, r.wall_s, r.throughput, *r.tpot_ms,
                    *r.ttft_ms, r.mean_accepted_length, r.drafted_per_step, r.errors, r.rounds,
                    *[x for c in cols for x in (r.vs.get(c, NAN), *r.ci.get(c, (NAN, NAN)))]])
    return buf.getvalue()


def rows_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    names = [k for k in asdict(rows[0]) if k not in ("ci", "vs")] if rows else []
    names[names.index("drafted_per_step") + 1:names.index("drafted_per_step") + 1] = [b.column for b in BASELINES]
    cis = sorted({m for r in rows for m in r.ci})
    w = csv.DictWriter(buf, fieldnames=names + [f"{m}_{e}" for m in cis for e in ("low", "high")], lineterminator="\n")
    w.writeheader()
    for r in rows:
        d = {k: v for k, v in asdict(r).items() if k not in ("ci", "vs")}
        d.update({b.column: r.vs.get(b.column, NAN) for b in BASELINES})
        d["per_candidate"] = ";".join(f"{x:.4f}" for x in r.per_candidate)
        for m in cis:
            d[f"{m}_low"], d[f"{m}_high"] = r.ci.get(m, (NAN, NAN))
        w.writerow(d)
    return buf.getvalue()


def table_shadow(rows: list[ShadowRow], k: int = 3) -> str:
    """Shadow verifiers on the same steps: accepted length with its interval, per-candidate acceptance, and the
    paired difference from the reference (specinfer) with its interval."""
    body = [[f"{r.T:g}", r.draft, r.method, r.category, r.verifier, str(r.prompts), str(r.steps),
             fmt(r.mean_accepted_length, *r.ci), *[_f(x, ".3f") for x in (r.per_candidate + [NAN] * k)[:k]],
             fmt(r.diff, *r.diff_ci, "+.3f") if r.reference else "-"] for r in rows]
    return markdown(["T", "draft", "driver", "category", "verifier", "prompts", "steps", "accepted length",
                     *[f"cand. {i}" for i in range(1, k + 1)], "minus specinfer (paired)"], body)


def table_verifiers_by_category(rows: list[Row]) -> str:
    """ResiSpec Table 1 shape: per category and temperature, accepted length and tokens/s of each verifier."""
    verifiers = list(dict.fromkeys(r.method for r in rows if r.method != "ar"))
    head = ["category", "T", *[f"{v} L" for v in verifiers], *[f"{v} tok/s" for v in verifiers]]
    cells = {(r.category, r.T, r.method): r for r in rows}
    body = []
    for cat, t in dict.fromkeys((r.category, r.T) for r in rows):
        body.append([cat, f"{t:g}", *[_f(getattr(cells.get((cat, t, v)), "mean_accepted_length", NAN)) for v in verifiers],
                     *[_f(getattr(cells.get((cat, t, v)), "tokens_per_s", NAN), ".2f") for v in verifiers]])
    return markdown(head, body)


def _tree_spec(method: str) -> str:
    """The tree a record's method drafts (``Tree.parse`` syntax): ``none`` for plain decoding and peers, ``auto`` for
    a tree chosen per draft and for a method an older version registered and this one does not (its tree was chosen
    when it ran)."""
    if method in PEERS:
        return "none"
    try:
        return resolve(method).tree
    except VerispecError:
        return "auto"


def _shaped(r: Row) -> bool:
    """Rows of methods with a fixed tree (not plain decoding, a peer, or a tree chosen per draft)."""
    return r.tree not in ("none", "auto")


def table_trees(rows: list[Row] | list[ShadowRow]) -> str:
    """ResiSpec Table 3 shape: per tree (and its verification cost in nodes), each verifier's accepted length with
    its interval. Rows of separate runs (``summarize``) add each verifier's speed and its gain over the first;
    shadow rows (``shadow_summary``) add each verifier's paired difference from the reference on the same steps."""
    rows = [r for r in rows if _shaped(r) and r.category == "all"]
    verifiers = list(dict.fromkeys(r.verifier for r in rows))
    cells = {(r.T, r.draft, r.tree, r.verifier): r for r in rows}
    paired = list(dict.fromkeys((r.verifier, r.reference) for r in rows if getattr(r, "reference", "")))
    head = ["T", "draft", "tree", "nodes", *[f"{v} L" for v in verifiers]]
    head += [f"{v} - {ref}" for v, ref in paired] if paired else (
        [f"{v} tok/s" for v in verifiers] + [f"{v} / {verifiers[0]}" for v in verifiers[1:]])
    nodes = {r.tree: Tree.parse(r.tree).size - 1 for r in rows}
    drafts = list(dict.fromkeys(r.draft for r in rows))
    keys = sorted(dict.fromkeys((r.T, r.draft, r.tree) for r in rows), key=lambda k: (k[0], drafts.index(k[1]),
                                                                                         nodes[k[2]]))
    body = []
    for t, draft, tree in keys:  # by temperature, draft, then size (stable: equal sizes keep their run order)
        got = [cells.get((t, draft, tree, v)) for v in verifiers]
        line = [f"{t:g}", draft, tree, str(nodes[tree]),
                *[g.show("mean_accepted_length") if g else "-" for g in got]]
        if paired:
            line += [g.show("diff", "+.3f") if (g := cells.get((t, draft, tree, v))) else "-" for v, _ in paired]
        else:
            ls = [getattr(g, "mean_accepted_length", NAN) for g in got]
            line += [_f(getattr(g, "tokens_per_s", NAN)) for g in got] + [_f(x / ls[0], ".2f", "x") for x in ls[1:]]
        body.append(line)
    return markdown(head, body)


def width_series(rows: list[Row] | list[ShadowRow]) -> dict[tuple, list[tuple[int, int, Row | ShadowRow]]]:
    """(T, draft, verifier, depth) -> [(N, nodes, row)] for complete N x depth trees (and chains), by N."""
    out = defaultdict(list)
    for r in rows:
        if not _shaped(r) or r.category != "all":
            continue
        tree = resolve(r.method).tree_for()
        if not isinstance(tree, Tree):  # a dynamic tree has no fixed width
            continue
        widths = {len(c) for c in tree.children if c}
        if len(widths) != 1:
            continue
        n = widths.pop()
        out[(r.T, r.draft, r.verifier, tree.max_depth)].append((n, tree.size - 1, r))
    return {k: sorted(v, key=lambda x: x[0]) for k, v in out.items()}


def table_width(rows: list[Row] | list[ShadowRow]) -> str:
    """ResiSpec Table 5 shape: accepted length (with its interval) and eta, the gain per extra candidate between
    successive widths N, as N grows."""
    body = []
    for (t, draft, v, depth), series in width_series(rows).items():
        if len(series) < 2:
            continue
        prev = None
        for n, nodes, r in series:
            length = r.mean_accepted_length
            eta = NAN if prev is None else (length - prev[1]) / (n - prev[0])
            body.append([f"{t:g}", draft, v, str(depth), str(n), str(nodes), r.show("mean_accepted_length"),
                         _f(eta, ".3f")])
            prev = (n, length)
    return markdown(["T", "draft", "verifier", "depth", "N", "nodes", "accepted length", "eta"], body)


def table_drafts(rows: list[Row]) -> str:
    """Draft study: accepted length, draft cost relative to the target and speedup for each draft."""
    body = [[f"{r.T:g}", r.draft, r.method, _f(r.mean_accepted_length), _f(r.drafted_per_step, ".1f"),
             _f(r.draft_cost, ".2f"), _f(r.tokens_per_s, ".1f"), _f(r.value("speedup_ar"), ".2f", "x"),
             _f(r.value("vs_hf_assisted"), ".2f", "x")]
            for r in rows if r.category == "all" and r.draft != NO_DRAFT and r.method != "hf-assisted"]
    return markdown(["T", "draft", "method", "accepted length", "drafted/step", "draft cost (x target forward)",
                     "tokens/s", "speedup vs ar", "vs HF assisted (same draft)"], body)


def table_peers(rows: list[Row]) -> str:
    """Speedup against the target's plain decoding and the peers (``peers.BASELINES``: Hugging Face ``generate``;
    assisted generation with the draft that made it fastest in the run; llama.cpp where it ran), each with its 95 %
    interval."""
    vs = _kept([b for b in BASELINES if not b.same_draft], [r for r in rows if r.category == "all"])
    body = [[f"{r.T:g}", r.draft, r.method, r.show("tokens_per_s", ".1f"), r.show("mean_accepted_length"),
             *[r.show(b.column, ".2f", "x") for b in vs]]
            for r in rows if r.category == "all"]
    return markdown(["T", "draft", "method", "tokens/s", "accepted length", *[b.label for b in vs]], body)


def table_categories(rows: list[Row]) -> str:
    """Speedup over ``ar`` by task category (one column per method and draft)."""
    rows = [r for r in rows if r.category != "all" and r.method != "ar"]
    cols = list(dict.fromkeys((r.draft, r.method) for r in rows))
    cells = {(r.T, r.category, r.draft, r.method): r for r in rows}
    head = ["T", "category", *[m if d == NO_DRAFT else f"{m} ({d})" for d, m in cols]]
    body = [[f"{t:g}", c, *[_f(cells[(t, c, d, m)].value("speedup_ar") if (t, c, d, m) in cells else NAN, ".2f", "x")
                            for d, m in cols]]
            for t, c in dict.fromkeys((r.T, r.category) for r in rows)]
    return markdown(head, body)


def table_audit(audits: list[dict]) -> str:
    """ResiSpec Table 4 shape: the exact law's distance from the target's, per verifier (exhaustive audit)."""
    body = [[a["verifier"], "yes" if a["claims_exact"] else "no", str(a["cases"]), f"{a['max_tv']:.2e}",
             f"{a['max_kl']:.2e}", a["verdict"]] for a in audits]
    return markdown(["verifier", "claims exact", "cases", "max TV", "max KL", "verdict"], body)


@dataclass
class LoopRow:
    """A closed loop of requests (``--concurrency``): its throughput, its ratios to the other systems at the same
    concurrency, and what each request saw."""

    T: float
    concurrency: int
    draft: str
    method: str
    requests: int
    tokens: int
    wall_s: float
    throughput: float  # tokens per second: all tokens over first start to last end
    tpot_ms: tuple[float, float]  # time per output token after the first: median, 90th percentile
    ttft_ms: tuple[float, float]  # time to first token, from submission: median, 90th percentile
    mean_accepted_length: float
    drafted_per_step: float
    errors: int
    contended: bool
    rounds: int = 1  # loops of this (temperature, concurrency, draft, method) pooled here (``--rounds``)
    vs: dict = field(default_factory=dict)  # column -> ratio (see ``loop_summary``)
    ci: dict = field(default_factory=dict)

    def show(self, metric: str, spec: str = ".2f", suffix: str = "") -> str:
        low, high = self.ci.get(metric, (NAN, NAN))
        return fmt(self.vs.get(metric, NAN), low, high, spec, suffix)


# the columns of closed-loop tables: verispec's own plain decoding, every peer that names one (the registry's
# ``Peer.loop_label``), and the default method
LOOP_BASELINES = (("vs_ar", "vs ar (same N)", "ar"),
                  *(("vs_" + p.name.replace("-", "_"), p.loop_label, p.name) for p in PEERS.values() if p.loop_label),
                  ("vs_default", "vs default (same N)", "default"))


def _quantiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(x for x in xs if x is not None and x == x)
    if not xs:
        return NAN, NAN
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]), \
        xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]


def loop_summary(res: Results) -> list[LoopRow]:
    """One row per closed loop (temperature, concurrency, draft, method), its rounds (``--rounds``) pooled: tokens
    and wall time summed, latencies and steps of every request. A ratio is of measured throughputs, at the same
    temperature and concurrency (``vs_own_1``: against the same method's loop of one request at a time; ``vs_ar_1``:
    against ``ar``'s, plain decoding serving one request at a time), paired round by round: the geometric mean of
    the rounds' ratios. Its interval says how much the rounds and the prompts drawn move it
    (``stats.ratio_of_loops``): by Little's law a loop's throughput is about N x sum(tokens) / sum(time in system)
    over its requests, so resampling prompts moves a round's ratio as it moves that ratio of sums. With one round,
    machine noise between runs is not in it."""
    requests: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))  # loop -> round -> requests
    for r in res.prompts:
        if r["cell"].get("concurrency") is not None:
            *loop, k = group_id(r["cell"])
            requests[tuple(loop)][k].append(r)
    cells: dict[tuple, dict[int, dict]] = defaultdict(dict)  # loop -> round -> its cell record
    for cell in res.cells:
        *loop, k = group_id(cell["cell"])
        cells[tuple(loop)][k] = cell
    by_method: dict[tuple, tuple] = {}  # (T, seed, method, N) -> a loop of it (the first drafted, for a peer's)
    for key in cells:
        by_method.setdefault((key[0], key[1], key[3], key[4]), key)
    rows = []
    for key, by_round in cells.items():
        T, seed, draft, method, n = key
        mine = [r for k in sorted(by_round) for r in requests[key].get(k, [])]
        steps = [s for r in mine for s in res.steps.get(cell_id(r["cell"]), [])]
        tokens, wall = sum(c["tokens"] for c in by_round.values()), sum(c["wall_s"] for c in by_round.values())
        row = LoopRow(T, n, draft, method, sum(c["requests"] for c in by_round.values()), tokens, wall,
                      tokens / wall if wall > 0 else NAN,
                      tuple(1000 * x for x in _quantiles([r.get("tpot_s") for r in mine])),
                      tuple(1000 * x for x in _quantiles([r.get("ttft_s") for r in mine])),
                      mean_accepted_length(steps) if steps else NAN, _mean(s["drafted"] for s in steps),
                      sum(c.get("errors", 0) for c in by_round.values()),
                      any(contended(c) for c in by_round.values()), rounds=len(by_round))
        for column, _, base_method in LOOP_BASELINES:
            base = by_method.get((T, seed, base_method, n))
            if base:
                row.vs[column], row.ci[column] = _loop_ratio(key, base, cells, requests)
        own = (T, seed, draft, method, 1)
        if own in cells and n != 1:
            row.vs["vs_own_1"], row.ci["vs_own_1"] = _loop_ratio(key, own, cells, requests)
        plain = by_method.get((T, seed, "ar", 1))
        if plain and n != 1 and method != "ar":  # ar's own is the column before
            row.vs["vs_ar_1"], row.ci["vs_ar_1"] = _loop_ratio(key, plain, cells, requests)
        rows.append(row)
    order = {name: i for i, name in enumerate(res.header.get("config", {}).get("methods", []))}
    rows.sort(key=lambda r: (r.T, r.concurrency, order.get(r.method, 99), r.draft))
    return rows


def _loop_ratio(mine: tuple, base: tuple, cells: dict, requests: dict) -> tuple[float, tuple[float, float]]:
    """The ratio of two loops' throughputs over the rounds both ran, and its interval (see ``loop_summary``)."""
    shared = sorted(set(cells[mine]) & set(cells[base]))
    by_prompt = [({r["cell"]["prompt"]: r for r in requests[mine].get(k, [])},
                  {r["cell"]["prompt"]: r for r in requests[base].get(k, [])}) for k in shared]
    both = set.intersection(*(set(a) & set(b) for a, b in by_prompt)) if by_prompt else set()
    prompts = [p for p in by_prompt[0][0] if p in both] if by_prompt else []  # the first round's order
    rounds = [(cells[mine][k]["throughput"], cells[base][k]["throughput"],
               [a[p]["tokens"] for p in prompts], [a[p]["latency_s"] for p in prompts],
               [b[p]["tokens"] for p in prompts], [b[p]["latency_s"] for p in prompts])
              for k, (a, b) in zip(shared, by_prompt)]
    est, low, high = ratio_of_loops(rounds)
    return est, (low, high)


def table_loops(rows: list[LoopRow]) -> str:
    """Closed loops: throughput against concurrency, each ratio with its interval, and what a request waits (with
    ``--rounds``, requests count every round's)."""
    cols = [(c, label) for c, label, _ in LOOP_BASELINES if any(c in r.vs for r in rows)]
    own = any("vs_own_1" in r.vs for r in rows)
    plain = any("vs_ar_1" in r.vs for r in rows)
    rounds = any(r.rounds > 1 for r in rows)
    head = ["T", "N", "method", "draft", "requests", *(["rounds"] if rounds else []), "tokens/s",
            *[label for _, label in cols], *(["vs itself at N = 1"] if own else []),
            *(["vs ar at N = 1"] if plain else []), "TPOT ms (p50 / p90)",
            "TTFT ms (p50 / p90)", "accepted length", "errors"]
    body = [[f"{r.T:g}", str(r.concurrency), r.method, r.draft, str(r.requests), *([str(r.rounds)] if rounds else []),
             _f(r.throughput, ".1f") + (" (busy machine)" if r.contended else ""),
             *[r.show(c, ".2f", "x") for c, _ in cols], *([r.show("vs_own_1", ".2f", "x")] if own else []),
             *([r.show("vs_ar_1", ".2f", "x")] if plain else []),
             f"{_f(r.tpot_ms[0], '.1f')} / {_f(r.tpot_ms[1], '.1f')}",
             f"{_f(r.ttft_ms[0], '.0f')} / {_f(r.ttft_ms[1], '.0f')}", _f(r.mean_accepted_length), str(r.errors)]
            for r in rows]
    return markdown(head, body)


def report(res: Results) -> str:
    """The standard summary of a results file (Markdown)."""
    if res.cells and not any(r["cell"].get("concurrency") is None for r in res.prompts):
        parts = [f"Results of {res.describe()}", ""]
        if res.header.get("notes"):
            parts += ["Left out: " + "; ".join(res.header["notes"]) + ".", ""]
        return "\n".join(parts + ["Closed loops (N requests in flight):", "", table_loops(loop_summary(res))])
    rows = summarize(res)
    _, left_out = usable(res)
    parts = [f"Results of {res.describe()}", ""]
    if res.header.get("notes"):
        parts += ["Left out: " + "; ".join(res.header["notes"]) + ".", ""]
    if left_out:
        parts += [f"{left_out} of {len(res.prompts)} cells are left out: they ran while other work used more than a "
                  "quarter of a core (their records say so).", ""]
    elif res.prompts and all(contended(r) for r in res.prompts):
        parts += ["Every cell of this run ran while other work used more than a quarter of a core: its speeds are "
                  "not to be trusted (acceptance figures are unaffected).", ""]
    parts += [table_summary(rows)]
    cats = summarize(res, by_category=True)
    if len({r.category for r in cats}) > 1:
        parts += ["", "Speedup over `ar` by category:", "", table_categories(cats)]
    if width_series(rows) and any(len(s) > 1 for s in width_series(rows).values()):
        parts += ["", "Accepted length as the width N grows at fixed depth:", "", table_width(rows)]
    shadows = shadow_summary(res)
    if shadows:
        parts += ["", "Shadow verifiers on the steps each method drove (same drafts and target probabilities):", "",
                  table_shadow(shadows)]
    if res.audits:
        parts += ["", "Exactness audit (exhaustive, small random cases):", "", table_audit(res.audits)]
    return "\n".join(parts)
