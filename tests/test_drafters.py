import pytest
import torch
from conftest import tiny_model

from verispec.drafters import ModelDrafter, NgramDrafter, layer_skip_drafter
from verispec.probs import Sampling, logits_to_probs
from verispec.rng import TorchRandomness
from verispec.tree import Tree


def fresh_q(model, seq, sampling):
    with torch.no_grad():
        return logits_to_probs(model.hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1], sampling)


def node_seq(draft, node):
    path = []
    while node > 0:
        path.append(int(draft.tokens[node]))
        node = draft.tree.parents[node]
    return path[::-1]


@pytest.mark.parametrize("kind", ["model", "layerskip"])
@pytest.mark.parametrize("children", ["iid", "swor", "topk"])
def test_model_drafter_laws_match_a_fresh_forward_across_steps(kind, children):
    target = tiny_model("qwen2", layers=4)
    drafter = ModelDrafter(tiny_model("llama", seed=3, layers=2)) if kind == "model" else layer_skip_drafter(target, [1, 3])
    sampling, rng = Sampling(1.0), TorchRandomness(0)
    context = [4, 9, 16, 25]
    drafter.reset(context)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        draft = drafter.propose(context, Tree.complete(2, 3), sampling, children, rng)
        for node in range(draft.tree.size):
            if draft.tree.children[node]:
                ref = fresh_q(drafter.model, context + node_seq(draft, node), sampling)
                assert torch.allclose(draft.q[node], ref, atol=1e-5), (step, node)
        # accept a random root-to-node path, then a recovered token
        end = int(torch.randint(0, draft.tree.size, (1,), generator=gen))
        path = [n for n in range(1, draft.tree.size) if n in set(_ancestors(draft.tree, end))]
        drafter.commit(draft, path)
        context = context + [int(draft.tokens[n]) for n in path] + [int(torch.randint(3, 90, (1,), generator=gen))]


def _ancestors(tree, node):
    out = []
    while node > 0:
        out.append(node)
        node = tree.parents[node]
    return out


def test_children_modes():
    drafter = layer_skip_drafter(tiny_model("llama", layers=4), 2)
    for mode, distinct in (("iid", False), ("swor", True), ("topk", True)):
        drafter.reset([4, 9])
        d = drafter.propose([4, 9], Tree.complete(3, 1), Sampling(1.0), mode, TorchRandomness(1))
        toks = d.tokens[1:].tolist()
        assert len(toks) == 3
        if distinct:
            assert len(set(toks)) == 3
        q = d.q[0]
        if mode == "iid":
            assert d.child_prob[1:].tolist() == pytest.approx([float(q[t]) for t in toks])
        if mode == "swor":  # q(x2) / (1 - q(x1)), ...
            assert float(d.child_prob[2]) == pytest.approx(float(q[toks[1]] / (1 - q[toks[0]])))
        if mode == "topk":
            assert toks == torch.topk(q, 3).indices.tolist() and d.child_prob[1:].tolist() == [1, 1, 1]
        drafter.commit(d, [])


def test_ngram_lookup_uses_the_longest_earlier_match():
    ng = NgramDrafter(vocab_size=10, max_n=2)
    # suffix (3, 4) occurred once, followed by 5; the 1-gram (4) was followed by 5 and 7: the 2-gram wins
    logits = ng._root_logits([3, 4, 5, 1, 4, 7, 3, 4])
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [5]
    # no earlier occurrence of 9: no draft at all
    assert ng._root_logits([1, 2, 9]) is None
    d = ng.propose([1, 2, 9], Tree.chain(3), Sampling(1.0), "iid", TorchRandomness(0))
    assert d.tree.size == 1


def test_ngram_lookup_law_is_the_count_over_the_context_and_the_drafted_path():
    """The lookup's index, kept step by step, gives each node the law of a search of every position of (context +
    drafted path): the tokens that followed the longest earlier match of its suffix, by count; and its match for
    ``confidence``. Contexts grow by steps, restart, and drafted paths of 0-4 tokens repeat them or not."""
    import collections
    import math

    def searched(seq, max_n, min_n):
        for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
            after = [seq[i + n] for i in range(len(seq) - n) if seq[i:i + n] == seq[-n:]]
            if after:
                return n, collections.Counter(after)
        return None

    gen = torch.Generator().manual_seed(1)
    for max_n, min_n in ((3, 1), (4, 2), (2, 2)):
        ng = NgramDrafter(7, max_n, min_n)
        for _ in range(4):
            seq = torch.randint(0, 5, (50,), generator=gen).tolist()
            length = 1
            while length < len(seq):
                context = seq[:length]
                for _ in range(3):
                    path = torch.randint(0, 5, (int(torch.randint(0, 5, (), generator=gen)),), generator=gen).tolist()
                    if not path:  # a path that copies the context's own continuation of an earlier match
                        path = seq[length:length + 3]
                    for cut in range(len(path) + 1):
                        want = searched(context + path[:cut], max_n, min_n)
                        row = ng._root_logits(context) if cut == 0 else \
                            ng._node_logits(_path_growing(context[-1], path[:cut]), [cut])[0]
                        node = cut
                        if want is None:
                            assert row is None or not torch.isfinite(row).any()
                            continue
                        n, counts = want
                        expected = torch.full((7,), float("-inf"))
                        for x, c in counts.items():
                            expected[x] = math.log(c)
                        assert torch.equal(row, expected.float()), (context, path[:cut])
                        assert ng._match[node] == (n, float(max(counts.values())), float(sum(counts.values())))
                length += 1 + int(torch.randint(0, 4, (), generator=gen))


def _path_growing(root: int, path: list[int]):
    """A growing chain root -> path[0] -> ... (node i is path[i - 1]), as ``_grow`` would hold it."""
    from verispec.drafters.base import _Growing

    return _Growing(parents=[-1] + list(range(len(path))), tokens=[root, *path], tree_node=[0] * (len(path) + 1),
                    q_rows={}, child_prob=[1.0] * (len(path) + 1))


def test_ngram_draft_continues_the_repeated_pattern():
    ng = NgramDrafter(vocab_size=10, max_n=3)
    ctx = [1, 2, 3, 4, 1, 2]
    d = ng.propose(ctx, Tree.chain(3), Sampling(0.0), "topk", TorchRandomness(0))
    assert d.tokens.tolist() == [2, 3, 4, 1]  # root 2, then the tokens that followed "1 2" before


def test_model_drafter_can_draft_twice_from_the_same_context():
    drafter = layer_skip_drafter(tiny_model("llama", layers=4), 2)
    context = [4, 9, 16, 25]
    drafter.reset(context)
    a = drafter.propose(context, Tree.complete(2, 2), Sampling(1.0), "topk", TorchRandomness(0))
    drafter.commit(a, [])
    b = drafter.propose(context, Tree.complete(2, 2), Sampling(1.0), "topk", TorchRandomness(0))
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.q, b.q, atol=1e-6)


def test_ngram_confidence_grows_with_the_length_and_count_of_the_match():
    from verispec.drafters.ngram import NgramDrafter

    d = NgramDrafter(50)

    def root_confidence(context):
        logits = d._root_logits(context)
        return float(d.confidence([0], logits[None])[0])

    repeated = root_confidence([1, 2, 3, 4] * 4 + [1, 2, 3])  # "1 2 3" seen 3 times before, always then 4
    once = root_confidence([1, 2, 3, 4, 9, 2, 3])  # "2 3" once
    unigram = root_confidence([7, 8, 9, 6, 5, 9])  # only "9" matches, followed by 6 once
    assert repeated == 1.0 and 0 < unigram < once < repeated
    assert d._root_logits([1, 2, 3, 4]) is None  # no match: no draft at all


def test_greedy_drafts_skip_the_temperature_one_laws_only_for_policies_that_never_read_them():
    from verispec.policies import AdaEDL, AutoDepth, Fixed

    context = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    drafts = {}
    for name, policy in (("fixed", Fixed()), ("auto", AutoDepth()), ("adaedl", AdaEDL(lam=0.0))):
        d = NgramDrafter(vocab_size=10, max_n=3).propose(context, Tree.chain(3), Sampling(0.0), "iid",
                                                         TorchRandomness(0), policy)
        drafts[name] = d
    assert drafts["fixed"].soft_q is None and drafts["auto"].soft_q is None
    assert drafts["adaedl"].soft_q is not None  # AdaEDL judges the temperature-1 laws
    assert drafts["fixed"].tokens.tolist() == drafts["adaedl"].tokens.tolist() == [2, 3, 4, 1]
    assert torch.equal(drafts["fixed"].q, drafts["adaedl"].q)


def test_a_sparse_drafts_growth_is_the_dense_growth_on_a_few_tokens():
    """Prompt lookup grows its tree on each row's few tokens (``SparseRows``); the same lookup answering whole rows
    (a subclass with dense hooks) gives the same drafts: tokens, laws and child probabilities, with the same random
    calls, at every kind of sampling and child mode, under a policy and without one. Top-k siblings whose counts tie
    are taken by token id (a dense row's ``torch.topk`` takes ties as it may, so there the two may differ)."""
    from verispec.drafters.base import DraftControl, whole_rows
    from verispec.policies import AutoDepth

    Dense = whole_rows(NgramDrafter)

    assert NgramDrafter.sparse and not Dense.sparse
    gen = torch.Generator().manual_seed(0)
    for sampling in (Sampling(0.0), Sampling(1.0), Sampling(0.6, top_k=2), Sampling(0.8, top_p=0.7)):
        for children, tree in (("iid", Tree.complete(2, 3)), ("swor", Tree.from_branching([3, 2])),
                               ("topk", Tree.chain(4)), ("iid", Tree.chain(5))):
            for control in (None, DraftControl.of(AutoDepth())):
                context = torch.randint(0, 6, (40,), generator=gen).tolist()
                a = NgramDrafter(9).propose(context, tree, sampling, children, TorchRandomness(5), control)
                b = Dense(9).propose(context, tree, sampling, children, TorchRandomness(5), control)
                assert a.num_drafted > 0 and _by_path(a) == _by_path(b)
        context = torch.randint(0, 6, (40,), generator=gen).tolist()
        wide = NgramDrafter(9).propose(context, Tree.from_branching([3, 2]), sampling, "topk", None)
        dense = Dense(9)
        for node in range(wide.tree.size):
            kids = [int(wide.tokens[c]) for c in wide.tree.children[node]]
            if kids:  # the highest counts, ties by token id
                path = [int(wide.tokens[n]) for n in _path_nodes(wide, node)]
                row = dense._root_logits(context) if not path else \
                    dense._node_logits(_path_growing(context[-1], path), [len(path)])[0]
                best = sorted((-float(row[x]), x) for x in range(9) if torch.isfinite(row[x]))
                assert kids == [x for _, x in best[:len(kids)]]


def _path_nodes(draft, node):
    out = []
    while node > 0:
        out.append(node)
        node = draft.tree.parents[node]
    return out[::-1]


def _by_path(draft):
    """A draft's nodes by their token paths from the root: (its law, its child probability), rounded."""
    out = {}
    for node in range(draft.tree.size):
        path, n = [], node
        while n > 0:
            path.append(int(draft.tokens[n]))
            n = draft.tree.parents[n]
        out[tuple(path[::-1])] = (tuple(round(float(x), 6) for x in draft.q[node]), round(float(draft.child_prob[node]), 6))
    return out
