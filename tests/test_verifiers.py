"""What each verifier does on hand-made cases: published numbers, the argmax walk, what it refuses, and the
contract the loop relies on (a root alone is a draw from the target; one ``tested`` entry per depth). Exactness by
enumeration is tests/test_exactness.py."""

import pytest
import torch

from verispec.audit import step_law
from verispec.drafters.base import Draft
from verispec.probs import residual
from verispec.rng import TorchRandomness
from verispec.tree import Tree
from verispec.verifiers import VERIFIERS, get_verifier

V = 4


def test_published_one_position_numbers():
    # p = (.4, .3, .3), q = (.6, .3, .1): accept mass min(p, q) = (.4, .3, .1), residual (0, 0, 1)
    p_ = torch.tensor([0.4, 0.3, 0.3], dtype=torch.float64)
    q_ = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    law = step_law(get_verifier("chain"), lambda s: p_, lambda s: q_, Tree.chain(1))
    first = {}
    for seq, w in law.items():
        first[seq[0]] = first.get(seq[0], 0) + w
    assert [first[i] for i in range(3)] == pytest.approx([0.4, 0.3, 0.3], abs=1e-15)
    assert residual(p_, q_).tolist() == [0, 0, 1]


def _draft(tokens, parents, vocab):
    tree = Tree(tuple(parents))
    return Draft(tree, torch.tensor(tokens), torch.full((tree.size, vocab), 1.0 / vocab), torch.ones(tree.size), "iid")


def test_greedy_walks_the_argmax_child_on_a_tree():
    # root children: 1 (node 1), 3 (node 2); node 2 has child 0 (node 3). argmax: root->3, node2->0, node3->2
    draft = _draft([9, 1, 3, 0], [-1, 0, 0, 2], 4)
    p = torch.nn.functional.one_hot(torch.tensor([3, 1, 0, 2]), 4).float()
    v = get_verifier("greedy")(draft, p, TorchRandomness(0))
    assert v.path == (2, 3) and v.token == 2 and v.tested == (2, 1)


def test_chain_verifier_refuses_trees():
    from verispec.errors import VerispecError

    draft = _draft([9, 1, 3], [-1, 0, 0], 4)
    with pytest.raises(VerispecError, match="chains"):
        get_verifier("chain")(draft, torch.full((3, 4), 0.25), None)


def test_unknown_method_is_a_clear_error():
    from verispec.errors import VerispecError

    with pytest.raises(VerispecError, match="unknown verifier"):
        get_verifier("nope")


@pytest.mark.parametrize("name", sorted(n for n, spec in VERIFIERS.items() if spec.greedy_prefix))
def test_greedy_prefix_verdict_is_the_verifiers_own_at_a_greedy_target(name):
    # step_verdict reads a chain's verdict off the argmaxes at temperature 0 (verifiers.base.greedy_prefix_verdict):
    # the verifier's own on the greedy laws, on random chains with ties, masked tokens, drafted tokens that the
    # target agrees with, and iid drafts whose law gives the drafted token no mass
    from verispec.probs import Sampling, logits_to_probs
    from verispec.verifiers.base import greedy_prefix_verdict, step_verdict

    spec, gen = VERIFIERS[name], torch.Generator().manual_seed(0)
    for case in range(400):
        g, vocab = 1 + case % 4, 5
        logits = torch.randint(0, 3, (g + 1, vocab), generator=gen).float()  # small integers: ties
        logits[torch.rand(g + 1, vocab, generator=gen) < 0.2] = float("-inf")
        logits[:, 0] = 2.5 * (torch.rand(g + 1, generator=gen) < 0.3).float()  # sometimes a lone maximum at 0
        best = logits.argmax(-1)
        guess = torch.randint(0, vocab, (g,), generator=gen)
        x = torch.where(torch.rand(g, generator=gen) < 0.6, best[:g], guess)
        children = "topk" if case % 2 else "iid"
        q = torch.softmax(torch.randn(g + 1, vocab, generator=gen), -1)
        q[torch.rand(g + 1, vocab, generator=gen) < 0.15] = 0
        draft = Draft(Tree.chain(g), torch.cat([torch.tensor([7 % vocab]), x]), q, torch.ones(g + 1), children)
        fast = step_verdict(spec, draft, logits, Sampling(0.0), TorchRandomness(case))
        assert fast == greedy_prefix_verdict(draft, logits)
        slow = spec(draft, logits_to_probs(logits, Sampling(0.0)), TorchRandomness(case))
        assert (fast.path, fast.token, fast.tested, fast.feedback) == (slow.path, slow.token, slow.tested,
                                                                        slow.feedback), case


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_with_nothing_drafted_every_verifier_draws_from_the_target(name):
    # the decoding loop relies on this to skip the verifier on steps with nothing drafted (verifiers.base.draw_root):
    # the same token from the same random calls, nothing tested, nothing learned
    spec = VERIFIERS[name]
    root = Draft(Tree.root_only(), torch.tensor([2]), torch.zeros(1, 7, dtype=torch.float64),
                 torch.ones(1, dtype=torch.float64), "iid")
    for seed in range(8):
        p = torch.softmax(torch.randn(1, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)), -1)
        used, reference = TorchRandomness(seed), TorchRandomness(seed)
        v = spec(root, p, used, spec.new_state() if spec.new_state else None)
        assert (v.path, v.token, v.tested, v.feedback) == ((), int(reference.categorical(p[0])), (), ())
        assert torch.equal(used.generator.get_state(), reference.generator.get_state())


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_tested_counts_one_entry_per_depth_reached(name):
    # per depth: the accepted node's depths, plus the depth where every tested candidate was rejected (if any)
    spec = VERIFIERS[name]
    gen = torch.Generator().manual_seed(0)
    for shape in ("chain:1", "chain:3", "2x2", "3,1"):
        tree = Tree.parse(shape)
        if spec.chain_only and not tree.is_chain or "iid" not in spec.modes and tree.size > 1:
            continue
        for trial in range(25):
            p, q = (torch.softmax(2 * torch.randn(tree.size, 5, dtype=torch.float64, generator=gen), -1)
                    for _ in range(2))
            if spec.greedy_only:
                p = torch.nn.functional.one_hot(p.argmax(-1), 5).double()
            tokens = torch.randint(0, 5, (tree.size,), generator=gen)
            draft = Draft(tree, tokens, q, torch.ones(tree.size, dtype=torch.float64), "iid")
            v = spec(draft, p, TorchRandomness(trial), spec.new_state() if spec.new_state else None)
            assert len(v.tested) in (len(v.path), len(v.path) + 1) and all(t >= 1 for t in v.tested), (shape, v)
