"""Free draft sources (no model forward): the suffix automaton over the context, the cache of served answers, token
recycling; their drafts, their exactness through the whole loop, and the repetitive workload."""

import json
import random

import pytest
import torch
from conftest import tiny_model

from verispec import Tree, generate, get_verifier
from verispec.audit.law import loop_law, random_tables, target_law, tv_and_kl
from verispec.datasets import REPETITIVE_GROUPS, jsonl_problems, load_prompts
from verispec.drafters import (
    DraftSpec,
    HybridDrafter,
    NgramDrafter,
    NoDrafter,
    RecycleDrafter,
    SuffixCache,
    SuffixDrafter,
    build_drafter,
    with_answer_cache,
)
from verispec.drafters.suffix import SuffixIndex
from verispec.engine import Engine, run_all
from verispec.errors import VerispecError
from verispec.methods import Recipe
from verispec.policies import AutoDepth
from verispec.probs import Sampling
from verispec.rng import TorchRandomness


def test_the_suffix_automaton_finds_the_longest_earlier_match_and_its_first_continuation():
    """Against brute force on random texts over small alphabets (many repeats): after every token, the longest suffix
    that occurred earlier, what followed its first occurrence, and the longest match of another text."""
    rnd = random.Random(0)
    for _ in range(150):
        v = rnd.choice([2, 3, 5])
        seq = [rnd.randrange(v) for _ in range(rnd.randint(1, 50))]
        index = SuffixIndex(v)
        for i, x in enumerate(seq):
            index.add(x)
            t = seq[:i + 1]
            best, first = 0, None
            for n in range(1, len(t)):
                ends = [e for e in range(n - 1, len(t) - 1) if t[e - n + 1:e + 1] == t[len(t) - n:]]
                if ends:
                    best, first = n, ends[0]
            state, length = index.earlier()
            assert length == best
            if best:
                assert index.continuation(state, 4) == t[first + 1:first + 5]
        other = [rnd.randrange(v) for _ in range(12)]
        longest = max((n for n in range(1, 13)
                       if any(seq[s:s + n] == other[12 - n:] for s in range(len(seq) - n + 1))), default=0)
        assert index.match(other)[1] == longest


def test_the_suffix_drafter_drafts_what_followed_the_contexts_end_before():
    d = SuffixDrafter(50)
    draft = d.propose([7, 8, 9, 10, 11, 3, 7, 8], Tree.chain(4), Sampling(0.0), "topk", None)
    assert draft.tokens.tolist() == [8, 9, 10, 11, 3]
    assert torch.equal(draft.q[0], torch.nn.functional.one_hot(torch.tensor(9), 50).float())  # a point mass
    assert d.propose([1, 2, 3], Tree.chain(4), Sampling(0.6), "iid", None).num_drafted == 0  # nothing repeats


def test_the_answer_cache_drafts_only_from_confident_matches_and_keeps_its_bound():
    cache = SuffixCache(50, max_tokens=40, min_match=3)
    cache.add([1, 2, 3, 4, 5, 6])
    assert cache.draft([9, 1, 2, 3], 8) == ([4, 5, 6], 3)  # stops at the answer's end
    assert cache.draft([9, 2, 3], 8) == ([], 0)  # too short a match
    cache.add([1, 2, 3, 7, 8])
    assert cache.draft([9, 1, 2, 3], 8) == ([], 0)  # the two answers went on differently after it
    assert cache.draft([0, 1, 2, 3, 7], 8) == ([8], 4)  # a longer match of the second answer
    for i in range(20):
        cache.add([10 + i, 11 + i, 12 + i])
        assert len(cache) <= 40
    assert cache.draft([0, 1, 2, 3, 7], 8) == ([], 0)  # the oldest answers were dropped
    cache.add([40, 41, 42, 43, 44])
    assert cache.draft([40, 41, 42, 43, 44], 4) == ([], 0)  # the end of an answer: nothing after it
    assert cache.draft([40, 41, 42], 4) == ([43, 44], 3)
    drafter = SuffixDrafter(50, cache)
    assert drafter.propose([9, 40, 41, 42], Tree.chain(3), Sampling(0.0), "topk", None).tokens.tolist() == [42, 43, 44]


def test_token_recycling_drafts_the_targets_own_top_successors():
    d = RecycleDrafter(10, k=2)
    assert d.propose([3, 4], Tree.chain(3), Sampling(0.0), "topk", None).num_drafted == 0  # nothing seen yet
    logits = torch.zeros(3, 10)
    logits[0, 5], logits[0, 6] = 3.0, 2.0  # after 4: 5, then 6
    logits[1, 7], logits[1, 1] = 3.0, 1.0  # after 5: 7
    logits[2, 9] = 1.0  # after 4 again (the later row wins): 9 first
    d.observe_logits(torch.tensor([4, 5, 4]), logits)
    draft = d.propose([3, 4], Tree.chain(3), Sampling(0.0), "topk", None)
    assert draft.tokens.tolist() == [4, 9]  # 9 was never an input: the chain stops
    d.observe_logits(torch.tensor([4]), logits[:1])
    assert d.propose([3, 4], Tree.chain(3), Sampling(0.6), "iid", TorchRandomness(0)).tokens.tolist() == [4, 5, 7]
    tree = d.propose([3, 4], Tree.from_branching([2, 1]), Sampling(0.0), "topk", None)
    assert tree.tokens.tolist()[:3] == [4, 5, 6]
    q = d.propose([3, 4], Tree.chain(1), Sampling(1.0), "iid", TorchRandomness(1))
    assert q.q[0].max().item() == 1.0 and int((q.q[0] > 0).sum()) == 1  # the law is a point mass
    d.reset([])
    assert d.propose([3, 4], Tree.chain(3), Sampling(0.0), "topk", None).num_drafted == 0


@pytest.mark.parametrize("make", ["suffix", "cache", "recycle"])
def test_free_drafts_keep_the_loops_output_law_exact(make):
    """The whole loop enumerated on table models at temperature 1, the auto policy changing the depth: the law of 4
    tokens is the target's to rounding (the answer cache filled beforehand with texts that match)."""
    p, _ = random_tables(3, 11, concentration=0.6, sparsity=0.3)
    if make == "recycle":
        drafter = RecycleDrafter(3, k=2)
        tree = Tree.from_branching([2, 1])
    else:
        cache = None
        if make == "cache":
            cache = SuffixCache(3, min_match=1)
            cache.add([0, 1, 2, 0])
            cache.add([0, 0, 2, 1])
        drafter = SuffixDrafter(3, cache)
        tree = Tree.chain(2)
    drafted = []
    root = drafter._root_sparse
    drafter._root_sparse = lambda context: drafted.append(r := root(context)) or r
    verifier = "traversal" if make == "recycle" else "chain"
    children = "topk" if make == "recycle" else "iid"
    law = loop_law(get_verifier(verifier), p, p, tree, 3, 4, lambda: AutoDepth(costs=(1.0, 1.05, 1.1),
                                                                               probe_every=2),
                   children=children, drafter=drafter)
    dense = torch.zeros((3,) * 4, dtype=torch.float64)
    for seq, w in law.items():
        dense[seq] += w
    assert tv_and_kl(target_law(p, (0,), 4, 3), dense)[0] < 1e-12
    assert any(r is not None for r in drafted)  # it drafted on some of the paths enumerated


def test_the_engine_adds_finished_answers_to_the_cache_and_a_repeat_drafts_from_it():
    target = tiny_model("llama", seed=0, layers=2)
    target.eos_token_ids = frozenset()
    cache = SuffixCache(target.vocab_size)
    drafter, reads = with_answer_cache(NgramDrafter(target.vocab_size), cache)
    assert reads and isinstance(drafter, SuffixDrafter)
    prompt = [5, 17, 33, 8, 9, 41]
    outs = []
    for _ in range(2):
        engine = Engine(target, answer_cache=cache)
        seq = engine.submit(prompt, Recipe(get_verifier("chain"), Tree.chain(4), drafter.fork()),
                            sampling=Sampling(0.0), max_new_tokens=24)
        run_all(engine)
        outs.append(seq)
    assert len(cache) == 2 * (24 + 1)
    assert outs[0].token_ids == outs[1].token_ids
    first, second = (sum(s.accepted_length for s in o.steps) / len(o.steps) for o in outs)
    assert second > first and second >= 3  # the repeat drafts its own earlier answer
    hybrid = HybridDrafter(NoDrafter(), NgramDrafter(target.vocab_size))
    assert isinstance(with_answer_cache(hybrid, cache)[0].lookup, SuffixDrafter)
    assert with_answer_cache(NoDrafter(), cache)[1] is False


def test_free_draft_specs(tmp_path):
    target = tiny_model("llama", seed=0, layers=2)
    assert isinstance(build_drafter("suffix", target), SuffixDrafter)
    assert build_drafter("recycle:8", target).k == 8
    assert isinstance(build_drafter("hybrid:recycle", target).model, RecycleDrafter)
    for bad in ("suffix:3", "recycle:0", "recycle:x", "hybrid:suffix"):
        with pytest.raises(VerispecError):
            DraftSpec.parse(bad)
    out = generate(target, build_drafter("hybrid:recycle", target), "chain", [5, 17, 33, 8, 9, 41, 5, 17],
                   tree="chain:3", policy="auto", temperature=0.0, max_new_tokens=16)
    ref = generate(target, NoDrafter(), "chain", [5, 17, 33, 8, 9, 41, 5, 17], tree="none", temperature=0.0,
                   max_new_tokens=16)
    assert out.token_ids == ref.token_ids


def test_the_repetitive_workload_and_conversations_in_a_prompt_file(tmp_path):
    problems = load_prompts("repetitive")
    assert [p.category for p in problems] == [g for g in REPETITIVE_GROUPS for _ in range(6)]
    assert all(isinstance(p.prompt, list) and p.prompt[-1]["role"] == "user" for p in problems)
    assert [p.id for p in load_prompts("repetitive:edit_code", 2)] == ["edit_code/HumanEval/0", "edit_code/HumanEval/1"]
    with pytest.raises(VerispecError, match="unknown repetitive group"):
        load_prompts("repetitive:poems")
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert jsonl_problems(path)[0].prompt == [{"role": "user", "content": "hi"}]
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(VerispecError, match="messages"):
        jsonl_problems(path)


@pytest.mark.slow
def test_the_loops_sampled_law_with_each_free_draft_is_the_targets_and_a_wrong_temperature_is_caught():
    """On a real (tiny) model at T = 1: the first 3 tokens of 3,000 seeded runs of the loop with each free draft,
    chi-square against the target's exact law of 3 tokens (teacher forcing). A loop that samples at T = 0.8 must be
    caught by the same test, so the test has power for a fault of that size."""
    from verispec.audit.sampled import check_loop

    target = tiny_model("llama", seed=0, layers=2)
    target.eos_token_ids = frozenset()
    with torch.no_grad():  # sharper still: 79 outcomes of 3 tokens are expected 5 times or more in 3,000 runs
        target.hf.get_output_embeddings().weight.mul_(4.0)
    prompt = [5, 17, 33, 8, 9, 41, 5, 17, 33]
    cache = SuffixCache(target.vocab_size, min_match=2)
    for seed in range(20):  # answers like the ones the loop will give
        cache.add(prompt[-3:] + generate(target, NoDrafter(), "chain", prompt, tree="none", temperature=1.0,
                                         max_new_tokens=6, seed=seed).token_ids)
    drafts = {"suffix": lambda: SuffixDrafter(target.vocab_size), "cache": lambda: SuffixDrafter(target.vocab_size, cache),
              "recycle": lambda: RecycleDrafter(target.vocab_size, k=3)}

    def sampler(make, temperature=1.0):
        def sample(seed):
            out = generate(target, make(), "chain", prompt, tree="chain:3", policy="fixed", temperature=temperature,
                           max_new_tokens=3, seed=seed)
            return out.token_ids, sum(s.drafted for s in out.steps)
        return sample

    for name, make in drafts.items():
        res = check_loop(target, prompt, 3, 3000, sampler(make), Sampling(1.0), floor=2e-4)
        assert res.passed and res.cells > 50, (name, res)
        if name != "recycle":  # recycling has no successors yet in a sequence's first steps
            assert res.drafted > 0.5, (name, res)
    wrong = check_loop(target, prompt, 3, 3000, sampler(drafts["suffix"], 0.8), Sampling(1.0), floor=2e-4)
    assert not wrong.passed, wrong
