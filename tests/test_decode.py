"""The decoding loop on tiny random models: greedy equivalence, determinism, stopping, errors."""

import pytest
import torch
from conftest import Contrarian, tiny_model

from verispec import Tree, generate, get_verifier
from verispec.drafters import ModelDrafter, NgramDrafter, NoDrafter, RecycleDrafter, SuffixDrafter, layer_skip_drafter
from verispec.errors import VerispecError

PROMPT = [5, 17, 33, 8, 9, 41, 5, 17]
SHAPES = {
    "chain1": Tree.chain(1), "chain4": Tree.chain(4), "2x2": Tree.complete(2, 2),
    "3,1,1": Tree.from_branching([3, 1, 1]), "paths": Tree.from_paths([(0, 0), (1,), (2,), (0, 1, 0)]),
}


@pytest.fixture(scope="module")
def target():
    t = tiny_model("llama", seed=0, layers=4)
    t.eos_token_ids = frozenset()  # random weights: decide stopping explicitly in each test
    return t


def drafters(target):
    other = tiny_model("llama", seed=1, layers=2)
    return {
        "layerskip2": layer_skip_drafter(target, 2),
        "layerskip0,2": layer_skip_drafter(target, [0, 2]),
        "model": ModelDrafter(other),
        "ngram": NgramDrafter(target.vocab_size, max_n=2),
        "suffix": SuffixDrafter(target.vocab_size),
        "recycle": RecycleDrafter(target.vocab_size, k=3),
    }


def run(target, drafter, tree, verifier="greedy", temperature=0.0, children="topk", n=24, seed=0):
    return generate(target, drafter, get_verifier(verifier), PROMPT, tree=tree, policy="fixed", max_new_tokens=n,
                    temperature=temperature, children=children, seed=seed)


def test_autoregressive_greedy_equals_hugging_face_generate(target):
    ours = run(target, NoDrafter(), Tree.root_only(), verifier="chain", n=20)
    ref = target.hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours.token_ids == ref
    assert ours.mean_accepted_length == 1.0


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("children", ["topk", "iid", "swor"])
def test_speculative_greedy_equals_autoregressive_greedy(target, shape_name, children):
    reference = run(target, NoDrafter(), Tree.root_only(), n=24).token_ids
    for name, drafter in drafters(target).items():
        shape = SHAPES[shape_name]
        tree_rule = {"iid": "specinfer", "swor": "swor", "topk": "topk"}[children]
        for verifier in ("greedy", tree_rule, *(("chain",) if shape.is_chain else ())):
            out = run(target, drafter, shape, verifier=verifier, children=children)
            assert out.token_ids == reference, (name, verifier)
            assert len(out.token_ids) == 24


def test_self_draft_is_accepted_sometimes(target):
    # the full-depth self-draft proposes exactly the target's tokens: every draft is accepted
    full = layer_skip_drafter(target, [0, 1, 2, 3])
    out = run(target, full, Tree.chain(3), n=24)
    assert all(s.accepted_length == 4 for s in out.steps[:-1])


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_same_seed_same_output(target, temperature):
    a = run(target, layer_skip_drafter(target, 2), Tree.chain(3), verifier="chain", temperature=temperature, children="iid", seed=7)
    b = run(target, layer_skip_drafter(target, 2), Tree.chain(3), verifier="chain", temperature=temperature, children="iid", seed=7)
    c = run(target, layer_skip_drafter(target, 2), Tree.chain(3), verifier="chain", temperature=temperature, children="iid", seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize("verifier,children", [("specinfer", "iid"), ("swor", "swor"), ("topk", "topk"),
                                               ("traversal", "swor"), ("reserve", "iid"), ("ordered", "iid")])
def test_tree_verifiers_sample_through_the_loop(target, verifier, children):
    """Sampling through the loop with the perfect draft (the full-depth self-draft: q = p) accepts a child at every
    node when children are sampled from q (top-k children: with probability p(children)), and with a draft that
    never agrees (every drafted token is impossible under the target's top-1) accepts nothing."""
    good = run(target, layer_skip_drafter(target, [0, 1, 2, 3]), Tree.complete(2, 2), verifier=verifier,
               temperature=0.8, children=children, n=20, seed=3)
    assert good.num_tokens == 20
    if children == "topk":
        assert good.mean_accepted_length > 1.0
    else:
        assert all(s.accepted_length == 3 for s in good.steps[:-1]), [s.accepted_length for s in good.steps]
    bad = generate(target, Contrarian(target.vocab_size), get_verifier(verifier), PROMPT, tree=Tree.complete(2, 2),
                   policy="fixed",
                   max_new_tokens=12, temperature=0.8, top_k=1, children=children, seed=3)
    assert all(s.accepted_length == 1 for s in bad.steps)


def test_stops_at_eos_and_at_max_new_tokens_exactly():
    target = tiny_model("llama", seed=0, layers=4)
    target.eos_token_ids = frozenset()
    reference = run(target, NoDrafter(), Tree.root_only(), n=30).token_ids
    for n in (1, 2, 7):
        for drafter in drafters(target).values():
            assert run(target, drafter, Tree.chain(4), n=n).token_ids == reference[:n]
    stop_at = next(i for i, t in enumerate(reference) if t not in reference[:i] and i >= 5)
    target.eos_token_ids = frozenset({reference[stop_at]})
    for drafter in drafters(target).values():
        out = run(target, drafter, Tree.chain(4), n=30)
        assert out.token_ids == reference[: stop_at + 1]
        assert out.stop_reason == "eos"


class Oracle(NgramDrafter):
    """Drafts a fixed continuation (the target's own greedy text, or a wrong one) as a point mass."""

    def __init__(self, vocab_size, text, prompt_len, shift=0):
        super().__init__(vocab_size)
        self.text, self.prompt_len, self.shift = text, prompt_len, shift

    def _law(self, position):
        out = torch.full((self.vocab_size,), float("-inf"))
        if position < len(self.text):
            out[(self.text[position] + self.shift) % self.vocab_size] = 0.0
        return out

    def _root_logits(self, context):
        self._len = len(context)
        return self._law(self._len - self.prompt_len)

    def _node_logits(self, g, nodes):
        return torch.stack([self._law(self._len - self.prompt_len + len(g.path(n))) for n in nodes])


def test_records_count_what_verification_did(target):
    """Against drafts whose fate is known in advance: a draft of the target's own greedy text is accepted whole at
    every step (accepted length = depth + 1, the bonus included, one candidate tested per depth), and a draft that is
    always wrong never is (accepted length 1, one candidate tested at depth 1)."""
    reference = run(target, NoDrafter(), Tree.root_only(), n=20).token_ids
    right = generate(target, Oracle(target.vocab_size, reference, len(PROMPT)), get_verifier("chain"), PROMPT,
                     tree=Tree.chain(3), policy="fixed", max_new_tokens=20, temperature=0.0)
    assert right.token_ids == reference
    assert [s.accepted_length for s in right.steps] == [4] * 5
    assert all(s.tested == (1, 1, 1) and s.accepted_ranks == (0, 0, 0) and s.drafted == 3 for s in right.steps)
    assert [len(s.emitted) for s in right.steps] == [4] * 5
    wrong = generate(target, Oracle(target.vocab_size, reference, len(PROMPT), shift=1), get_verifier("chain"),
                     PROMPT, tree=Tree.chain(3), policy="fixed", max_new_tokens=20, temperature=0.0)
    assert wrong.token_ids == reference and len(wrong.steps) == 20
    assert all(s.accepted_length == 1 and s.tested == (1,) and s.accepted_ranks == () for s in wrong.steps)
    assert out_summary_tokens(wrong) == 20


def out_summary_tokens(out):
    return out.to_dict()["summary"]["tokens"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.2), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=10_000), "context"),
])
def test_bad_arguments_give_clear_errors(target, kwargs, match):
    args = dict(tree=Tree.chain(2), max_new_tokens=8, temperature=0.6)
    args.update(kwargs)
    with pytest.raises(VerispecError, match=match):
        generate(target, layer_skip_drafter(target, 2), get_verifier("chain"), PROMPT, **args)


def test_empty_prompt_and_vocab_mismatch(target):
    with pytest.raises(VerispecError, match="empty"):
        generate(target, NoDrafter(), get_verifier("chain"), [], max_new_tokens=4)
    other = ModelDrafter(tiny_model("llama", seed=1, layers=2, vocab=101))
    with pytest.raises(VerispecError, match="vocabulary"):
        generate(target, other, get_verifier("chain"), PROMPT, max_new_tokens=4)


def test_greedy_only_verifier_refuses_sampling(target):
    with pytest.raises(VerispecError, match="temperature 0"):
        generate(target, NoDrafter(), get_verifier("greedy"), PROMPT, max_new_tokens=4, temperature=0.7)
