"""Sequoia-style tree search: hand-worked optima, and the tuner end to end on a tiny model."""

import itertools

import pytest
from conftest import tiny_model

from verispec.drafters import NgramDrafter, layer_skip_drafter
from verispec.errors import VerispecError
from verispec.tree import Tree
from verispec.treesearch import best_shape, positional_acceptance, tree_spec, tree_table


def expected_accepted(tree: Tree, p) -> float:
    """Sum over drafted nodes of the product of p along their path (the model's objective)."""
    value, prob = 0.0, {0: 1.0}
    for node in range(1, tree.size):
        prob[node] = prob[tree.parents[node]] * p[tree.ranks[node]]
        value += prob[node]
    return value


def test_hand_worked_optima():
    # 2 drafted nodes: chain 0.6 + 0.36 = 0.96 beats two children 0.6 + 0.2 = 0.8 ...
    t = tree_table([0.6, 0.2], 3, 2)
    assert t.value[2][3] == pytest.approx(0.96) and t.tree(3, 2).is_chain
    assert t.value[1][3] == pytest.approx(0.8) and t.tree(3, 1).parents == (-1, 0, 0)
    # ... and loses to them when the second candidate is likely: 0.5 + 0.4 = 0.9 > 0.5 + 0.25
    t = tree_table([0.5, 0.4], 3, 2)
    assert t.value[2][3] == pytest.approx(0.9) and t.tree(3, 2).parents == (-1, 0, 0)
    # 4 drafted nodes, p = (0.7, 0.2): the chain of 4 (0.7 + 0.49 + 0.343 + 0.2401 = 1.7731) beats a chain of 3
    # with a second child at the root (0.7 + 0.49 + 0.343 + 0.2 = 1.733), the best of depth <= 3
    t = tree_table([0.7, 0.2], 5, 4)
    assert t.value[4][5] == pytest.approx(0.7 + 0.49 + 0.343 + 0.2401) and t.tree(5, 4).is_chain
    assert t.value[3][5] == pytest.approx(0.7 + 0.49 + 0.343 + 0.2)
    assert t.value[1][5] == -float("inf")  # 4 children of the root: only 2 ranks exist


def all_trees(n_nodes, k, depth):
    """Every tree with n_nodes drafted nodes, at most k children per node and depth <= depth (brute force)."""
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    for combo in itertools.combinations(paths, n_nodes):
        s = set(combo)
        if all(p[:-1] in s or len(p) == 1 for p in combo) and all(p[-1] == 0 or (*p[:-1], p[-1] - 1) in s for p in combo):
            yield Tree.from_paths(sorted(combo, key=lambda p: (len(p), p)))


def test_dynamic_programme_equals_brute_force():
    p = [0.5, 0.25, 0.1]
    table = tree_table(p, 7, 3)
    for n in range(1, 7):
        for d in (1, 2, 3):
            best = max((expected_accepted(t, p) for t in all_trees(n, 3, d)), default=-float("inf"))
            assert table.value[d][n + 1] == pytest.approx(best), (n, d)
            if best > -float("inf"):
                assert expected_accepted(table.tree(n + 1, d), p) == pytest.approx(best)


def test_best_shape_trades_acceptance_for_cost_and_specs_round_trip():
    p = positional_acceptance([0.8, 0.5, float("nan")])
    assert p == pytest.approx([0.8, 0.1, 0.0])
    # free tree tokens, costly depth -> wide and shallow; costly tokens, free depth -> a long chain
    wide, _ = best_shape(p, lambda n, d: 1 + 0.0 * n + 2.0 * d, max_nodes=12, max_depth=6)
    deep, _ = best_shape(p, lambda n, d: 1 + 0.3 * n + 0.0 * d, max_nodes=12, max_depth=6)
    assert wide.depth <= 2 and deep.tree.is_chain and deep.depth >= 2
    for tree in (wide.tree, deep.tree, Tree.parse("3,1,2")):
        assert Tree.parse(tree_spec(tree)).parents == tree.parents
    with pytest.raises(VerispecError, match="sum to at most 1"):
        tree_table([0.7, 0.5], 4, 2)


def test_tune_tree_runs_on_a_tiny_model(monkeypatch):
    import verispec.tune as tune

    target = tiny_model("llama")
    def prompts(n, from_end=False):
        assert from_end  # tuning never measures on the benchmark's first questions
        return [("x", "p")] * n

    monkeypatch.setattr(tune, "spec_bench_prompts", prompts)
    monkeypatch.setattr(target, "encode_prompt", lambda text, chat=True: [5, 9, 31, 7, 5, 9, 31])
    for drafter in (layer_skip_drafter(target, 2), NgramDrafter(target.vocab_size)):
        report = tune.tune_tree(target, drafter, prompts=2, max_new_tokens=12, width=2, max_nodes=8, max_depth=4,
                                log=lambda m: None)
        tree = Tree.parse(report["best"]["tree"])
        assert tree.size - 1 == report["best"]["nodes"] <= 8 and report["best"]["accepted"] >= 1.0
        assert len(report["conditional_acceptance"]) == 2 and report["target_forward_s"]["1"] > 0
        costs = report["step_costs"]
        assert report["step_costs_from"] == "loop" and len(costs) == 5 and costs[0] == 1.0
        assert all(b >= a for a, b in zip(costs, costs[1:])) and len(report["step_costs_by_parts"]) == 5


def test_loop_step_costs_are_whole_steps_by_drafted_depth(monkeypatch):
    """The auto policy's step costs as the loop pays them: the mean whole step (draft, target, verification) at each
    drafted depth over the plain one, steps that drafted less than asked and each prompt's first step left out, never
    decreasing; None where a depth ran no step of its own."""
    import verispec.tune as tune
    from verispec.sequence import StepRecord

    def step(depth, seconds):
        return StepRecord(drafted=depth, draft_depth=depth, accepted_length=1, accepted_ranks=(), tested=(),
                          emitted=(1,), draft_s=seconds / 2, target_s=seconds / 4, verify_s=seconds / 4, source=None,
                          batch=1)

    runs = {0: [50.0, 1.0, 1.0, 1.0], 1: [50.0, 1.5, 1.7, step(0, 1.0)], 2: [50.0, 1.4, 1.4]}  # seconds a step

    def fake(target, drafter, verifier, prompt, *, tree, **kw):
        d = tree.max_depth
        assert kw["policy"] == "fixed" and tree.is_chain
        return type("Out", (), {"steps": [s if isinstance(s, StepRecord) else step(d, s) for s in runs[d]]})()

    monkeypatch.setattr(tune, "generate", fake)
    costs = tune.loop_step_costs(None, None, None, [[1, 2]], 0.0, "topk", 2, 8)
    assert costs == pytest.approx([1.0, 1.6, 1.6])  # depth 2 measured 1.4: never cheaper deeper
    runs[2] = [50.0, step(1, 1.4)]
    assert tune.loop_step_costs(None, None, None, [[1, 2]], 0.0, "topk", 2, 8) is None
