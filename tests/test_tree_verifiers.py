"""Tree verifiers: exact output law on small trees, reduction to chain sampling, negative control."""

import pytest
import torch

from verispec.audit import random_tables, step_law, target_law, tv_and_kl, verifier_law
from verispec.tree import Tree
from verispec.verifiers import get_verifier

RULES = {"specinfer": "iid", "swor": "swor", "topk": "topk", "reserve": "iid", "ordered": "iid"}
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


@pytest.mark.parametrize("name", [*RULES, "block"])
def test_on_a_chain_every_exact_tree_verifier_is_chain_sampling(name):
    p, q = random_tables(4, 7)
    for g in (1, 2):
        mode = RULES.get(name, "iid")
        a = step_law(get_verifier(name), p, q, Tree.chain(g), children=mode)
        b = step_law(get_verifier("chain"), p, q, Tree.chain(g), children=mode)
        if name == "block":  # block keeps more tokens jointly: same law, at least as long a step
            assert sum(w * len(s) for s, w in a.items()) >= sum(w * len(s) for s, w in b.items()) - 1e-14
            continue
        assert a.keys() == b.keys()
        assert max(abs(a[k] - b[k]) for k in a) < 1e-14


def test_swor_always_accepts_when_the_draft_support_fits():
    # supp(p) within supp(q) and |supp(q)| <= k: some child is always accepted (docs/algorithms.md, "Tree rules over one draft")
    p_ = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q_ = torch.tensor([0.9, 0.1, 0.0], dtype=torch.float64)
    law = step_law(get_verifier("swor"), lambda s: p_, lambda s: q_, Tree.complete(2, 1), children="swor")
    assert sum(w for seq, w in law.items() if len(seq) == 1) == pytest.approx(0.0, abs=1e-15)
