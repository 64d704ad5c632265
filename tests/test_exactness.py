"""Exactness by enumeration, the one suite: every rule that claims exactness has the target's output law (its exact
law computed by enumerating every random outcome in float64, ``verispec.audit``), every known-biased rule and
negative control is flagged, and the laws' side facts hold (reductions to chain sampling, acceptance closed forms,
never accepting less than specinfer). The full audit (200 random cases per rule) and the end-to-end enumerations
are marked slow; CI runs them too. The decoding loop's own law (policies, hybrid drafts, batches) is enumerated by
``audit.law.loop_law`` in the tests of those pieces."""

import dataclasses
import functools
import itertools

import pytest
import torch

from verispec.audit import random_tables, step_law, target_law, tv_and_kl, verifier_law
from verispec.audit.controls import NEGATIVE_CONTROLS
from verispec.audit.law import node_acceptance
from verispec.audit.montecarlo import monte_carlo_node
from verispec.audit.optimum import alpha_star_iid, ordered_acceptance_k2, sequential_acceptance
from verispec.audit.run import CHAIN_RULES, audit, chain_optimum_rows, hsd_against_block, never_lose_rows
from verispec.tree import Tree
from verispec.verifiers import VERIFIERS, get_verifier
from verispec.verifiers.base import Verdict, VerifierSpec, first_child_law
from verispec.verifiers.resispec import resispec_residual, water_fill

FULL_CASES = 200  # random (p, q, tree) cases for each rule that claims exactness (slow)
QUICK_CASES = 20  # the same audit, fewer cases: what `pytest -m "not slow"` checks
FLAG_CASES = 40  # a biased rule needs one case to show it; fewer keep the suite quick (adasd is slow to enumerate)
END_TO_END = {"traversal", "ctl-traversal-no-residual"}  # whole-tree enumeration: audited on fewer cases below
EXACT = [name for name, spec in VERIFIERS.items() if spec.exact and name not in END_TO_END]
BIASED = ["resispec", "hsd", "adasd", "fsd", "typical", "bild", "mix", "budget", *(c for c in NEGATIVE_CONTROLS
                                                                            if c not in END_TO_END)]


@functools.cache  # once per process: a pytest-xdist worker may tear module fixtures down between two of its tests
def audit_rows(cases: int) -> dict:
    specs = [s for s in list(VERIFIERS.values()) + list(NEGATIVE_CONTROLS.values()) if s.name not in END_TO_END]
    exact = [s for s in specs if s.name in EXACT]
    biased = [s for s in specs if s.name not in EXACT]
    return {r.verifier: r for r in audit(exact, cases=cases, seed=1) + audit(biased, cases=FLAG_CASES, seed=1)}


AUDIT_ROWS = pytest.mark.xdist_group("audit-rows")  # asks pytest-xdist to keep the tests reading the rows together


@AUDIT_ROWS
@pytest.mark.parametrize("cases", [QUICK_CASES, pytest.param(FULL_CASES, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", EXACT)
def test_every_exact_verifier_matches_the_target_law(name, cases):
    row = audit_rows(cases)[name]
    assert row.cases == cases
    assert row.max_tv < 1e-12 and abs(row.max_kl) < 1e-12
    assert row.verdict == "exact"


@AUDIT_ROWS
@pytest.mark.parametrize("name", BIASED)
def test_known_biased_rules_are_flagged(name):
    row = audit_rows(QUICK_CASES)[name]
    assert row.max_tv > 1e-3
    assert row.verdict == "biased (as labelled)"


@AUDIT_ROWS
def test_reserve_and_ordered_accept_more_than_specinfer():
    rows = audit_rows(QUICK_CASES)
    mss, res, ordd, star = (rows["specinfer"].mean_acceptance, rows["reserve"].mean_acceptance,
                            rows["ordered"].mean_acceptance, rows["specinfer"].mean_alpha_star)
    assert mss < res <= star + 1e-12 and mss < ordd <= star + 1e-12


def _chain_without_residual(draft, p, rng):
    """Negative control: after a rejection draw from p itself instead of norm((p - q)_+)."""
    g = draft.num_drafted
    x = draft.tokens[1:]
    for i in range(g):
        law = first_child_law(draft, i)
        if not bool(rng.bernoulli(torch.clamp(p[i, x[i]] / law[x[i]], max=1.0))):
            return Verdict(tuple(range(1, i + 1)), int(rng.categorical(p[i])), (1,) * (i + 1))
    return Verdict(tuple(range(1, g + 1)), int(rng.categorical(p[g])), (1,) * g)


def test_the_law_exposes_a_verifier_that_skips_the_residual():
    broken = VerifierSpec("no-residual", _chain_without_residual, exact=False, note="negative control")
    p, q = random_tables(4, 0)
    law = verifier_law(broken, p, q, Tree.chain(2), 4)
    tv, _ = tv_and_kl(target_law(p, (0,), 3, 4), law)
    assert tv > 1e-3
    exact = verifier_law(get_verifier("chain"), p, q, Tree.chain(2), 4)
    assert tv_and_kl(target_law(p, (0,), 3, 4), exact)[0] < 1e-12  # the same case, the real rule


TREE_RULES = {"specinfer": "iid", "swor": "swor", "topk": "topk", "reserve": "iid", "ordered": "iid"}


@pytest.mark.parametrize("name", [*TREE_RULES, "block"])
def test_on_a_chain_every_exact_tree_verifier_is_chain_sampling(name):
    p, q = random_tables(4, 7)
    for g in (1, 2):
        children = TREE_RULES.get(name, "iid")
        a = step_law(get_verifier(name), p, q, Tree.chain(g), children=children)
        b = step_law(get_verifier("chain"), p, q, Tree.chain(g), children=children)
        if name == "block":  # block keeps more tokens jointly: same law, at least as long a step
            assert sum(w * len(s) for s, w in a.items()) >= sum(w * len(s) for s, w in b.items()) - 1e-14
            continue
        assert a.keys() == b.keys()
        assert max(abs(a[k] - b[k]) for k in a) < 1e-14


def test_swor_always_accepts_when_the_draft_support_fits():
    # supp(p) within supp(q), |supp(q)| <= k: a child is always accepted (docs/algorithms.md, "Tree rules over one draft")
    p_ = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q_ = torch.tensor([0.9, 0.1, 0.0], dtype=torch.float64)
    law = step_law(get_verifier("swor"), lambda s: p_, lambda s: q_, Tree.complete(2, 1), children="swor")
    assert sum(w for seq, w in law.items() if len(seq) == 1) == pytest.approx(0.0, abs=1e-15)


def test_published_counterexample_is_biased_for_resispec():
    # p = (.4, .3, .3), q = (.6, .3, .1), one candidate then the shaped residual.
    p_ = torch.tensor([0.4, 0.3, 0.3], dtype=torch.float64)
    q_ = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    # Only x0 = 0 can be rejected (q > p there): Z = .2, r = min(Z q, p) = (.12, .06, .02) already sums to Z;
    # k = p - r with k(x0) = q(x0) gives (R - k)_+ = (0, .06, .02) -> (0, .75, .25).
    assert resispec_residual(p_, q_, 0).tolist() == pytest.approx([0, 0.75, 0.25])
    law = step_law(get_verifier("resispec"), lambda s: p_, lambda s: q_, Tree.chain(1))
    first = [sum(w for seq, w in law.items() if seq[0] == t) for t in range(3)]
    # accepted mass min(p, q) = (.4, .3, .1) plus rejected mass .2 spread as (0, .75, .25)
    assert first == pytest.approx([0.4, 0.45, 0.15], abs=1e-15)
    # the proxy k = (.6, .2, .2) of the published counterexample (docs/algorithms.md) meets the same stated conditions and gives (.4, .4, .2)
    alt_residual = (p_ - torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64)).clamp_min(0)
    alt = torch.minimum(p_, q_) + 0.2 * alt_residual / alt_residual.sum()
    assert alt.tolist() == pytest.approx([0.4, 0.4, 0.2])


def test_water_fill_meets_the_budget_without_exceeding_the_target():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        R = torch.rand(8, generator=gen, dtype=torch.float64)
        R /= R.sum()
        q = torch.rand(8, generator=gen, dtype=torch.float64) * (torch.rand(8, generator=gen) > 0.3)
        q /= q.sum()
        Z = float(torch.rand(1, generator=gen))
        r = water_fill(R, q, Z)
        assert float(r.sum()) == pytest.approx(Z, abs=1e-12)
        assert bool((r <= R + 1e-15).all()) and bool((r >= 0).all())


def test_alpha_star_prefix_rule_matches_brute_force():
    for seed in range(40):
        p, q = random_tables(5, seed, concentration=0.5, sparsity=0.2)
        p, q = p(()), q(())
        for k in (1, 2, 3):
            brute = 1 - max(float(q[list(m)].sum()) ** k - float(p[list(m)].sum())
                            for r in range(6) for m in itertools.combinations(range(5), r))
            assert alpha_star_iid(p, q, k) == pytest.approx(brute, abs=1e-12)


def test_closed_form_acceptance_matches_enumeration():
    for seed in range(10):
        p, q = random_tables(5, 50 + seed, concentration=0.6)
        p, q = p(()), q(())
        for k in (1, 2, 3):
            assert sequential_acceptance(p, q, k, reserve=False) == pytest.approx(
                node_acceptance(get_verifier("specinfer"), p, q, k), abs=1e-12)
            assert sequential_acceptance(p, q, k, reserve=True) == pytest.approx(
                node_acceptance(get_verifier("reserve"), p, q, k), abs=1e-12)


def test_the_one_candidate_rules_accept_their_closed_forms_and_never_more_than_the_optimum():
    """``match`` accepts ``sum_x p(x) (1 - (1 - q(x))^k)``, ``canonical`` ``sum_x min(p(x), Q(x))`` with ``Q`` the
    kept candidate's law; neither beats ``alpha*_iid``, and with one candidate ``canonical`` is speculative sampling
    while ``match`` accepts ``sum_x p(x) q(x)`` (exact acceptance by enumeration)."""
    from verispec.verifiers.match import selected_law

    for seed in range(16):
        p, q = random_tables(5, 120 + seed, concentration=0.6, sparsity=0.2 if seed % 2 else 0.0)
        p, q = p(()), q(())
        for k in (1, 2, 3):
            match = node_acceptance(get_verifier("match"), p, q, k)
            canonical = node_acceptance(get_verifier("canonical"), p, q, k)
            assert match == pytest.approx(float((p * (1 - (1 - q) ** k)).sum()), abs=1e-12)
            assert canonical == pytest.approx(float(torch.minimum(p, selected_law(p, q, k)).sum()), abs=1e-12)
            assert max(match, canonical) <= alpha_star_iid(p, q, k) + 1e-12
        assert node_acceptance(get_verifier("canonical"), p, q, 1) == pytest.approx(
            sequential_acceptance(p, q, 1, reserve=False), abs=1e-12)
        assert node_acceptance(get_verifier("match"), p, q, 1) == pytest.approx(float((p * q).sum()), abs=1e-12)


def test_ordered_k2_takes_the_better_of_priority_testing_and_specinfer():
    for seed in range(10):
        p, q = random_tables(5, 80 + seed, concentration=0.6, sparsity=0.2 if seed % 2 else 0.0)
        p, q = p(()), q(())
        best = max(ordered_acceptance_k2(p, q), sequential_acceptance(p, q, 2, reserve=False))
        assert best == pytest.approx(node_acceptance(get_verifier("ordered"), p, q, 2), abs=1e-12)


@pytest.mark.slow
def test_traversal_is_exact_and_flagged_without_its_residual_update():
    rows = {r.verifier: r for r in audit([VERIFIERS["traversal"]], cases=18, seed=2)
            + audit([NEGATIVE_CONTROLS["ctl-traversal-no-residual"]], cases=6, seed=2)}
    assert rows["traversal"].max_tv < 1e-12 and rows["traversal"].verdict == "exact"
    assert rows["ctl-traversal-no-residual"].max_tv > 1e-3


def test_traversal_on_a_chain_is_block_verification():
    p, q = random_tables(3, 7, concentration=0.7)
    for k in (1, 2, 3):
        a = step_law(get_verifier("traversal"), p, q, Tree.chain(k), "iid")
        b = step_law(get_verifier("block"), p, q, Tree.chain(k), "iid")
        assert a.keys() == b.keys() and all(abs(a[s] - b[s]) < 1e-12 for s in a)


def test_hsd_is_block_verification_but_for_the_whole_chains_coin():
    """With top-k children every prefix ratio is at most 1 and HSD's law is block verification's; with children drawn
    from q it keeps more tokens than block verification (the most an exact rule keeps) exactly where it is biased."""
    for seed in range(4):
        p, q = random_tables(3, 11 + seed, concentration=0.5)
        for k in (1, 2, 3):
            a = step_law(get_verifier("hsd"), p, q, Tree.chain(k), "topk")
            b = step_law(get_verifier("block"), p, q, Tree.chain(k), "topk")
            assert a.keys() == b.keys() and all(abs(a[s] - b[s]) < 1e-12 for s in a)
    case = hsd_against_block()
    assert case["block"]["tv"] < 1e-12 and case["block"]["expected_tokens"] == pytest.approx(2.1)
    assert case["hsd"]["expected_tokens"] == pytest.approx(2.2) and case["hsd"]["tv"] == pytest.approx(0.1)
    assert case["hsd"]["law"] == pytest.approx([0.46, 0.44, 0.05, 0.05])


def test_no_exact_chain_rule_keeps_more_than_block_verification():
    rows = chain_optimum_rows([get_verifier(n) for n in CHAIN_RULES], cases=12, seed=4)
    for r in rows:
        if r["claims_exact"]:
            assert r["above_block"] == 0 and r["max_tv"] < 1e-12
    hsd = {r["children"]: r for r in rows if r["verifier"] == "hsd"}
    assert hsd["iid"]["above_block"] > 0 and hsd["iid"]["max_tv"] > 1e-3
    assert hsd["topk"]["above_block"] == 0 and hsd["topk"]["max_tv"] < 1e-12


def test_reserve_and_ordered_never_accept_less_than_specinfer_or_than_with_fewer_candidates():
    """Random small (p, q), k = 2 and 3 i.i.d. candidates, acceptance by enumeration (p close to q in a fifth of the
    cases, where priority testing loses most); also between alpha*_iid and specinfer, the published failures:
    p = (.4329, .2194, .3477), q = (.4239, .218, .3581) for ordered, p = (0, 1, 0), q = (.02, .96, .02) for reserve."""

    for row in never_lose_rows([get_verifier("reserve"), get_verifier("ordered")], cases=60, seed=3):
        assert row["below_specinfer"] == 0 and row["below_fewer_candidates"] == 0, row
        assert 0.95 < row["mean_share_of_alpha_star"] <= 1 + 1e-12, row
    cases = [((.4329, .2194, .3477), (.4239, .218, .3581)), ((0, 1, 0), (.02, .96, .02))]
    for p_, q_ in cases:
        p, q = (torch.tensor(v, dtype=torch.float64) for v in (p_, q_))
        for name in ("reserve", "ordered"):
            for k in (2, 3):
                acc = node_acceptance(get_verifier(name), p, q, k)
                assert node_acceptance(get_verifier("specinfer"), p, q, k) - 1e-12 <= acc <= alpha_star_iid(p, q, k) + 1e-12


def test_reserve_weighs_deeper_subtrees_and_keeps_its_accepted_length_on_uneven_trees():
    """On trees whose later children are shallower, accepting later costs length: with subtree weights ``reserve``
    keeps at least specinfer's expected accepted length (end-to-end enumeration, so the rule sees the tree)."""
    shapes = [Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1)]), Tree.from_paths([(0,), (1,), (0, 0), (0, 0, 0)])]
    e2e = {n: dataclasses.replace(get_verifier(n), node_rule=None) for n in ("reserve", "specinfer")}
    for i in range(6):
        p, q = random_tables(3, 2000 + i, concentration=(0.3, 0.7, 1.5)[i % 3])
        length = {n: sum(w * len(seq) for seq, w in step_law(spec, p, q, shapes[i % 2], "iid").items())
                  for n, spec in e2e.items()}
        assert length["reserve"] >= length["specinfer"] - 1e-9, (i, length)


@pytest.mark.slow
def test_monte_carlo_passes_exact_rules_and_flags_resispec():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(400, generator=gen) * 3
    p = torch.softmax(logits, 0).double()
    q = torch.softmax(logits + torch.randn(400, generator=gen) * 1.5, 0).double()
    for name in ("specinfer", "reserve", "ordered"):
        r = monte_carlo_node(get_verifier(name), p, q, 2, n_draws=200_000)
        assert not r.biased and r.tv < r.noise_bound, name
    bad = monte_carlo_node(get_verifier("resispec"), p, q, 2, n_draws=200_000)
    assert bad.biased and bad.tv > 10 * bad.noise_bound


def test_reserve_and_ordered_stay_exact_when_they_sort_only_part_of_the_vocabulary(monkeypatch):
    """Over a large vocabulary ``reserve`` and ``ordered`` sort only the tokens of the most mass (``SORTED``): the
    rest count as one token in reserve's plan, and follow by id in ordered's priority order. Their laws must stay the
    target's: forced onto the audit's small vocabularies (2 tokens sorted of up to 6), the enumeration finds both
    exact; and on 49,152 tokens reserve's partial plan accepts within 1e-4 of the fully sorted one."""
    import verispec.verifiers.ordered as ordered
    import verispec.verifiers.reserve as reserve
    from verispec.probs import Sampling, logits_to_probs

    monkeypatch.setattr(reserve, "SORTED", 2)
    monkeypatch.setattr(ordered, "SORTED", 2)
    reserve._MEMO.clear()
    for row in audit([get_verifier("reserve"), get_verifier("ordered")], cases=QUICK_CASES, seed=5):
        assert row.max_tv < 1e-12 and row.verdict == "exact", row.verifier
    reserve._MEMO.clear()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(49152, generator=gen) * 3
    q = logits_to_probs(logits[None], Sampling(0.6))[0].double()
    p = logits_to_probs((logits + torch.randn(49152, generator=gen))[None], Sampling(0.6))[0].double()
    monkeypatch.setattr(reserve, "SORTED", 2048)
    partial = sum(reserve.best_plan(p, q, 3)[0])
    monkeypatch.setattr(reserve, "SORTED", 10 ** 9)
    assert abs(sum(reserve.best_plan(p, q, 3)[0]) - partial) < 1e-4
