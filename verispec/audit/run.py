"""The exhaustive audit: exact output law of each verifier on random small cases, against the target's."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch

from ..tree import Tree
from ..verifiers import get_verifier
from ..verifiers.base import VerifierSpec
from .law import node_acceptance, random_tables, target_law, tv_and_kl, verifier_law
from .optimum import alpha_star_hub, alpha_star_iid

TREE_SHAPES = [  # depth <= 3, branching <= 3
    Tree.complete(2, 1), Tree.complete(3, 1), Tree.from_branching([2, 1]), Tree.from_branching([1, 2]),
    Tree.complete(2, 2), Tree.from_branching([3, 1]), Tree.from_branching([2, 1, 1]),
    Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1)]), Tree.from_branching([1, 1, 2]),
]
CHAIN_SHAPES = [Tree.chain(1), Tree.chain(2), Tree.chain(3)]
PAIR_SHAPES = [t for t in TREE_SHAPES if t.branching <= 2]  # for the hub child mode's pairs



@dataclass(frozen=True)
class AuditRow:
    verifier: str
    claims_exact: bool
    cases: int
    max_tv: float
    max_kl: float
    mean_acceptance: float  # per-node acceptance at the root
    mean_alpha_star: float  # i.i.d. optimum at the root, same cases (for verifiers of i.i.d. children)
    verdict: str

    def as_dict(self) -> dict:
        return asdict(self)


def audit_case(spec: VerifierSpec, index: int, seed: int = 0):
    """One random case for ``spec``: returns (tv, kl, acceptance at the root, alpha* at the root)."""
    rnd = random.Random(seed * 100_003 + index)
    shapes = CHAIN_SHAPES if spec.chain_only else PAIR_SHAPES if spec.children == "hub" else TREE_SHAPES
    tree = shapes[index % len(shapes)]
    vocab = rnd.choice([3, 4, 5, 6] if tree.size <= 4 else [3, 4])
    children = spec.modes[index % len(spec.modes)]
    if children == "hub" and tree.branching > 2:  # hub children come in pairs
        children = spec.default_children
    p, q = random_tables(vocab, seed * 7919 + index, concentration=rnd.choice([0.3, 0.7, 1.5]),
                         sparsity=rnd.choice([0.0, 0.0, 0.3]))
    if spec.greedy_only:
        dense = p
        p = lambda prefix: torch.nn.functional.one_hot(dense(prefix).argmax(), vocab).double()  # noqa: E731
    ctx = (0,)
    law = verifier_law(spec, p, q, tree, vocab, children=children, context=ctx)
    tv, kl = tv_and_kl(target_law(p, ctx, tree.max_depth + 1, vocab), law)
    k = len(tree.children[0])
    acc = node_acceptance(spec, p(ctx), q(ctx), k, children) if not spec.greedy_only else float("nan")
    star = alpha_star_iid(p(ctx), q(ctx), k) if spec.children == "iid" else float("nan")
    return tv, kl, acc, star


def verdict(claims_exact: bool, max_tv: float, tol: float) -> str:
    if claims_exact:
        return "exact" if max_tv < tol else "FAIL: claims exact, is biased"
    return "biased (as labelled)" if max_tv >= tol else "no bias found (labelled inexact)"


def audit(specs: list[VerifierSpec], cases: int = 50, seed: int = 0, tol: float = 1e-12, progress=None) -> list[AuditRow]:
    rows = []
    for spec in specs:
        tvs, kls, accs, stars = [], [], [], []
        for i in range(cases):
            tv, kl, acc, star = audit_case(spec, i, seed)
            tvs.append(tv)
            kls.append(kl)
            accs.append(acc)
            stars.append(star)
            if progress is not None:
                progress(spec.name, i + 1, cases)
        max_tv = max(tvs)
        rows.append(AuditRow(
            verifier=spec.name, claims_exact=spec.exact, cases=cases, max_tv=max_tv,
            max_kl=max(kls), mean_acceptance=_nanmean(accs), mean_alpha_star=_nanmean(stars),
            verdict=verdict(spec.exact, max_tv, tol),
        ))
    return rows


def _nanmean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def format_table(rows: list[AuditRow]) -> str:
    lines = ["| verifier | claims exact | cases | max TV | max KL | mean per-node acceptance | mean alpha*_iid | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        star = "-" if math.isnan(r.mean_alpha_star) else f"{r.mean_alpha_star:.4f}"
        acc = "-" if math.isnan(r.mean_acceptance) else f"{r.mean_acceptance:.4f}"
        lines.append(f"| {r.verifier} | {'yes' if r.claims_exact else 'no'} | {r.cases} | {r.max_tv:.2e} | "
                     f"{r.max_kl:.2e} | {acc} | {star} | {r.verdict} |")
    return "\n".join(lines)


def random_node(i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The i-th seeded random node of the optimum tables: ``(p, q, k)`` over 3-5 tokens, k = 2 or 3 candidates in turn,
    every fifth with p close to q (where residual drift is worst)."""
    rnd = random.Random(seed * 100_003 + i)
    vocab, k = rnd.choice([3, 4, 5]), 2 + i % 2
    p, q = (t((0,)) for t in random_tables(vocab, seed * 7919 + i, concentration=rnd.choice([0.3, 0.7, 1.5]),
                                             sparsity=rnd.choice([0.0, 0.0, 0.3])))
    if i % 5 == 4:
        p = (0.9 * q + 0.1 * p) / (0.9 * q + 0.1 * p).sum()
    return p, q, k


PAIR_RULES = (("specinfer", "iid"), ("reserve", "iid"), ("swor", "swor"), ("spechub", "hub"))


def pair_rows(cases: int = 100, seed: int = 0) -> list[dict]:
    """Two candidates a node, each rule with the children it is made for (``PAIR_RULES``), on the random nodes of
    ``never_lose_rows`` (k = 2 for all): its exact acceptance (enumerated), its share of the best acceptance any exact
    rule has with the same children's law (``alpha*_iid`` for i.i.d. pairs, ``alpha*_hub`` for SpecHub's; none is
    computed here for pairs without replacement), and node by node against ``specinfer`` (i.i.d. pairs, SpecHub's
    "RRS") and ``swor`` (its "RRS without replacement")."""
    nodes = [random_node(i, seed)[:2] for i in range(cases)]
    acc = {name: [node_acceptance(get_verifier(name), p, q, 2, children) for p, q in nodes]
           for name, children in PAIR_RULES}
    rows = []
    for name, children in PAIR_RULES:
        best = [alpha_star_iid(p, q, 2) if children == "iid" else alpha_star_hub(p, q) if children == "hub" else None
                for p, q in nodes]
        shares = [a / b if b > 1e-12 else 1.0 for a, b in zip(acc[name], best) if b is not None]
        rows.append({"verifier": name, "children": children, "cases": cases,
                     "mean_acceptance": sum(acc[name]) / cases,
                     "mean_share_of_optimum": sum(shares) / len(shares) if shares else None,
                     "worst_share_of_optimum": min(shares) if shares else None,
                     **{f"{other}_{word}": sum(test(a, b) for a, b in zip(acc[name], acc[other]))
                        for other in ("specinfer", "swor") for word, test in (
                            ("above", lambda a, b: a > b + 1e-9), ("below", lambda a, b: a < b - 1e-9))},
                     "mean_gain_over_specinfer": sum(a - b for a, b in zip(acc[name], acc["specinfer"])) / cases})
    return rows


def format_pairs(rows: list[dict]) -> str:
    def share(x):
        return "-" if x is None else f"{x:.4f}"
    lines = ["| verifier | children | nodes | mean acceptance | mean share of its children's optimum | worst share | "
             "nodes above / below specinfer | nodes above / below swor | mean gain over specinfer |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['verifier']} | {r['children']} | {r['cases']} | {r['mean_acceptance']:.4f} | "
              f"{share(r['mean_share_of_optimum'])} | {share(r['worst_share_of_optimum'])} | "
              f"{r['specinfer_above']} / {r['specinfer_below']} | {r['swor_above']} / {r['swor_below']} | "
              f"{r['mean_gain_over_specinfer']:+.4f} |" for r in rows]
    return "\n".join(lines)


def never_lose_rows(specs: list[VerifierSpec], cases: int = 100, seed: int = 0) -> list[dict]:
    """Per exact rule over i.i.d. children, on random small (p, q) with k = 2 and 3 candidates (exact acceptance by
    enumeration): nodes where it accepts less than ``specinfer``, nodes where k candidates accept less than k - 1,
    and its mean and worst share of the i.i.d. optimum ``alpha*_iid`` (the most any exact rule can accept)."""
    base = get_verifier("specinfer")
    rows = []
    cache: dict[tuple, float] = {}
    for spec in specs:
        worse = fewer = 0
        shares = []
        for i in range(cases):
            p, q, k = random_node(i, seed)
            key = (i, k)
            if key not in cache:
                cache[key] = node_acceptance(base, p, q, k)
            acc, acc_less = node_acceptance(spec, p, q, k), node_acceptance(spec, p, q, k - 1)
            worse += acc < cache[key] - 1e-9
            fewer += acc < acc_less - 1e-9
            star = alpha_star_iid(p, q, k)
            shares.append(acc / star if star > 1e-12 else 1.0)  # no exact rule can accept: nothing is lost
        rows.append({"verifier": spec.name, "cases": cases, "below_specinfer": worse, "below_fewer_candidates": fewer,
                     "mean_share_of_alpha_star": sum(shares) / len(shares),
                     "worst_share_of_alpha_star": min(shares)})
    return rows


def never_lose_table(specs: list[VerifierSpec], cases: int = 100, seed: int = 0) -> str:
    return format_never_lose(never_lose_rows(specs, cases, seed))


def format_never_lose(rows: list[dict]) -> str:
    lines = ["| verifier | nodes | accepts less than specinfer | k candidates accept less than k - 1 | "
             "mean share of alpha*_iid | worst share |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['verifier']} | {r['cases']} | {r['below_specinfer']} | {r['below_fewer_candidates']} | "
              f"{r['mean_share_of_alpha_star']:.4f} | {r['worst_share_of_alpha_star']:.4f} |" for r in rows]
    return "\n".join(lines)


CHAIN_RULES = ("chain", "block", "traversal", "match", "hsd")  # rules compared on chains against block's optimum


def expected_tokens(law: dict[tuple[int, ...], float]) -> float:
    """Tokens a step emits on average (accepted + the recovered or bonus one), from its exact law (``step_law``)."""
    return sum(w * len(e) for e, w in law.items())


def chain_case(spec: VerifierSpec, p, q, depth: int, vocab: int, children: str) -> tuple[float, float]:
    """(expected tokens a step, total variation from the target's law) of ``spec`` on a chain of ``depth``."""
    from .law import _complete, step_law  # noqa: PLC0415

    tree = Tree.chain(depth)
    law = step_law(spec, p, q, tree, children)
    tv, _ = tv_and_kl(target_law(p, (0,), depth + 1, vocab), _complete(law, p, (0,), depth + 1, vocab))
    return expected_tokens(law), tv


def chain_optimum_rows(specs: list[VerifierSpec], cases: int = 60, seed: int = 0) -> list[dict]:
    """Each chain rule against block verification, the most tokens an exact rule can keep from one drafted chain (Sun et
    al. 2024; Thomas and Pal 2026 without the on-path restriction), on random chains of 2 and 3 drafted tokens over 2-4
    token vocabularies, children drawn from q (``iid``) and top-k (point masses) in turn: expected tokens a step,
    exact by enumeration. Per rule and child mode: its mean and worst share of block's, the cases where it keeps more
    than block (possible only for a rule that is not exact), and its largest total variation from the target's law."""
    block = get_verifier("block")
    rows: dict[tuple[str, str], dict] = {}
    for i in range(cases):
        rnd = random.Random(seed * 100_003 + i)
        depth, vocab, children = 2 + i % 2, rnd.choice([2, 3, 4]), ("iid", "topk")[(i // 2) % 2]
        p, q = random_tables(vocab, seed * 7919 + i, concentration=rnd.choice([0.3, 0.7, 1.5]),
                             sparsity=rnd.choice([0.0, 0.0, 0.3]))
        best, _ = chain_case(block, p, q, depth, vocab, children)
        for spec in specs:
            got, tv = chain_case(spec, p, q, depth, vocab, children)
            row = rows.setdefault((spec.name, children), {
                "verifier": spec.name, "children": children, "claims_exact": spec.exact, "cases": 0, "shares": [],
                "above_block": 0, "max_tv": 0.0})
            row["cases"] += 1
            row["shares"].append(got / best)
            row["above_block"] += got > best + 1e-12
            row["max_tv"] = max(row["max_tv"], tv)
    out = []
    for (name, children), row in sorted(rows.items(), key=lambda kv: ([s.name for s in specs].index(kv[0][0]), kv[0][1])):
        shares = row.pop("shares")
        out.append({**row, "mean_share_of_block": sum(shares) / len(shares), "worst_share_of_block": min(shares),
                    "best_share_of_block": max(shares)})
    return out


def chain_optimum_table(specs: list[VerifierSpec], cases: int = 60, seed: int = 0) -> str:
    return format_chain_optimum(chain_optimum_rows(specs, cases, seed))


def format_chain_optimum(rows: list[dict]) -> str:
    lines = ["| verifier | children | claims exact | chains | mean share of block's tokens | worst share | best share | "
             "chains where it keeps more than block | max TV from the target's law |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['verifier']} | {r['children']} | {'yes' if r['claims_exact'] else 'no'} | {r['cases']} | "
              f"{r['mean_share_of_block']:.4f} | {r['worst_share_of_block']:.4f} | {r['best_share_of_block']:.4f} | "
              f"{r['above_block']} | {r['max_tv']:.2e} |" for r in rows]
    return "\n".join(lines)


def hsd_against_block() -> dict:
    """The smallest case that settles HSD's claim to beat block verification on a chain while exact: two tokens, a
    chain of 2 drawn from q. The first drafted token is likelier under p than q (ratio 1.8), the second less (ratio
    2/3): HSD keeps the whole chain with min(1, 1.8 * 2/3) = 1, block with (1.8 * 2/3) / 1.8 = 2/3. Returns both rules'
    expected tokens a step, the target's law of the first two tokens and each rule's, and their total variation."""
    from .law import _complete, step_law  # noqa: PLC0415

    tables = {"p": {(0,): (0.9, 0.1), (0, 0): (0.4, 0.6), (0, 1): (0.5, 0.5)},
              "q": {(0,): (0.5, 0.5), (0, 0): (0.6, 0.4), (0, 1): (0.5, 0.5)}}

    def table(tag):
        return lambda prefix: torch.tensor(tables[tag].get(prefix, (0.5, 0.5)), dtype=torch.float64)

    p, q = table("p"), table("q")
    target = target_law(p, (0,), 2, 2)
    out = {"p": {str(k): v for k, v in tables["p"].items()}, "q": {str(k): v for k, v in tables["q"].items()},
           "target": target.flatten().tolist()}
    for name in ("block", "hsd"):
        law = step_law(get_verifier(name), p, q, Tree.chain(2), "iid")
        two = _complete(law, p, (0,), 3, 2).sum(-1)  # the first two tokens
        out[name] = {"expected_tokens": expected_tokens(law), "law": two.flatten().tolist(),
                     "tv": tv_and_kl(target, two)[0]}
    return out
