"""Draft-length policies on scripted outcomes, and through the decoding loop."""

import itertools
import math

import pytest
import torch
from conftest import Contrarian, tiny_model

from verispec import Tree, generate, get_verifier
from verispec.drafters import ModelDrafter, layer_skip_drafter
from verispec.drafters.base import Draft
from verispec.errors import VerispecError
from verispec.policies import (
    AdaEDL,
    AdaSDEntropy,
    BiLDFallback,
    Feedback,
    HFAssisted,
    PolicyBase,
    entropy,
    get_policy,
    roc_threshold,
)

V = 6


def feedback(drafted, accepted, conf=None, ent=None):
    m = min(accepted + 1, drafted)
    conf = torch.full((m,), 0.5, dtype=torch.float64) if conf is None else torch.tensor(conf, dtype=torch.float64)
    ent = torch.full((m,), 1.0, dtype=torch.float64) if ent is None else torch.tensor(ent, dtype=torch.float64)
    return Feedback(drafted, accepted, ent, conf)


def uniform(n, vocab=V):
    q = torch.zeros(1, vocab, dtype=torch.float64)
    q[0, :n] = 1.0 / n
    return q


def test_hf_heuristic_schedule_plus_two_minus_one():
    pol = HFAssisted(schedule="heuristic", num_tokens=5, threshold=None)
    lengths = []
    for drafted, accepted in [(5, 5), (7, 7), (9, 3), (8, 0), (7, 6), (6, 6), (8, 0), (7, 0), (6, 0), (5, 0),
                              (4, 0), (3, 0), (2, 0), (1, 0), (1, 0)]:
        pol.update(feedback(drafted, accepted))
        lengths.append(pol.num_tokens)
    assert lengths == [7, 9, 8, 7, 6, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1]
    assert [pol.keep_drafting(d, uniform(2)) for d in range(3)] == [True, False, False]


def test_hf_constant_keeps_its_length_and_stops_on_low_confidence():
    pol = HFAssisted(schedule="constant", num_tokens=20, threshold=0.4, refit=False)
    pol.update(feedback(20, 20))
    pol.update(feedback(20, 0))
    assert pol.num_tokens == 20
    assert pol.keep_drafting(0, uniform(3))  # nothing drafted yet: no confidence to check
    assert pol.keep_drafting(3, uniform(3), torch.tensor([0.41]))
    assert not pol.keep_drafting(3, uniform(3), torch.tensor([0.39]))
    assert not pol.keep_drafting(20, uniform(1), torch.tensor([1.0]))


def brute_force_threshold(scores, positive, weight):
    best, best_t = math.inf, None
    for t in sorted(set(scores.tolist()) | {math.inf}, reverse=True):
        pred = scores >= t
        tpr = int((pred & positive).sum()) / int(positive.sum())
        fpr = int((pred & ~positive).sum()) / int((~positive).sum())
        cost = fpr + weight * (1 - tpr)
        if cost < best - 1e-12:
            best, best_t = cost, t
    return best_t


def test_roc_threshold_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(2, 30, (1,), generator=gen))
        scores = torch.randint(0, 8, (n,), generator=gen).double() / 8  # ties on purpose
        positive = torch.rand(n, generator=gen) < 0.5
        if positive.all() or not positive.any():
            continue
        for w in (1.0, 3.0):
            assert roc_threshold(scores, positive, w) == brute_force_threshold(scores, positive, w)


def test_hf_roc_refit_follows_the_verified_tokens():
    pol = HFAssisted(schedule="constant", num_tokens=20, threshold=0.4)
    # step 1: 3 accepted then one rejected -> matches [1,1,1,0]; no re-fit yet (needs > 5 samples)
    pol.update(feedback(10, 3, conf=[0.9, 0.8, 0.7, 0.2]))
    assert pol.threshold == 0.4 and pol.matches == [1, 1, 1, 0]
    # step 2: all of a 2-token draft accepted -> no rejected token to record
    pol.update(feedback(2, 2, conf=[0.6, 0.65]))
    assert pol.matches == [1, 1, 1, 0, 1, 1]
    assert pol.threshold == 0.6  # separable: the lowest accepted probability
    pol.update(feedback(5, 0, conf=[0.75]))
    expected = brute_force_threshold(torch.tensor(pol.probs, dtype=torch.float64), torch.tensor(pol.matches, dtype=torch.bool), 3.0)
    assert pol.threshold == expected


def test_adasd_entropy_threshold_is_learned_from_outcomes():
    pol = AdaSDEntropy()
    assert pol.threshold == math.inf and pol.keep_drafting(3, uniform(V), None, uniform(V))  # no data: whole shape
    pol.update(feedback(3, 3, ent=[0.1, 0.2, 0.3]))  # only accepted outcomes so far
    assert pol.threshold == math.inf
    pol.update(feedback(4, 1, ent=[0.25, 1.0]))
    assert pol.threshold == 1.0  # separates accepted (<= 0.3) from rejected (1.0)
    nxt = uniform(V)  # the next law does not matter: the last drafted token's law decides
    assert pol.keep_drafting(2, nxt, None, uniform(2))  # H = ln 2 = 0.69 < 1
    assert not pol.keep_drafting(2, nxt, None, uniform(3))  # H = ln 3 = 1.10 >= 1: stop after this token
    assert pol.keep_drafting(0, nxt, None, None)  # the first token is always drafted
    # a tree frontier keeps drafting while any of its tokens' laws is below the threshold
    assert pol.keep_drafting(2, nxt, None, torch.cat([uniform(3), uniform(2)]))


def test_adaedl_bound_and_lambda_adaptation():
    pol = AdaEDL()
    q = uniform(4)
    bound = 1 - math.sqrt(0.2 * math.log(4))  # 0.4735
    assert pol.keep_drafting(0, q) == (bound >= pol.lam)
    pol.lam = bound + 1e-6
    assert not pol.keep_drafting(0, q)
    pol = AdaEDL()
    for _ in range(60):  # nothing is ever accepted: lambda rises towards 1 and drafting stops
        pol.update(feedback(5, 0))
    assert pol.lam > 0.9 and not pol.keep_drafting(0, uniform(2))
    pol = AdaEDL()
    for _ in range(60):  # everything accepted: lambda falls towards 0
        pol.update(feedback(5, 5))
    assert pol.lam < 0.1 and pol.keep_drafting(0, uniform(V))


def test_bild_fallback_threshold():
    pol = BiLDFallback()
    assert not pol.keep_drafting(0, uniform(2))  # top probability 0.5 < 0.6
    q = torch.tensor([[0.7, 0.3, 0, 0, 0, 0]], dtype=torch.float64)
    assert pol.keep_drafting(0, q)


def test_feedback_from_a_chain_step():
    tree = Tree.chain(4)
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(5, V, generator=gen, dtype=torch.float64)
    q = q / q.sum(-1, keepdim=True)
    q[4] = 0
    tokens = torch.tensor([0, 3, 1, 4, 2])
    draft = Draft(tree, tokens, q, torch.ones(5, dtype=torch.float64), "iid")
    fb = Feedback.from_step(draft, (1, 2))
    assert fb.drafted == 4 and fb.accepted == 2
    assert fb.labels.tolist() == [True, True, False]
    assert torch.allclose(fb.confidence, torch.stack([q[0, 3], q[1, 1], q[2, 4]]))
    assert torch.allclose(fb.entropy, entropy(q[:3]))
    full = Feedback.from_step(draft, (1, 2, 3, 4))
    assert full.labels.tolist() == [True] * 4


@pytest.mark.parametrize("spec,cls", [("fixed", "Fixed"), ("fixed:3", "Fixed"), ("hf", "HFAssisted"),
                                      ("hf:heuristic", "HFAssisted"), ("adasd-entropy", "AdaSDEntropy"),
                                      ("adaedl", "AdaEDL"), ("bild", "BiLDFallback")])
def test_get_policy(spec, cls):
    pol = get_policy(spec)
    assert type(pol).__name__ == cls
    assert pol.name == spec.split(":")[0] or pol.name == spec


@pytest.mark.parametrize("spec", ["nope", "fixed:0", "fixed:x", "hf:sometimes", "adaedl:2"])
def test_bad_policy_specs(spec):
    with pytest.raises(VerispecError, match="policy"):
        get_policy(spec)


@pytest.fixture(scope="module")
def target():
    t = tiny_model("llama", seed=0, layers=4)
    t.eos_token_ids = frozenset()
    return t


PROMPT = [5, 17, 33, 8, 9, 41, 5, 17]


@pytest.mark.parametrize("policy", ["hf", "hf:heuristic", "adasd-entropy", "adaedl", "bild", "fixed:2"])
def test_every_policy_keeps_greedy_output_exact(target, policy):
    ref = generate(target, layer_skip_drafter(target, 2), get_verifier("greedy"), PROMPT, tree=Tree.root_only(),
                   max_new_tokens=24, temperature=0.0)
    out = generate(target, ModelDrafter(tiny_model("llama", seed=1, layers=2)), get_verifier("chain"), PROMPT,
                   tree=Tree.chain(8), max_new_tokens=24, temperature=0.0, policy=get_policy(policy))
    assert out.token_ids == ref.token_ids
    assert all(s.drafted <= 8 for s in out.steps)


def test_policy_shortens_drafts_in_the_loop(target):
    pol = HFAssisted(schedule="heuristic", num_tokens=3, threshold=None)
    out = generate(target, ModelDrafter(tiny_model("llama", seed=1, layers=2)), get_verifier("chain"), PROMPT,
                   tree=Tree.chain(10), max_new_tokens=40, temperature=1.0, policy=pol, seed=3)
    lengths = [3]
    for s in out.steps[:-1]:
        n = lengths[-1]
        lengths.append(n + 2 if s.accepted_length - 1 == s.drafted else max(1, n - 1))
    assert [s.drafted for s in out.steps] == [min(n, 10) for n in lengths]
    assert any(itertools.starmap(lambda a, b: a != b, zip(lengths, lengths[1:])))


class Recorder(PolicyBase):
    name = "recorder"

    def __init__(self):
        self.seen = []

    def keep_drafting(self, depth, q, last=None, drawn=None, confidence=None):
        assert (last is None) == (drawn is None) == (depth == 0)
        self.seen.append((depth, q.clone(), None if last is None else last.clone()))
        return True

    def update(self, feedback):
        self.feedback = feedback


def test_greedy_drafts_show_policies_the_softmax_not_a_point_mass(target):
    pol = Recorder()
    out = generate(target, ModelDrafter(tiny_model("llama", seed=1, layers=2)), get_verifier("chain"), PROMPT,
                   tree=Tree.chain(3), max_new_tokens=4, temperature=0.0, policy=pol)
    assert out.steps
    depth0 = [q for d, q, last in pol.seen if d == 0]
    assert all(torch.allclose(q.sum(-1), torch.ones(1, dtype=q.dtype)) and q.max() < 1 for q in depth0)
    assert all(last is not None and 0 < float(last.max()) < 1 for d, _, last in pol.seen if d > 0)
    assert (pol.feedback.confidence < 1).all()  # judged by the softmax, as Hugging Face's confidence is


def loop_tv(p, q, tree, policy) -> float:
    """Total variation between the target's law of 3 tokens (vocabulary 3) and what the real loop emits with
    fresh policies from ``policy``, enumerated."""
    from verispec.audit.law import loop_law, target_law, tv_and_kl

    law = loop_law(get_verifier("chain"), p, q, tree, 3, 3, policy)
    dense = torch.zeros((3,) * 3, dtype=torch.float64)
    for seq, w in law.items():
        dense[seq] += w
    return tv_and_kl(target_law(p, (0,), 3, 3), dense)[0]


def test_auto_policy_keeps_the_output_law_exact():
    """The whole decoding loop, enumerated on small table models: with the auto policy changing the draft depth
    from step to step (probing every other step), the law of the first 3 tokens is the target's to rounding."""
    from verispec.audit.law import random_tables
    from verispec.policies import AutoDepth

    p, q = random_tables(3, 5, concentration=0.7)
    depths = []

    def policy():
        pol = AutoDepth(costs=(1.0, 1.3, 1.6), probe_every=2, prior=0.25)
        original = pol.planned_depth
        pol.planned_depth = lambda limit: depths.append(original(limit)) or depths[-1]
        return pol

    tv = loop_tv(p, q, Tree.chain(2), policy)
    assert tv < 1e-12 and 0 in depths and len(set(depths)) >= 2  # it varied the depth; the law did not move


def test_auto_policy_drops_to_plain_decoding_on_a_draft_that_is_always_wrong():
    from verispec.policies import AutoDepth

    target = tiny_model("llama")
    target.eos_token_ids = frozenset()
    policy = AutoDepth()
    out = generate(target, Contrarian(target.vocab_size), get_verifier("chain"), [5, 17, 33, 8, 9], tree=Tree.chain(4),
                   max_new_tokens=80, temperature=0.8, top_k=1, policy=policy)
    drafted = [s.draft_depth for s in out.steps]
    assert all(s.accepted_length == 1 for s in out.steps)
    assert sum(d > 0 for d in drafted[8:]) <= len(drafted[8:]) / 16 + 1  # only its probes draft
    assert drafted[-1] == 0 or len(drafted) % 16 == 1


def test_auto_policy_drafts_deeper_when_the_draft_is_good_and_costs_decide_the_depth():
    from verispec.policies import AutoDepth, Feedback

    pol = AutoDepth(costs=(1.0, 1.1, 1.2, 1.3, 1.4))
    for _ in range(30):  # depths 1-3 always accepted
        pol.update(Feedback(3, 3, source=(None, [])))
    assert pol.best_depth(4) >= 3
    expensive = AutoDepth(costs=(1.0, 3.0, 5.0, 7.0, 9.0))
    for _ in range(30):
        expensive.update(Feedback(3, 3, source=(None, [])))
    assert expensive.best_depth(4) == 0  # nothing pays when a drafted depth costs two plain steps
    with pytest.raises(VerispecError, match="never decrease"):
        AutoDepth(costs=(1.0, 0.5))


def test_auto_gate_drafts_on_confident_tokens_and_stops_on_doubtful_ones():
    """Costs like llama.cpp's on this CPU (a second token costs 0.7 of a step): the gate learns per confidence bin
    that sure tokens are accepted and doubtful ones are not, and drafts accordingly."""
    from verispec.policies import AutoDepth

    pol = AutoDepth(costs=(1.0, 1.7, 2.3, 2.9, 3.5), free_root=True, gate=True, probe_every=10**9)
    sure, doubtful = torch.tensor([0.97]), torch.tensor([0.05])
    for _ in range(40):  # a step drafts sure tokens until a doubtful one comes; the sure ones are all accepted
        assert pol.planned_depth(4) == 4  # a free first depth: every step starts, the gate decides
        depth = 0
        while depth < 4 and pol.keep_drafting(depth, None, confidence=sure if depth < 3 else doubtful):
            depth += 1
        pol.update(Feedback(depth, min(depth, 3), source=(None, [])))
    pol.planned_depth(4)
    assert [pol.keep_drafting(d, None, confidence=sure) for d in range(3)] == [True] * 3
    assert not pol.keep_drafting(3, None, confidence=doubtful)
    assert pol.bin_acceptance(0.97) > 0.9
    fresh = AutoDepth(costs=(1.0, 1.7, 2.3, 2.9, 3.5), free_root=True, gate=True)
    fresh.planned_depth(4)
    assert not fresh.keep_drafting(0, None, confidence=doubtful)  # a doubtful token never pays at these costs
    off = get_policy("auto", (1.0, 1.7, 2.3, 2.9, 3.5))
    assert not off.uses_confidence and off.planned_depth(4) == 0  # the per-depth plan alone: prior 0.5 loses here
    assert get_policy("auto:gate").uses_confidence


def test_auto_gate_keeps_the_output_law_exact():
    """The whole loop enumerated on table models, the gate stopping some steps early from the draft's confidence:
    the law of the first 3 tokens is the target's to rounding."""
    from verispec.audit.law import random_tables
    from verispec.policies import AutoDepth

    p, q = random_tables(3, 5, concentration=0.4)
    decisions = []

    def policy():
        pol = AutoDepth(costs=(1.0, 1.5, 2.0, 2.5), free_root=True, gate=True, prior_weight=0.5)
        original = pol.keep_drafting
        pol.keep_drafting = lambda *a, **k: decisions.append(original(*a, **k)) or decisions[-1]
        return pol

    tv = loop_tv(p, q, Tree.chain(3), policy)
    assert tv < 1e-12 and True in decisions and False in decisions
