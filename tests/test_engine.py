"""The batched engine: one target forward over every sequence's tree, each sequence verified and committed on its
own; sequences join and leave between steps; a sequence's output does not depend on what it is batched with (greedy
tokens equal decoding it alone, the same sample at T > 0 with the same seed and lengths, and the joint law of two
sequences sharing steps is the product of the target's laws, enumerated); a failing sequence fails alone; and the
load-aware plan drafts less when rows cost more."""

import pytest
import torch
from conftest import FORWARDS, Contrarian, tiny_model, tiny_target

from verispec import Tree, VerispecError, generate, generate_batch, get_verifier
from verispec.audit.law import batch_loop_law, random_tables, target_law, tv_and_kl
from verispec.backends.costs import BATCH_CONTEXT, LONG_CONTEXT, BatchCosts
from verispec.drafters import HybridDrafter, ModelDrafter, NgramDrafter, layer_skip_drafter
from verispec.drafters.eagle import EagleDrafter
from verispec.eagle import EagleHead
from verispec.engine import Engine, run_all
from verispec.methods import Recipe
from verispec.planner import CostBook, batch_depths
from verispec.policies import AutoDepth, Fixed
from verispec.probs import Sampling
from verispec.rng import TorchRandomness

PROMPTS = [[5, 17, 33, 8, 61, 42], [7, 8, 9, 10, 7, 8], [44, 3, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9], [61]]


@pytest.fixture(params=FORWARDS)
def target(request):
    return tiny_target(request.param)


def states_with(target, prompts):
    out = []
    for p in prompts:
        s = target.new_state()
        target.prefill(s, p[:-1])
        out.append(s)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_batched_tree_logits_equal_each_sequences_own_forward(kind):
    from verispec.backends import CausalLM

    for lean in (True, False):
        base = tiny_model(kind)
        t = CausalLM(base.hf, None, name=base.name, lean=lean)
        trees = [Tree.parse("2x2"), Tree.root_only(), Tree.parse("chain:3"), Tree.parse("3,1")]
        g = torch.Generator().manual_seed(0)
        tokens = [torch.cat([torch.tensor(p[-1:]), torch.randint(3, 90, (tr.size - 1,), generator=g)])
                  for p, tr in zip(PROMPTS, trees)]
        together, alone = states_with(t, PROMPTS[:4]), states_with(t, PROMPTS[:4])
        pos = [s.committed + torch.tensor(tr.depths) for s, tr in zip(together, trees)]
        outs = t.forward_batch(together, tokens, pos, [tr.ancestors_mask() for tr in trees], features=(-1, 2))
        for s, tok, p, tr, out in zip(alone, tokens, pos, trees, outs):
            ref = t.forward(s, tok, p, tr.ancestors_mask(), features=(-1, 2))
            assert torch.allclose(out.logits, ref.logits, atol=1e-5), (kind, lean, tr.describe())
            assert torch.allclose(out.hidden, ref.hidden, atol=1e-5)
        # commit different paths in each, then a one-token step of all together equals each alone again
        keeps = [[0, 2, 6], [0], [0, 1], [0, 3]]
        for state in (together, alone):
            for s, keep in zip(state, keeps):
                t.commit(s, keep)
        nxt = [torch.tensor([11 + i]) for i in range(4)]
        one = [torch.ones(1, 1, dtype=torch.bool)] * 4
        outs = t.forward_batch(together, nxt, [torch.tensor([s.committed]) for s in together], one)
        for s, tok, out in zip(alone, nxt, outs):
            ref = t.forward(s, tok, torch.tensor([s.committed]), one[0]).logits
            assert torch.allclose(out.logits, ref, atol=1e-5), (kind, lean)


def test_logits_from_returns_each_sequences_rows_from_that_row_on(target):
    """``logits_from`` skips the output layer on a sequence's first rows (a prompt's, whose logits nobody reads) and
    returns the others as the full forward has them; at least the last row comes, whatever is asked."""
    prompts = [[5, 17, 33, 8, 61, 42], [7, 8, 9, 10, 7, 8, 9], [44, 3, 90]]
    masks = [torch.ones(len(p), len(p), dtype=torch.bool).tril() for p in prompts]
    for firsts in ([0, 3, 2], [5, 6, 9], [2]):
        n = len(firsts)
        args = ([torch.tensor(p) for p in prompts[:n]], [torch.arange(len(p)) for p in prompts[:n]], masks[:n])
        full = target.forward_batch([target.new_state() for _ in range(n)], *args, features=(-1,))
        part = target.forward_batch([target.new_state() for _ in range(n)], *args, features=(-1,), logits_from=firsts)
        for p, f, a, b in zip(prompts, firsts, full, part):
            first = min(f, len(p) - 1)
            assert b.logits.shape == (len(p) - first, target.vocab_size)
            assert torch.allclose(b.logits, a.logits[first:], atol=1e-4), (firsts, f)
            assert torch.equal(b.hidden, a.hidden)


def test_a_pooled_batch_attends_in_one_call_and_equals_each_sequence_alone():
    t = tiny_model("llama")
    pool = t.state_pool(4, 40)
    trees = [Tree.parse("2x2"), Tree.root_only(), Tree.parse("chain:3")]
    pooled, alone = [pool.acquire() for _ in trees], states_with(t, PROMPTS[:3])
    for s, p in zip(pooled, PROMPTS):
        t.prefill(s, p[:-1])
    assert [s.cache.slot for s in pooled] == [0, 1, 2]
    for step in range(3):  # a tree step, a commit of different paths, again
        tokens = [torch.tensor([3 + step] + [20 + step + k for k in range(tr.size - 1)]) for tr in trees]
        pos = [s.committed + torch.tensor(tr.depths) for s, tr in zip(pooled, trees)]
        outs = t.forward_batch(pooled, tokens, pos, [tr.ancestors_mask() for tr in trees])
        for s, tok, p, tr, out in zip(alone, tokens, pos, trees, outs):
            ref = t.forward(s, tok, p, tr.ancestors_mask())
            assert torch.allclose(out.logits, ref.logits, atol=1e-5), step
        for states in (pooled, alone):
            for s, keep in zip(states, ([0, 2, 6], [0], [0, 1])):
                t.commit(s, keep)
    pool.release(pooled[1])
    assert pool.acquire().cache.slot == 1  # a freed slot serves the next sequence
    assert pool.pool.capacity == 64  # 40 asked, rounded up to whole blocks of the invariant attention's spans
    with pytest.raises(VerispecError, match="sized for"):
        big = [pooled[0], pooled[2]]
        t.forward_batch(big, [torch.arange(60), torch.tensor([1])], [big[0].committed + torch.arange(60),
                                                                     torch.tensor([big[1].committed])],
                        [torch.ones(60, 60, dtype=torch.bool).tril(), torch.ones(1, 1, dtype=torch.bool)])


@pytest.mark.parametrize("forward", ["lean-bf16", "lean-bf16-native", "lean-native"])
def test_an_invariant_forwards_pooled_batch_over_several_blocks_of_keys_equals_each_sequence_alone_bit_for_bit(forward):
    """The invariant attention (in bfloat16 torch's products over whole blocks of keys summed in order, or the native
    kernels; in float32 the native kernels, attention and linear layers): a sequence's logits, bit for bit, whatever
    the longest sequence of its batch (which sets the span every slot reads) and its own tree's rows; and
    transformers' forward to its rounding."""
    from verispec.backends import CausalLM

    t = tiny_target(forward)
    if forward == "lean-native":
        assert t._lean.fused is not None and t._lean.native is None
    else:
        assert (t._lean.native is not None) == forward.endswith("native")
    stock = CausalLM(t.hf, None, name="stock", lean=False)  # transformers' forward, to its rounding
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (190, 7, 70, 129)]
    pool = t.state_pool(4, 256)
    pooled, alone, ref = [pool.acquire() for _ in prompts], states_with(t, prompts), states_with(stock, prompts)
    for s, p in zip(pooled, prompts):
        t.prefill(s, p[:-1])
    mixed = [Tree.parse("chain:3"), Tree.root_only(), Tree.parse("2x2"), Tree.root_only()]
    for step, trees in enumerate([mixed, mixed[::-1], [Tree.root_only()] * 4]):  # last: one query row each
        tokens = [torch.tensor(p[-1:] + [20 + step + k for k in range(tr.size - 1)]) for p, tr in zip(prompts, trees)]
        pos = [s.committed + torch.tensor(tr.depths) for s, tr in zip(pooled, trees)]
        outs = t.forward_batch(pooled, tokens, pos, [tr.ancestors_mask() for tr in trees])
        for s, r, tok, p, tr, out in zip(alone, ref, tokens, pos, trees, outs):
            assert torch.equal(out.logits, t.forward(s, tok, p, tr.ancestors_mask()).logits), (step, tr.describe())
            assert torch.allclose(out.logits, stock.forward(r, tok, p, tr.ancestors_mask()).logits, atol=0.1, rtol=0.02)
        for states in (pooled, alone, ref):
            for s in states:
                t.commit(s, [0])


def drafters(target):
    return {"ngram": NgramDrafter(target.vocab_size), "layerskip": layer_skip_drafter(target, 2),
            "model": ModelDrafter(tiny_model("llama", seed=1, layers=2)), "eagle": EagleDrafter(EagleHead(target)),
            "hybrid": HybridDrafter(layer_skip_drafter(target, 2), NgramDrafter(target.vocab_size))}


@pytest.mark.parametrize("verifier,tree,children", [("chain", "chain:3", "iid"), ("greedy", "2x2", "topk"),
                                                    ("specinfer", "2x2", "iid"), ("swor", "3,1", "swor"),
                                                    ("topk", "2x2", "topk"), ("traversal", "2x2", "swor"),
                                                    ("reserve", "2x2", "iid"), ("block", "chain:3", "iid")])
def test_greedy_batched_equals_greedy_alone_for_every_drafter_and_verifier(target, verifier, tree, children):
    for name, d in drafters(target).items():
        alone = [generate(target, d, verifier, p, tree=tree, policy="fixed", children=children, temperature=0.0,
                          max_new_tokens=16).token_ids for p in PROMPTS]
        # three slots for five prompts: sequences leave as they finish and the waiting ones join
        batch = generate_batch(target, d, verifier, PROMPTS, tree=tree, policy="fixed", children=children,
                               temperature=0.0,
                               max_new_tokens=[16, 9, 16, 5, 16], max_batch=3)
        got = [b.token_ids for b in batch]
        assert got == [a[:n] for a, n in zip(alone, [16, 9, 16, 5, 16])], (name, verifier)
        assert all(b.error is None for b in batch)


def test_prompts_joining_by_chunks_give_the_tokens_of_decoding_alone_and_skip_the_output_layer(target):
    """With ``prefill_chunk``, a joining prompt runs a few rows at a time beside the others' trees: its features go to
    the draft, its logits are never read, so only its last row's are computed; the tokens are those of decoding each
    prompt alone (greedy), for drafts that read the target's features and drafts that do not."""
    forward, logit_rows = target.forward_batch, []

    def counted(states, tokens, positions, attends, features=(-1,), logits_from=None):
        outs = forward(states, tokens, positions, attends, features=features, logits_from=logits_from)
        logit_rows.extend((len(t), len(o.logits), bool(logits_from and f == len(t) - 1))
                          for t, o, f in zip(tokens, outs, logits_from or [0] * len(outs)))
        return outs

    target.forward_batch = counted
    for name in ("eagle", "hybrid", "ngram"):
        d = drafters(target)[name]
        engine = Engine(target, max_batch=3, prefill_chunk=2)
        seqs = [engine.submit(p, Recipe(get_verifier("chain"), Tree.parse("chain:3"), d.fork()),
                              sampling=Sampling(0.0), max_new_tokens=12) for p in PROMPTS]
        run_all(engine)
        for s, p in zip(seqs, PROMPTS):
            alone = generate(target, d.fork(), "chain", p, tree="chain:3", policy="fixed", temperature=0.0,
                             max_new_tokens=12)
            assert s.token_ids == alone.token_ids, name
    chunks = [(rows, got) for rows, got, only in logit_rows if only]
    assert chunks and all(got == 1 for _, got in chunks) and any(rows > 1 for rows, _ in chunks)
    assert all(got == rows for rows, got, only in logit_rows if not only)


def test_sequences_join_and_leave_between_steps(target):
    engine = Engine(target, max_batch=2)
    d = NgramDrafter(target.vocab_size)
    seqs = [engine.submit(p, Recipe(get_verifier("chain"), Tree.parse("chain:3"), d.fork()),
                          sampling=Sampling(0.0), max_new_tokens=n, id=i)
            for i, (p, n) in enumerate(zip(PROMPTS[:4], [3, 12, 6, 12]))]
    seen = []
    while engine.has_work:
        stepped = engine.step()
        seen.append(sorted(s.id for s in stepped))
        assert len(engine.running) <= 2
        assert all(s not in engine.running for s in seqs if s.done)  # a finished sequence frees its slot at once
    assert seen[0] == [0, 1] and any(2 in ids for ids in seen) and seen[-1] == [3]
    for s, p, n in zip(seqs, PROMPTS, [3, 12, 6, 12]):
        ref = generate(target, NgramDrafter(target.vocab_size), "chain", p, tree="chain:3", policy="fixed",
                       temperature=0.0,
                       max_new_tokens=n)
        assert s.token_ids == ref.token_ids and s.stop_reason == ref.stop_reason and s.state is None


def test_the_same_seed_gives_the_same_sample_as_alone(target):
    """At T > 0 with a fixed draft length, a sequence's random calls are its own: the same tokens as alone."""
    d = layer_skip_drafter(target, 2)
    alone = [generate(target, d, "chain", p, tree="chain:3", policy="fixed", temperature=0.8, seed=10 + i,
                      max_new_tokens=20)
             for i, p in enumerate(PROMPTS)]
    batch = generate_batch(target, d, "chain", PROMPTS, tree="chain:3", policy="fixed", temperature=0.8, seed=10,
                           max_new_tokens=20)
    assert [b.token_ids for b in batch] == [a.token_ids for a in alone]
    assert [len(b.steps) for b in batch] == [len(a.steps) for a in alone]
    assert max(s.batch for b in batch for s in b.steps) == len(PROMPTS)


def test_two_sequences_sharing_steps_have_the_product_of_the_target_laws():
    """Enumerated: every random outcome of both sequences, with auto policies whose depths the load-aware plan
    chooses for the pair (so one sequence's lengths depend on the other's history); the joint law of their 2 tokens
    each is the product of the target's laws, to rounding."""
    p, q = random_tables(3, 11, concentration=0.8)
    # rows dear past two: the plan drafts 1 each or nothing, by what both policies have learned so far (a depth of
    # 2 for both would make the enumeration twentyfold)
    costs = BatchCosts(rows=(1, 2, 4, 8), seconds_by_rows=(1.0, 1.03, 1.4, 3.0), per_sequence=0.01)

    def policy():
        return AutoDepth(costs=(1.0, 1.1, 1.2), probe_every=2, prior=0.6)

    contexts = [(0,), (1, 2)]
    law = batch_loop_law(get_verifier("chain"), p, q, Tree.chain(2), 3, 2, contexts, policy, costs=costs)
    a, b = target_law(p, contexts[0], 2, 3), target_law(p, contexts[1], 2, 3)
    joint = torch.einsum("ij,kl->ijkl", a, b)
    dense = torch.zeros_like(joint)
    for (x, y), w in law.items():
        dense[x + y] += w
    assert tv_and_kl(joint.flatten(), dense.flatten())[0] < 1e-12
    # and the check can fail: a draft that skips the residual (a biased rule) is caught on the same enumeration
    biased = batch_loop_law(get_verifier("resispec"), p, q, Tree.chain(2), 3, 2, contexts, policy, costs=costs)
    dense = torch.zeros_like(joint)
    for (x, y), w in biased.items():
        dense[x + y] += w
    assert tv_and_kl(joint.flatten(), dense.flatten())[0] > 1e-3


def test_a_failing_sequence_fails_alone(target):
    class Fragile(NgramDrafter):
        def commit(self, draft, path):
            if self._indexed[:1] == [61]:  # the fifth prompt's sequence: its first step's commit raises
                raise RuntimeError("this draft broke")

    batch = generate_batch(target, Fragile(target.vocab_size), "chain", PROMPTS + [[], [3] * 300], tree="chain:3",
                           policy="fixed",
                           temperature=0.0, max_new_tokens=12)
    assert [b.stop_reason for b in batch][4:] == ["error", "error", "error"]
    assert batch[4].error == "this draft broke" and "empty" in batch[5].error and "context" in batch[6].error
    for b, p in zip(batch[:4], PROMPTS[:4]):
        ref = generate(target, NgramDrafter(target.vocab_size), "chain", p, tree="chain:3", policy="fixed",
                       temperature=0.0,
                       max_new_tokens=12)
        assert b.error is None and b.token_ids == ref.token_ids


def test_a_draft_that_raises_fails_its_sequence_alone(target):
    """Drafting is batched (one call for every sequence), yet a draft that raises for one sequence fails only it."""
    class Broken(NgramDrafter):
        def _root_sparse(self, context):
            if context[:1] == [61]:
                raise RuntimeError("this draft cannot propose")
            return super()._root_sparse(context)

    batch = generate_batch(target, Broken(target.vocab_size), "chain", PROMPTS, tree="chain:3", policy="fixed",
                           temperature=0.0,
                           max_new_tokens=12)
    assert batch[4].stop_reason == "error" and batch[4].error == "this draft cannot propose"
    for b, p in zip(batch[:4], PROMPTS[:4]):
        ref = generate(target, NgramDrafter(target.vocab_size), "chain", p, tree="chain:3", policy="fixed",
                       temperature=0.0,
                       max_new_tokens=12)
        assert b.error is None and b.token_ids == ref.token_ids


def test_a_failed_forward_fails_the_sequences_in_it_and_the_engine_goes_on():
    target = tiny_model("llama")
    forward, calls = target.forward_batch, []

    def once(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the forward broke")
        return forward(*a, **k)

    target.forward_batch = once
    engine = Engine(target, max_batch=2, isolate=True)
    kw = dict(sampling=Sampling(0.0), max_new_tokens=8)
    first = [engine.submit(p, Recipe(get_verifier("chain"), Tree.chain(2), NgramDrafter(target.vocab_size)), **kw)
             for p in PROMPTS[:2]]
    run_all(engine)
    assert [s.error for s in first] == ["the forward broke"] * 2 and not engine.running
    later = engine.submit(PROMPTS[2], Recipe(get_verifier("chain"), Tree.chain(2), NgramDrafter(target.vocab_size)),
                          **kw)
    run_all(engine)
    assert later.error is None and later.stop_reason in ("eos", "max_new_tokens") and later.token_ids


def test_the_load_aware_plan_drafts_less_when_rows_cost_more():
    trees = [Tree.chain(5)] * 4
    good = AutoDepth(prior=0.8, prior_weight=50.0).expected_tokens(5)  # a draft right 80 % of the time
    drafters = [NgramDrafter(97)] * 4
    cheap = BatchCosts(rows=(1, 32), seconds_by_rows=(1.0, 1.3), per_sequence=0.0)
    dear = BatchCosts(rows=(1, 32), seconds_by_rows=(1.0, 32.0), per_sequence=0.0)
    mid = BatchCosts(rows=(1, 8, 32), seconds_by_rows=(1.0, 1.2, 6.0), per_sequence=0.0)
    depth = {name: batch_depths([good] * 4, trees, drafters, c, [None] * 4)
             for name, c in (("cheap", cheap), ("mid", mid), ("dear", dear))}
    assert sum(depth["cheap"]) > sum(depth["mid"]) > sum(depth["dear"]) == 0
    # a sequence whose draft is right more often gets the rows first
    poor = AutoDepth(prior=0.2, prior_weight=50.0).expected_tokens(5)
    mixed = batch_depths([good, poor, good, poor], trees, drafters, mid, [None] * 4)
    assert mixed[0] >= mixed[1] and mixed[2] >= mixed[3] and mixed[0] > mixed[1]
    # a policy that plans its own depth keeps it
    assert batch_depths([None, good], trees[:2], drafters[:2], dear, [3, None])[0] == 3


def test_drafted_rows_beside_a_prompt_chunk_cost_what_rows_cost_that_far_up_the_table():
    """A step that also runs a joining prompt's chunk: its drafted rows cost the table's slope past the prompt's rows,
    while a drafted token is still judged against a plain step's rate (the prompt's own cost is owed whatever the
    plan). Where rows get dearer past 16, the plan drafts less beside 64 prompt rows; on a straight table, the
    same."""
    trees, drafters = [Tree.chain(3)] * 4, [NgramDrafter(97)] * 4
    good = AutoDepth(prior=0.8, prior_weight=50.0).expected_tokens(3)
    steep = BatchCosts(rows=(1, 16, 64), seconds_by_rows=(1.0, 1.3, 9.0), per_sequence=0.0)
    alone = batch_depths([good] * 4, trees, drafters, steep, [None] * 4)
    beside = batch_depths([good] * 4, trees, drafters, steep, [None] * 4, prompt_rows=64)
    assert 0 < sum(beside) < sum(alone)
    straight = BatchCosts(rows=(1, 256), seconds_by_rows=(1.0, 6.1), per_sequence=0.0)
    assert batch_depths([good] * 4, trees, drafters, straight, [None] * 4, prompt_rows=64) == \
        batch_depths([good] * 4, trees, drafters, straight, [None] * 4)


def test_padding_to_the_widest_tree_is_costed_for_every_sequence_of_the_batch():
    """A batch's attention pads every sequence to the widest tree: one sequence drafting deep costs them all, so
    where padding is dear the plan keeps the trees even (all at one depth) or drafts nothing."""
    rows = BatchCosts(rows=(1, 64), seconds_by_rows=(1.0, 1.3), per_sequence=0.0)
    assert rows.seconds(9, 8, 2) == rows.seconds(9, 8) and rows.seconds(9, 1, 2) == rows.seconds(9)
    padded = BatchCosts(rows.rows, rows.seconds_by_rows, 0.0, padding=(0.0, 0.05, 0.1, 0.15, 0.25, 0.35))
    assert padded.seconds(9, 8, 2) == pytest.approx(rows.seconds(9) + 8 * 0.05)
    assert padded.seconds(40, 8, 5) == pytest.approx(rows.seconds(40) + 8 * 0.2)  # between 4 and 6 rows
    assert padded.seconds(9, 1, 2) == rows.seconds(9)  # one sequence alone pads nothing
    # each drafted row reads its own sequence's cache: its cost grows with the batch's context
    keyed = BatchCosts(rows.rows, rows.seconds_by_rows, 0.0, padded.padding, per_key=1e-4)
    assert keyed.seconds(16, 8, 2, context=300) == pytest.approx(padded.seconds(16, 8, 2) + 8 * 300 * 1e-4)
    assert keyed.seconds(8, 8, 1, context=300) == rows.seconds(8)  # plain steps: the table alone
    assert keyed.seconds(9, 1, 2, context=300) == rows.seconds(9)  # one sequence's rows attend together
    # padding runs over the batch's longest sequence: on the line through its two measured contexts
    far = BatchCosts(rows.rows, rows.seconds_by_rows, 0.0, padded.padding,
                     long_padding=(0.0, 0.15, 0.3, 0.45, 0.75, 1.05))
    short, long_ = BATCH_CONTEXT, LONG_CONTEXT
    assert far.seconds(9, 8, 2, context=100, span=short) == pytest.approx(padded.seconds(9, 8, 2))
    assert far.seconds(9, 8, 2, context=100, span=long_) == pytest.approx(rows.seconds(9) + 8 * 0.15)
    assert far.seconds(9, 8, 2, context=100, span=(short + long_) / 2) == pytest.approx(rows.seconds(9) + 8 * 0.1)
    assert far.seconds(9, 8, 2, context=long_) == far.seconds(9, 8, 2, span=long_)  # span: the mean by default
    assert far.seconds(9, 8, 2, span=0) >= rows.seconds(9)  # never less than no padding
    assert far.seconds(8, 8, 1, span=long_) == rows.seconds(8)  # plain steps pad nothing
    trees, drafters = [Tree.chain(5)] * 8, [NgramDrafter(97)] * 8
    good = AutoDepth(prior=0.8, prior_weight=50.0).expected_tokens(5)
    poor = AutoDepth(prior=0.3, prior_weight=50.0).expected_tokens(5)
    # (a margin of 5 %: at the default's 10 % no single sequence of 8 moves the batch's rate enough to go deeper)
    free = batch_depths([good] + [poor] * 7, trees, drafters, rows, [None] * 8, margin=0.05)
    dear = batch_depths([good] + [poor] * 7, trees, drafters,
                        BatchCosts(rows.rows, rows.seconds_by_rows, 0.0, padding=(0.0, 0.1, 0.2, 0.3, 0.5, 0.7)),
                        [None] * 8, margin=0.05)
    assert free[0] > 1 and max(dear) < free[0]


def test_the_plan_drafts_for_the_whole_batch_where_no_sequence_alone_would_pay():
    """Costs a batch shares -- the draft model's forward, a step up in the forward's cost, the padding of every
    sequence's attention -- make one sequence drafting alone a loss where all of them drafting together is a clear
    gain (the shape measured here in bfloat16: 1-7 rows cost one plain step, 8 rows 1.18, 16 rows 1.31). The plan
    tries groups, so it crosses that step; the batch's rate it reaches is the best of the plans tried."""
    from verispec.planner import StepCost

    costs = BatchCosts(rows=(1, 7, 8, 16, 32), seconds_by_rows=(1.0, 1.0, 1.18, 1.31, 1.86), per_sequence=0.0,
                       padding=(0.0, 0.003, 0.013, 0.035, 0.055, 0.066))

    class Head(NgramDrafter):  # one draft model for the batch, a tenth of a plain step per depth
        depth_cost = 0.1

    head = Head(97)
    trees, proposers = [Tree.chain(3)] * 8, [head] * 8
    fair = AutoDepth(prior=0.45, prior_weight=50.0).expected_tokens(3)
    alone = StepCost([fair] * 8, trees, proposers, costs, [0] * 8)
    before = alone.rate()
    alone.add(0)
    assert alone.rate() < before  # one sequence alone: a loss
    together = StepCost([fair] * 8, trees, proposers, costs, [1] * 8)
    assert together.rate() > before * 1.1  # all eight: a clear gain
    depth = batch_depths([fair] * 8, trees, proposers, costs, [None] * 8)
    assert min(depth) >= 1 and StepCost([fair] * 8, trees, proposers, costs, depth).rate() >= together.rate()
    # where drafting is poor, no group pays either
    poor = AutoDepth(prior=0.1, prior_weight=50.0).expected_tokens(3)
    assert batch_depths([poor] * 8, trees, proposers, costs, [None] * 8) == [0] * 8


def test_a_probe_is_judged_at_the_margin_of_the_batch():
    """A policy probes a deeper depth where a good draft of it would yield tokens at a better rate than the batch's:
    in a large batch one sequence's depth moves the whole batch's rate little, so the batch's rate cannot judge it."""
    from verispec.planner import StepCost, pays

    rows = BatchCosts(rows=(1, 64), seconds_by_rows=(1.0, 1.6), per_sequence=0.0)  # each row about 1 % of a step
    trees, proposers = [Tree.chain(3)] * 16, [NgramDrafter(97)] * 16
    fair = AutoDepth(prior=0.5, prior_weight=50.0).expected_tokens(3)
    plan = StepCost([fair] * 16, trees, proposers, rows, [1] * 16)
    assert pays(plan, 0)  # 0.8 tokens for about 1 % of a step: far above the batch's rate
    assert plan.depths == [1] * 16  # judged without changing the plan
    dear = BatchCosts(rows=(1, 64), seconds_by_rows=(1.0, 64.0), per_sequence=0.0)  # a row costs a plain step
    assert not pays(StepCost([fair] * 16, trees, proposers, dear, [0] * 16), 0)
    deepest = StepCost([fair] * 16, trees, proposers, rows, [3] * 16)
    assert not pays(deepest, 0)  # no deeper depth in its tree


def test_a_forward_table_is_fitted_non_decreasing():
    """More rows never cost less: a measured table that says so is noise, fitted away by pooling the violators
    (the closest non-decreasing table in squared error; it keeps the total and leaves a sorted table alone)."""
    import random

    from verispec.backends.costs import _monotone

    assert _monotone([3.0, 1.0, 2.0, 5.0, 4.0]) == pytest.approx([2.0, 2.0, 2.0, 4.5, 4.5])
    assert _monotone([1.0, 2.0, 2.0, 7.0]) == [1.0, 2.0, 2.0, 7.0]
    rng = random.Random(0)
    for _ in range(200):
        ys = [rng.uniform(0, 10) for _ in range(rng.randint(1, 12))]
        fit = _monotone(ys)
        assert len(fit) == len(ys) and all(a <= b + 1e-12 for a, b in zip(fit, fit[1:]))
        assert sum(fit) == pytest.approx(sum(ys))


def test_batch_costs_are_measured_once_as_a_loaded_batch_meets_them(tmp_path, monkeypatch):
    """``batch_costs`` times a tiny target: a non-decreasing row table, padding measured with one sequence of 8
    drafting n rows (never negative, never less for wider), kept in the cache and read back without timing again."""
    from verispec.backends import costs as costs_mod

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    target = tiny_target("lean")
    measured = costs_mod.batch_costs(target, repeats=1)
    assert measured.rows == costs_mod.BATCH_SIZES and len(measured.padding) == len(costs_mod.PADDED_ROWS)
    ys = measured.seconds_by_rows
    assert all(a <= b for a, b in zip(ys, ys[1:])) and ys[0] > 0
    for pad in (measured.padding, measured.long_padding):  # at both contexts
        assert len(pad) == len(costs_mod.PADDED_ROWS) and pad[0] == 0.0
        assert all(0 <= a <= b for a, b in zip(pad, pad[1:]))
    monkeypatch.setattr(costs_mod, "_batch_seconds", lambda *a: pytest.fail("measured again"))
    assert costs_mod.batch_costs(target, measure=False) == measured


def test_a_measured_draft_is_costed_by_how_many_sequences_draft_each_depth():
    """Where a draft model's batch costs were measured (``DraftCosts``), a step's drafting costs the first depth
    of the sequences that draft plus each further depth of those that draft that deep, each by their number: a
    draft dearer by the sequence leaves more of a large batch undrafted than one whose forward costs the same for
    any number."""
    from verispec.drafters.costs import DraftCosts
    from verispec.planner import StepCost

    costs = BatchCosts(rows=(1, 64), seconds_by_rows=(1.0, 1.3), per_sequence=0.0)
    head = ModelDrafter.__new__(ModelDrafter)  # only its batch key is read
    head.model = object()
    per_sequence = DraftCosts((1, 8), first=(0.1, 0.8), further=(0.1, 0.8))  # a tenth of a step per sequence
    assert per_sequence.seconds([8, 8, 2]) == pytest.approx(0.8 + 0.8 + 0.2)
    assert per_sequence.seconds([0, 0]) == 0.0 and per_sequence.seconds([16]) == pytest.approx(1.6)  # the slope on
    trees, proposers = [Tree.chain(3)] * 8, [head] * 8
    fair = AutoDepth(prior=0.5, prior_weight=50.0).expected_tokens(3)
    plan = StepCost([fair] * 8, trees, proposers, costs, [2, 1, 0, 0, 0, 0, 0, 0], {head.batch_key: per_sequence})
    drafted = plan.seconds() - StepCost([fair] * 8, trees, proposers, costs, [0] * 8).seconds()
    assert drafted == pytest.approx(costs.seconds(11, 8) - costs.seconds(8, 8) + per_sequence.seconds([2, 1]))
    mark = plan.mark()
    plan.add(2)
    assert plan.seconds() - plan.costs.seconds(12, 8) == pytest.approx(per_sequence.seconds([3, 1]))
    plan.reset(mark)
    assert plan.depths[2] == 0 and plan.counts[head.batch_key] == [2, 1]
    flat = DraftCosts((1, 8), first=(0.05, 0.05), further=(0.05, 0.05))
    cheap = batch_depths([fair] * 8, trees, proposers, costs, [None] * 8, drafting={head.batch_key: flat})
    dear = batch_depths([fair] * 8, trees, proposers, costs, [None] * 8, drafting={head.batch_key: per_sequence})
    assert all(d > 0 for d in cheap) and sum(d > 0 for d in dear) < 8


def test_a_draft_that_sat_steps_out_is_charged_the_rows_it_catches_up_on():
    """A draft's first depth also runs the context its cache lacks (``Drafter.catch_up``): after steps it sat out,
    a drafting step pays ``DraftCosts.per_row`` for each such row, so the plan drafts less where drafts lag far
    behind. The prompt's rows are not charged (``_lag``): a joining sequence pays them once whenever it first drafts."""
    from types import SimpleNamespace

    from verispec.drafters.costs import DraftCosts
    from verispec.engine import _lag
    from verispec.planner import StepCost

    costs = BatchCosts(rows=(1, 64), seconds_by_rows=(1.0, 1.3), per_sequence=0.0)
    head = ModelDrafter.__new__(ModelDrafter)  # only its batch key is read
    head.model = object()
    drafts = {head.batch_key: DraftCosts((1, 8), first=(0.05, 0.05), further=(0.05, 0.05), per_row=0.01)}
    trees, proposers = [Tree.chain(3)] * 8, [head] * 8
    fair = AutoDepth(prior=0.5, prior_weight=50.0).expected_tokens(3)
    lag = [0, 10, 0, 0, 0, 0, 0, 30]
    plan = StepCost([fair] * 8, trees, proposers, costs, [1, 1, 2, 0, 0, 0, 0, 0], drafts, lag=lag)
    level = StepCost([fair] * 8, trees, proposers, costs, [1, 1, 2, 0, 0, 0, 0, 0], drafts)
    assert plan.seconds() - level.seconds() == pytest.approx(10 * 0.01)  # only drafting sequences pay theirs
    mark, level_mark = plan.mark(), level.mark()
    plan.add(7)
    level.add(7)
    assert plan.seconds() - level.seconds() == pytest.approx(40 * 0.01) and plan.depths[7] == 1
    plan.reset(mark)
    level.reset(level_mark)
    assert plan.seconds() - level.seconds() == pytest.approx(10 * 0.01)
    assert all(d > 0 for d in batch_depths([fair] * 8, trees, proposers, costs, [None] * 8, drafting=drafts))
    behind = batch_depths([fair] * 8, trees, proposers, costs, [None] * 8, drafting=drafts, lag=[40] * 8)
    assert behind == [0] * 8

    class Lagging:
        def catch_up(self, context):
            return 50

    joined = SimpleNamespace(context=list(range(60)), token_ids=[1, 2, 3])  # its prompt's rows: not charged
    assert _lag(joined, Lagging()) == 3
    assert _lag(SimpleNamespace(context=list(range(60)), token_ids=list(range(55))), Lagging()) == 49


def test_each_drafting_sequence_is_charged_its_verification():
    """A sequence that drafts turns each of its rows into a law over the vocabulary and runs its verifier; a plain one
    draws from one row. The plan charges each drafting sequence its ``VerifyCosts`` for its rows (none to a plain
    one, none where not measured), undone with the depths it came with; dear verification leaves a batch undrafted
    where free verification drafts it all."""
    from verispec.planner import StepCost
    from verispec.verifiers.costs import VerifyCosts

    costs = BatchCosts(rows=(1, 64), seconds_by_rows=(1.0, 1.3), per_sequence=0.0)
    check = VerifyCosts(first=0.02, further=0.005)
    assert check.seconds(1) == 0.0 and check.seconds(2) == 0.02 and check.seconds(4) == pytest.approx(0.03)
    trees, proposers = [Tree.chain(3)] * 8, [NgramDrafter(100)] * 8
    fair = AutoDepth(prior=0.5, prior_weight=50.0).expected_tokens(3)
    verify = [check] * 7 + [None]
    depths = [2, 1, 0, 0, 0, 0, 0, 3]
    plan = StepCost([fair] * 8, trees, proposers, costs, depths, verify=verify)
    free = StepCost([fair] * 8, trees, proposers, costs, depths)
    assert plan.seconds() - free.seconds() == pytest.approx(check.seconds(3) + check.seconds(2))
    mark = plan.mark()
    plan.add(2)
    plan.add(0)
    assert plan.checked == pytest.approx(check.seconds(4) + check.seconds(2) * 2)
    plan.reset(mark)
    assert plan.checked == pytest.approx(check.seconds(3) + check.seconds(2)) and plan.depths == depths
    cheap = batch_depths([fair] * 8, trees, proposers, costs, [None] * 8, verify=[VerifyCosts(0.0, 0.0)] * 8)
    dear = batch_depths([fair] * 8, trees, proposers, costs, [None] * 8, verify=[VerifyCosts(0.3, 0.0)] * 8)
    assert all(d > 0 for d in cheap) and dear == [0] * 8

    # an engine given its costs charges the verifications it is given (the bench measures them before its clock
    # starts), and none it would have to measure on another clock
    from types import SimpleNamespace

    from verispec.verifiers.costs import cost_key

    greedy, sampled = (SimpleNamespace(verifier=get_verifier("chain"), sampling=Sampling(t)) for t in (0.0, 0.7))
    given = CostBook(tiny_target("lean"), costs, verify={cost_key(greedy.verifier, greedy.sampling): check})
    assert given.verifying([(greedy.verifier, greedy.sampling), (sampled.verifier, sampled.sampling)]) == [check, None]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_costs_are_measured_once_per_verifier_and_cached(tmp_path, monkeypatch, temperature):
    """``verify_costs`` times ``step_verdict`` on chains of random laws for every verifier that verifies a chain of
    independent draws: never negative, kept in the cache by verifier and kind of sampling and read back without
    timing again; a greedy-only verifier under sampling and a verifier needing other children have none."""
    from verispec.verifiers import VERIFIERS
    from verispec.verifiers import costs as verify_mod

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    sampling = Sampling(temperature)
    measured = {}
    for name, spec in sorted(VERIFIERS.items()):
        if spec.greedy_only and not sampling.greedy:
            continue
        got = verify_mod.verify_costs(spec, sampling, 300, repeats=2)
        if "iid" not in spec.modes:
            assert got is None
            continue
        assert got.first >= 0 and got.further >= 0, name
        measured[name] = got
    assert "chain" in measured and len(measured) > 5
    monkeypatch.setattr(verify_mod, "_timed", lambda *a: pytest.fail("measured again"))
    for name, got in measured.items():
        assert verify_mod.verify_costs(VERIFIERS[name], sampling, 300, measure=False) == got
    assert verify_mod.verify_costs(VERIFIERS["chain"], sampling, 301, measure=False) is None  # another vocabulary
    threads = torch.get_num_threads()
    try:  # measured with other threads: another entry
        torch.set_num_threads(threads + 1)
        assert verify_mod.verify_costs(VERIFIERS["chain"], sampling, 300, measure=False) is None
    finally:
        torch.set_num_threads(threads)


def test_draft_costs_are_measured_once_per_draft_and_cached(tmp_path, monkeypatch):
    """``draft_costs`` times a tiny draft model drafting for 1..16 sequences at once: positive, kept in the cache and
    read back without timing again; a draft with nothing to measure (prompt lookup) has none."""
    from verispec.drafters import costs as draft_mod

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    target = tiny_target("lean")
    head = EagleHead(target)
    for drafter in (layer_skip_drafter(target, 1), EagleDrafter(head)):  # the head drafts from the target's features
        measured = draft_mod.draft_costs(target, drafter, repeats=1)
        assert measured.sizes == draft_mod.DRAFT_BATCHES and all(x > 0 for x in measured.first)
        assert all(x >= 0 for x in measured.further) and measured.per_row >= 0
    monkeypatch.setattr(draft_mod, "_timed", lambda *a: pytest.fail("measured again"))
    assert draft_mod.draft_costs(target, layer_skip_drafter(target, 1), measure=False) is not None
    assert draft_mod.draft_costs(target, EagleDrafter(head), measure=False) == measured
    assert draft_mod.draft_costs(target, NgramDrafter(target.vocab_size)) is None


def test_the_engine_plans_for_the_batch_and_keeps_the_policys_own_plan_alone(target):
    def run(costs):
        engine = Engine(target, max_batch=4, costs=CostBook(target, costs))
        policy = lambda: AutoDepth(costs=(1.0, 1.05, 1.1, 1.15, 1.2), probe_every=1000, prior=0.9)  # noqa: E731
        seqs = [engine.submit(p, Recipe(get_verifier("chain"), Tree.chain(4), layer_skip_drafter(target, 2),
                                        policy=policy()), sampling=Sampling(0.0), max_new_tokens=10)
                for p in PROMPTS[:4]]
        run_all(engine)
        return seqs

    cheap = run(BatchCosts(rows=(1, 64), seconds_by_rows=(1.0, 1.1), per_sequence=0.0))
    dear = run(BatchCosts(rows=(1, 64), seconds_by_rows=(1.0, 64.0), per_sequence=0.0))
    assert any(s.drafted for seq in cheap for s in seq.steps if s.batch > 1)  # rows nearly free: drafting pays
    assert all(s.drafted == 0 for seq in dear for s in seq.steps if s.batch > 1)  # rows too dear to draft
    alone = [generate(target, layer_skip_drafter(target, 2), "chain", p, tree="chain:4",
                      policy=AutoDepth(costs=(1.0, 1.05, 1.1, 1.15, 1.2), probe_every=1000, prior=0.9),
                      temperature=0.0, max_new_tokens=10) for p in PROMPTS[:4]]
    assert any(s.drafted for a in alone for s in a.steps)  # alone, the policy's own plan drafts
    for runs in (cheap, dear):  # greedy: the lengths change, never the text
        assert [s.token_ids for s in runs] == [a.token_ids for a in alone]


def test_what_the_engine_refuses():
    from verispec.backends.llama import LlamaCppTarget

    t = tiny_model("llama")
    with pytest.raises(VerispecError, match="max_batch"):
        Engine(t, max_batch=0)
    with pytest.raises(VerispecError, match="row budget"):
        Engine(t, max_batch=4, row_budget=2)
    engine = Engine(t)
    recipe = Recipe(get_verifier("chain"), Tree.chain(2), NgramDrafter(t.vocab_size))
    for bad, message in (([], "empty"), ([1000], "lie in"), ([1] * 300, "context")):
        with pytest.raises(VerispecError, match=message):
            engine.submit(bad, recipe, max_new_tokens=4, sampling=Sampling(0.0))
    with pytest.raises(VerispecError, match="one sequence at a time, not a batch of 2"):
        LlamaCppTarget.forward_batch(None, [object(), object()], [], [], [])
    with pytest.raises(VerispecError, match="by name"):
        generate_batch(t, Contrarian(t.vocab_size), "chain", PROMPTS, policy=Fixed())


def test_a_draft_model_says_how_many_rows_its_first_depth_runs():
    """``Drafter.catch_up``: the rows a draft model's first depth runs, what its cache lacks -- every pair of the
    prompt at first, then one per committed token; prompt lookup has no cache."""
    target = tiny_target("lean")
    prompt = [5, 17, 33, 8, 61, 42]
    for drafter in (EagleDrafter(EagleHead(target)), layer_skip_drafter(target, 1)):
        drafter.reset(prompt)
        state = target.new_state()
        pre = target.prefill_output(state, prompt[:-1], features=drafter.feature_layers)
        if drafter.uses_target_hidden:
            drafter.observe(pre.hidden)
        first = drafter.catch_up(prompt)
        assert first == len(prompt) - (1 if drafter.uses_target_hidden else 0)
        draft = drafter.propose(prompt, Tree.chain(2), Sampling(0.0), "iid", TorchRandomness(0))
        drafter.commit(draft, [])
        assert drafter.catch_up(prompt) == 1  # the same context again: its last entry is recomputed
        longer = prompt + [9, 10, 11]
        if drafter.uses_target_hidden:
            drafter.observe(torch.zeros(3, pre.hidden.shape[1]))
        assert drafter.catch_up(longer) == 3
    assert NgramDrafter(target.vocab_size).catch_up(prompt) == 0
