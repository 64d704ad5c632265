"""Prompt lookup and a model draft switched per step (``HybridDrafter``), with a policy per source (``PerSource``)."""

import pytest
import torch
from conftest import tiny_model

from verispec import Tree, generate, get_verifier
from verispec.drafters import DraftSpec, HybridDrafter, ModelDrafter, NgramDrafter, NoDrafter, build_drafter
from verispec.errors import VerispecError
from verispec.policies import AutoDepth, PerSource

PROMPT = [5, 17, 33, 8, 9, 41, 5, 17, 33, 8]  # repeats itself: prompt lookup has a match from the first step


def switch(target, min_match=2):
    return HybridDrafter(ModelDrafter(tiny_model("llama", seed=1, layers=2), name="small"),
                         NgramDrafter(target.vocab_size), min_match=min_match)


@pytest.fixture(scope="module")
def target():
    t = tiny_model("llama")
    t.eos_token_ids = frozenset()
    return t


def test_the_source_is_prompt_lookup_where_the_context_repeats_itself(target):
    sw = switch(target)
    assert sw.source([5, 6, 7, 8]) == "small"  # nothing repeats
    assert sw.source([5, 6, 7, 5]) == "small"  # a one-token match is not enough at min_match 2
    assert sw.source([5, 6, 7, 5, 6]) == "ngram"  # [5, 6] occurred before
    assert switch(target, min_match=1).source([5, 6, 7, 5]) == "ngram"
    assert sw.lookup.match_length([5, 6, 7, 5, 6]) == 2 and sw.lookup.match_length([1, 2, 3]) == 0
    with pytest.raises(ValueError, match="min_match"):
        switch(target, min_match=4)  # longer than the lookup's longest n-gram (3)


def longest_match(seq: list[int], max_n: int, min_n: int) -> int:
    """The n of the longest suffix of ``seq`` (``max_n`` down to ``min_n``) that occurred earlier with a token after
    it, by searching every position (0: none)."""
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        if any(seq[i:i + n] == seq[-n:] for i in range(len(seq) - n)):
            return n
    return 0


def test_the_match_length_kept_step_by_step_is_the_search_of_the_whole_context():
    """``match_length`` indexes each context's n-grams as it grows; at every length, and for a context that does
    not continue the last one, it gives the n of a search of every position."""
    gen = torch.Generator().manual_seed(0)
    for max_n, min_n in ((3, 1), (4, 2)):
        kept = NgramDrafter(9, max_n, min_n)
        for _ in range(3):
            seq = torch.randint(0, 9, (60,), generator=gen).tolist()
            lengths = [1]
            while lengths[-1] < len(seq):  # a step commits 1 to 4 tokens
                lengths.append(lengths[-1] + 1 + int(torch.randint(0, 4, (), generator=gen)))
            for length in lengths:
                assert kept.match_length(seq[:length]) == longest_match(seq[:length], max_n, min_n)
        assert kept.match_length([1, 2, 3, 1, 2]) == (2 if min_n <= 2 else 0)  # not a continuation: indexed anew
        kept.reset([])
        assert kept.match_length([4, 4]) == (1 if min_n == 1 else 0)


def test_switching_keeps_greedy_output_exact_and_each_source_teaches_its_own_policy(target):
    ref = generate(target, NoDrafter(), get_verifier("chain"), PROMPT, tree=Tree.root_only(), max_new_tokens=48,
                   temperature=0.0)
    sw = switch(target)
    policy = PerSource({"ngram": AutoDepth(costs=(1.0, 1.01, 1.02, 1.03, 1.04)),
                        "small": AutoDepth(costs=(1.0, 1.3, 1.6, 1.9, 2.2))})
    out = generate(target, sw, get_verifier("chain"), PROMPT, tree=Tree.chain(4), max_new_tokens=48, temperature=0.0,
                   policy=policy)
    assert out.token_ids == ref.token_ids
    sources = [s.source for s in out.steps]
    assert set(sources) == {"ngram", "small"}
    assert policy.policies["ngram"].steps == sources.count("ngram")
    assert policy.policies["small"].steps == sources.count("small")
    with pytest.raises(VerispecError, match="no policy for draft source"):
        policy.select_source("eagle")


def test_switching_with_a_policy_per_source_keeps_the_output_law_exact():
    """The whole loop enumerated on table models at temperature 1: prompt lookup (an empirical law with zeros) and
    the table draft take turns, each with its own auto policy changing the depth; the law of 3 tokens is the
    target's to rounding."""
    from verispec.audit.law import TableDrafter, loop_law, random_tables, target_law, tv_and_kl

    p, q = random_tables(3, 7, concentration=0.7)
    used = set()

    class Spy(HybridDrafter):
        def source(self, context):
            used.add(super().source(context))
            return self._chosen[1].name

    def policy():
        return PerSource({"ngram": AutoDepth(costs=(1.0, 1.1, 1.2), probe_every=2),
                          "table": AutoDepth(costs=(1.0, 1.3, 1.6), probe_every=2, prior=0.25)})

    drafter = Spy(TableDrafter(q), NgramDrafter(3, max_n=2), min_match=1)
    law = loop_law(get_verifier("chain"), p, q, Tree.chain(2), 3, 3, policy, drafter=drafter)
    dense = torch.zeros((3,) * 3, dtype=torch.float64)
    for seq, w in law.items():
        dense[seq] += w
    assert tv_and_kl(target_law(p, (0,), 3, 3), dense)[0] < 1e-12
    assert used == {"ngram", "table"}


def test_hybrid_draft_specs(target):
    assert DraftSpec.parse("hybrid").kind == "hybrid"
    assert DraftSpec.parse("hybrid:layerskip:2").arg == "layerskip:2"
    for bad in ("hybrid:ngram", "hybrid:none", "hybrid:hybrid", "hybrid:bogus"):
        with pytest.raises(VerispecError):
            DraftSpec.parse(bad)
    with pytest.raises(VerispecError, match="no.*ships|none ships"):
        build_drafter("hybrid", target)  # the tiny model ships no head: the model draft must be named
    sw = build_drafter("hybrid:layerskip:2", target)
    assert isinstance(sw, HybridDrafter) and set(sw.sources) == {"ngram", sw.model.name}
    assert sw.default_tree == "chain:5"


def test_the_auto_policy_of_a_switch_weighs_each_source_by_its_own_costs(target):
    from verispec.methods import build_policy

    sw = build_drafter("hybrid:layerskip:2", target)
    pol = build_policy("auto", target, sw)
    assert isinstance(pol, PerSource) and set(pol.policies) == set(sw.sources)
    lookup, model = pol.policies["ngram"], pol.policies[sw.model.name]
    assert lookup.costs[1] - lookup.costs[0] < model.costs[1] - model.costs[0]  # a lookup depth costs less
