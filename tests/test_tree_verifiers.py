"""Tree verifiers: exact output law on small trees, reduction to chain sampling, negative control."""

import pytest
import torch

from verispec.audit import random_tables, step_law, target_law, tv_and_kl, verifier_law
from verispec.probs import residual
from verispec.tree import Tree
from verispec.verifiers import get_verifier
from verispec.verifiers.base import VerifierSpec, walk_tree

RULES = {"specinfer": "iid", "swor": "swor", "topk": "topk"}
SHAPES = [Tree.complete(2, 1), Tree.complete(3, 1), Tree.from_branching([2, 1]), Tree.from_paths([(0,), (1,), (0, 0), (0, 1)])]


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda t: str(t.parents))
@pytest.mark.parametrize("seed", range(4))
def test_tree_verifiers_are_exact(name, shape, seed):
    V = 4 if shape.size <= 4 else 3
    p, q = random_tables(V, 100 + seed, concentration=0.6, sparsity=0.25 if seed % 2 else 0.0)
    law = verifier_law(get_verifier(name), p, q, shape, V, children=RULES[name])
    tv, kl = tv_and_kl(target_law(p, (0,), shape.max_depth + 1, V), law)
    assert tv < 1e-12 and abs(kl) < 1e-12


@pytest.mark.parametrize("name", list(RULES))
def test_on_a_chain_every_tree_verifier_is_chain_sampling(name):
    p, q = random_tables(4, 7)
    for g in (1, 2):
        a = step_law(get_verifier(name), p, q, Tree.chain(g), children=RULES[name])
        b = step_law(get_verifier("chain"), p, q, Tree.chain(g), children=RULES[name])
        assert a.keys() == b.keys()
        assert max(abs(a[k] - b[k]) for k in a) < 1e-14


def _mss_skipping_duplicates(draft, p, rng):
    """Negative control: MSS that skips a repeated rejected token instead of updating the residual."""

    def rule(draft, node, r, rng):
        q, seen = draft.q[node], set()
        for rank, child in enumerate(draft.tree.children[node]):
            x = int(draft.tokens[child])
            if x in seen:
                continue
            seen.add(x)
            if bool(rng.bernoulli(torch.tensor(min(1.0, float(r[x] / q[x]))))):
                return rank, None
            r = residual(r, q)
        return None, r

    return walk_tree(draft, p, rng, rule)


def test_audit_flags_mss_that_skips_duplicates():
    spec = VerifierSpec("mss-skip-dup", _mss_skipping_duplicates, exact=False, note="negative control")
    worst = 0.0
    for seed in range(5):
        p, q = random_tables(3, seed, concentration=0.5)
        law = verifier_law(spec, p, q, Tree.complete(3, 1), 3, children="iid")
        worst = max(worst, tv_and_kl(target_law(p, (0,), 2, 3), law)[0])
    assert worst > 1e-3


def test_swor_always_accepts_when_the_draft_support_fits():
    # supp(p) within supp(q) and |supp(q)| <= k: some child is always accepted (ALGORITHMS.md section 4)
    p_ = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q_ = torch.tensor([0.9, 0.1, 0.0], dtype=torch.float64)
    law = step_law(get_verifier("swor"), lambda s: p_, lambda s: q_, Tree.complete(2, 1), children="swor")
    assert sum(w for seq, w in law.items() if len(seq) == 1) == pytest.approx(0.0, abs=1e-15)
