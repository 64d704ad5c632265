"""SpecHub's hub pairs and its transport rule (verispec/verifiers/spechub.py): the pairs' law, the rule's law (the
exhaustive audit of every exact verifier covers it too, in tests/test_exactness.py), its acceptance against the
optimum for its pairs, and the closed forms the real-model comparison uses."""

from __future__ import annotations

import itertools

import pytest
import torch

from verispec.audit import random_tables, target_law, tv_and_kl, verifier_law
from verispec.audit.law import enumerate_outcomes, node_acceptance
from verispec.audit.optimum import alpha_star_hub, swor_acceptance_k2
from verispec.audit.run import PAIR_SHAPES, format_pairs, pair_rows
from verispec.drafters.base import _draw_children
from verispec.errors import VerispecError
from verispec.methods import resolve
from verispec.tree import Tree
from verispec.verifiers import check, get_verifier
from verispec.verifiers.spechub import hub_acceptance


def _node(vocab, seed, **kw):
    p, q = random_tables(vocab, seed, **kw)
    return p(()), q(())


def test_hub_pairs_always_hold_the_hub_with_specHubs_pair_law():
    q = torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64)
    law = {}
    for w, (xs, probs) in enumerate_outcomes(lambda rng: _draw_children(q, q.log(), 2, "hub", rng)):
        law[tuple(xs)] = law.get(tuple(xs), 0.0) + w
        assert probs[0] == pytest.approx(float(q[xs[0]]))
    a, off = 1, 1 - 0.5
    expected = {**{(i, a): float(q[i]) for i in (0, 2, 3)}, **{(a, i): 0.5 * float(q[i]) / off for i in (0, 2, 3)}}
    assert law.keys() == expected.keys()
    for pair, w in expected.items():
        assert law[pair] == pytest.approx(w, abs=1e-12)


@pytest.mark.parametrize("name", ["spechub", "traversal", "match"])
def test_the_rules_that_take_hub_pairs_keep_the_target_law_on_every_pair_tree(name):
    """``traversal`` takes any child mode: its law of a hub pair's second child is the hub after any other first
    token, ``q`` without the hub after the hub (with ``q`` there it is biased, total variation up to 0.04)."""
    spec = get_verifier(name)
    for i, tree in enumerate(PAIR_SHAPES * 3):
        p, q = random_tables(4, 300 + i, concentration=(0.3, 0.7, 1.5)[i % 3], sparsity=(0.0, 0.3)[i % 2])
        law = verifier_law(spec, p, q, tree, 4, children="hub", context=(0,))
        tv, kl = tv_and_kl(target_law(p, (0,), tree.max_depth + 1, 4), law)
        assert tv < 1e-12, (tree, tv)


def test_with_the_hub_coins_against_the_wrong_mass_the_rule_would_lose_the_law():
    """The test above can fail: the hub stages' pooled coins against twice the refused pairs' mass (so the hub is
    accepted less than the residual assumes) give a biased law, which the enumeration sees."""
    from verispec.verifiers import spechub

    spec = get_verifier("spechub")
    p, q = random_tables(4, 7, concentration=0.7)
    tree = Tree.complete(2, 1)
    exact = verifier_law(spec, p, q, tree, 4, children="hub", context=(0,))
    original = spechub.hub_stages

    def doubled(p_, q_):
        a, q1, q2, r1, r2, refused1, refused2 = original(p_, q_)
        return a, q1, q2, r1, r2, 2 * refused1, 2 * refused2
    spechub.hub_stages = doubled
    try:
        broken = verifier_law(spec, p, q, tree, 4, children="hub", context=(0,))
    finally:
        spechub.hub_stages = original
    assert float((exact - broken).abs().sum()) > 1e-3


def test_spechub_attains_the_optimum_of_its_pairs_and_the_closed_forms_match_enumeration():
    spec = get_verifier("spechub")
    for seed in range(30):
        p, q = _node(5, 900 + seed, concentration=(0.3, 0.7, 1.5)[seed % 3], sparsity=(0.0, 0.3)[seed % 2])
        enumerated = node_acceptance(spec, p, q, 2, "hub")
        assert hub_acceptance(p, q) == pytest.approx(enumerated, abs=1e-12)
        assert alpha_star_hub(p, q) == pytest.approx(enumerated, abs=1e-12)
        assert swor_acceptance_k2(p, q) == pytest.approx(node_acceptance(get_verifier("swor"), p, q, 2, "swor"),
                                                         abs=1e-12)


def test_alpha_star_hub_is_the_max_flow_of_the_pairs_by_brute_force():
    """``min_H [p(H) + Q(pairs not inside H)]`` over every set of tokens, with the pair law enumerated."""
    for seed in range(20):
        p, q = _node(5, 40 + seed, concentration=0.5, sparsity=0.2)
        pairs = {}
        for w, (xs, _) in enumerate_outcomes(lambda rng: _draw_children(q, q.log(), 2, "hub", rng)):
            pairs[frozenset(xs)] = pairs.get(frozenset(xs), 0.0) + w
        brute = min(float(p[list(h)].sum()) + sum(w for s, w in pairs.items() if not s <= set(h))
                    for r in range(6) for h in itertools.combinations(range(5), r))
        assert alpha_star_hub(p, q) == pytest.approx(brute, abs=1e-12)


def test_hub_children_come_in_pairs():
    with pytest.raises(VerispecError, match="at most 2"):
        check(get_verifier("spechub"), Tree.complete(3, 1), "hub")
    with pytest.raises(VerispecError, match="needs --children hub"):
        check(get_verifier("spechub"), Tree.complete(2, 1), "iid")
    q = torch.tensor([0.5, 0.5])
    with pytest.raises(VerispecError, match="at most 2"):
        _draw_children(q, q.log(), 3, "hub", None)
    check(get_verifier("match"), Tree.complete(2, 2), "hub")  # a rule exact whatever the children takes them
    check(get_verifier("traversal"), Tree.complete(2, 2), "hub")
    assert resolve("default", verifier="spechub", tree="2x2").children == "hub"


def test_pair_table_puts_spechub_at_its_optimum():
    rows = {r["verifier"]: r for r in pair_rows(cases=20)}
    assert rows["spechub"]["mean_share_of_optimum"] == pytest.approx(1.0, abs=1e-9)
    assert rows["specinfer"]["mean_share_of_optimum"] <= 1.0 + 1e-12
    assert rows["swor"]["mean_share_of_optimum"] is None
    assert "| spechub | hub | 20 |" in format_pairs(list(rows.values()))
