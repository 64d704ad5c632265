"""PNG figures from a results file: per-candidate acceptance (ResiSpec Figure 1), accepted length as the
number of candidates grows (Table 5), speedup by task category, and the per-step latency split (Figure 3).
Each figure carries the command and machine it came from."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from .records import NO_DRAFT, Results
from .report import Row, ShadowRow, loop_summary, summarize, width_series


def _pyplot():
    import matplotlib  # noqa: PLC0415 - matplotlib takes about 0.5 s to import; only plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib takes about 0.5 s to import; only plots need it

    return plt


def _label(r: Row) -> str:
    return r.method if r.draft == NO_DRAFT else f"{r.method} ({r.draft})"


def _finish(fig, res: Results | str, path: Path) -> Path:
    """Caption the figure with its source (a results file, or the description of several) and save it."""
    source = res if isinstance(res, str) else res.describe()
    caption = "\n".join(textwrap.wrap("Source: " + source.replace("`", ""), 150))
    fig.text(0.01, 0.005, caption, fontsize=6, va="bottom", ha="left", color="0.35")
    fig.tight_layout(rect=(0, 0.03 + 0.012 * caption.count("\n"), 1, 1))
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def _panels(temperatures):
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.2 * len(temperatures), 4.2), squeeze=False)
    return fig, dict(zip(temperatures, axes[0]))


def per_candidate(res: Results, path: Path, rows: list[Row]) -> Path | None:
    rows = [r for r in rows if len(r.per_candidate) > 1]
    if not rows:
        return None
    fig, ax = _panels(sorted({r.T for r in rows}))
    for r in rows:
        xs = [i + 1 for i, x in enumerate(r.per_candidate) if not math.isnan(x)]
        ax[r.T].plot(xs, [r.per_candidate[i - 1] for i in xs], marker="o", label=_label(r))
    for t, a in ax.items():
        a.set(title=f"T = {t:g}", xlabel="candidate i", ylabel="P(accept i | 1..i-1 rejected)", ylim=(0, 1))
        a.xaxis.get_major_locator().set_params(integer=True)
        a.legend(fontsize=7)
    return _finish(fig, res, path)


def width(res: Results | str, path: Path, rows: list[Row] | list[ShadowRow]) -> Path | None:
    """Accepted length against the width N of complete trees, with 95 % intervals where the rows have them."""
    series = {k: v for k, v in width_series(rows).items() if len(v) > 1}
    if not series:
        return None
    fig, ax = _panels(sorted({k[0] for k in series}))
    for (t, draft, v, depth), pts in series.items():
        ls = [r.mean_accepted_length for _, _, r in pts]
        cis = [r.ci if isinstance(r, ShadowRow) else r.ci.get("mean_accepted_length", (math.nan, math.nan))
               for _, _, r in pts]
        err = [[max(x - lo, 0) if lo == lo else 0 for x, (lo, _) in zip(ls, cis)],
               [max(hi - x, 0) if hi == hi else 0 for x, (_, hi) in zip(ls, cis)]]
        ax[t].errorbar([n for n, _, _ in pts], ls, yerr=err, marker="o", capsize=3, label=f"{v}, {draft} (depth {depth})")
    for t, a in ax.items():
        a.set(title=f"T = {t:g}", xlabel="candidates per node N", ylabel="mean accepted length (95 % interval)")
        a.xaxis.get_major_locator().set_params(integer=True)
        a.legend(fontsize=7)
    return _finish(fig, res, path)


def categories(res: Results, path: Path) -> Path | None:
    rows = [r for r in summarize(res, by_category=True) if r.category != "all" and r.method != "ar"
            and not math.isnan(r.value("speedup_ar"))]
    cats = list(dict.fromkeys(r.category for r in rows))
    if len(cats) < 2:
        return None
    fig, ax = _panels(sorted({r.T for r in rows}))
    for t, a in ax.items():
        series = list(dict.fromkeys(_label(r) for r in rows if r.T == t))
        w = 0.8 / max(len(series), 1)
        for j, s in enumerate(series):
            vals = {r.category: r.value("speedup_ar") for r in rows if r.T == t and _label(r) == s}
            a.bar([i + j * w for i in range(len(cats))], [vals.get(c, 0) for c in cats], width=w, label=s)
        a.axhline(1.0, color="k", lw=0.8)
        a.set_xticks([i + 0.4 - w / 2 for i in range(len(cats))], cats, rotation=30, ha="right", fontsize=8)
        a.set(title=f"T = {t:g}", ylabel="speedup over plain decoding (ar)")
        a.legend(fontsize=7)
    return _finish(fig, res, path)


def latency(res: Results, path: Path, rows: list[Row]) -> Path | None:
    rows = [r for r in rows if not math.isnan(r.target_ms)]
    if not rows:
        return None
    fig, ax = _panels(sorted({r.T for r in rows}))
    for t, a in ax.items():
        mine = [r for r in rows if r.T == t]
        names = [_label(r) for r in mine]
        bottom = [0.0] * len(mine)
        for part, color in (("draft_ms", "tab:blue"), ("target_ms", "tab:orange"), ("verify_ms", "tab:green")):
            vals = [getattr(r, part) for r in mine]
            a.bar(range(len(mine)), vals, bottom=bottom, color=color,
                  label={"draft_ms": "drafting", "target_ms": "target forward", "verify_ms": "verifier"}[part])
            bottom = [b + v for b, v in zip(bottom, vals)]
        a.set_xticks(range(len(mine)), names, rotation=35, ha="right", fontsize=7)
        a.set(title=f"T = {t:g}", ylabel="ms per step")
        a.legend(fontsize=7)
    return _finish(fig, res, path)


def throughput(res: Results, path: Path) -> Path | None:
    """Closed loops: total tokens per second against the number of requests in flight, one line per method, and
    the 90th percentile time per output token beside it (what batching costs each user)."""
    rows = loop_summary(res)
    if not rows:
        return None
    plt = _pyplot()
    temps = sorted({r.T for r in rows})
    fig, axes = plt.subplots(2, len(temps), figsize=(5.2 * len(temps), 7.4), squeeze=False)
    for col, t in enumerate(temps):
        for label in dict.fromkeys(_loop_label(r) for r in rows if r.T == t):
            mine = sorted((r for r in rows if r.T == t and _loop_label(r) == label), key=lambda r: r.concurrency)
            ns = [r.concurrency for r in mine]
            axes[0][col].plot(ns, [r.throughput for r in mine], marker="o", label=label)
            axes[1][col].plot(ns, [r.tpot_ms[1] for r in mine], marker="o", label=label)
        axes[0][col].set(title=f"T = {t:g}", xlabel="requests in flight", ylabel="tokens/s, all requests")
        axes[1][col].set(xlabel="requests in flight", ylabel="time per output token, p90 (ms)")
        for a in axes[:, col]:
            a.set_xscale("log", base=2)
            a.set_xticks(sorted({r.concurrency for r in rows}), [str(n) for n in sorted({r.concurrency for r in rows})])
            a.legend(fontsize=7)
    return _finish(fig, res, path)


def _loop_label(r) -> str:
    return r.method if r.draft == NO_DRAFT else f"{r.method} ({r.draft})"


def plot_all(results: str | Path, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Write every figure the results file has data for; returns their paths."""
    res = Results.load(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in summarize(res)]
    made = [
        per_candidate(res, out / f"{prefix}per_candidate.png", rows),
        width(res, out / f"{prefix}width.png", rows),
        categories(res, out / f"{prefix}speedup_by_category.png"),
        latency(res, out / f"{prefix}latency.png", rows),
        throughput(res, out / f"{prefix}throughput.png"),
    ]
    return [p for p in made if p is not None]
