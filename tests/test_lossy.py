"""The lossy family (adasd, fsd, typical, bild): the choices AdaSD leaves open, distortion computed
two ways, and robustness on degenerate distributions."""

import dataclasses
import math

import pytest
import torch
from conftest import tiny_model

from verispec import Tree, generate, get_verifier
from verispec.audit.distortion import distortion, monte_carlo_position, position_stats, warm_state
from verispec.audit.law import random_tables, target_law, tv_and_kl, verifier_law
from verispec.drafters import ModelDrafter
from verispec.drafters.base import Draft
from verispec.errors import VerispecError
from verispec.rng import TorchRandomness
from verispec.verifiers.chain import exact_rule, position_law
from verispec.verifiers.lossy import (
    COLLABORATIVE,
    LOSSY,
    TRUNCATION,
    AdaSDState,
    adasd_rule,
    gaussian_kde,
    js_distance,
    js_divergence,
)

V = 8


def random_pair(seed, vocab=V, concentration=0.7):
    gen = torch.Generator().manual_seed(seed)
    d = torch.distributions.Dirichlet(torch.full((vocab,), concentration, dtype=torch.float64))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return d.sample(), d.sample()


def test_js_divergence_and_distance():
    p, q = random_pair(0)
    assert float(js_divergence(p, p)) == pytest.approx(0, abs=1e-12)
    assert float(js_divergence(p, q)) == pytest.approx(float(js_divergence(q, p)), abs=1e-12)
    a = torch.tensor([1.0, 0, 0], dtype=torch.float64)
    b = torch.tensor([0, 0.5, 0.5], dtype=torch.float64)
    assert float(js_divergence(a, b)) == pytest.approx(1.0, abs=1e-12)  # disjoint supports: 1 bit
    m = 0.5 * (p + q)  # against the definition
    ref = 0.5 * (p * (p / m).log2()).sum() + 0.5 * (q * (q / m).log2()).sum()
    assert float(js_divergence(p, q)) == pytest.approx(float(ref), abs=1e-12)
    assert float(js_distance(p, q)) == pytest.approx(math.sqrt(float(ref)), abs=1e-12)


def test_kde_is_a_density():
    samples = torch.tensor([0.1, 0.2, 0.25, 0.4], dtype=torch.float64)
    grid = torch.linspace(-2, 3, 20001, dtype=torch.float64)
    mass = float(gaussian_kde(samples, grid).sum() * (grid[1] - grid[0]))
    assert mass == pytest.approx(1.0, abs=1e-6)


def test_adasd_probability_edges_and_data_requirement():
    state = AdaSDState()
    d = torch.tensor([0.0, 0.3, 0.7, 1.0], dtype=torch.float64)
    assert state.accept_probability(d).tolist() == [1.0, 0.0, 0.0, 0.0]  # no data: lossless
    state.update([(0.2, True), (0.25, True), (0.8, False)])
    assert not state.has_data and state.accept_probability(d).tolist() == [1.0, 0.0, 0.0, 0.0]
    state.update([(0.85, False)])
    b = state.accept_probability(d)
    assert state.has_data and b[0] == 1.0 and b[3] == 0.0  # 0 and 1 decided directly
    assert b[1] > 0.9 and b[2] < 0.1  # close to the accepted / rejected clusters
    same = AdaSDState(accepted=[0.3, 0.5], rejected=[0.3, 0.5])  # same samples: same density, same prior
    assert float(same.accept_probability(torch.tensor([0.45]))) == pytest.approx(0.5, abs=1e-12)


def test_adasd_is_exact_chain_sampling_until_it_has_data():
    spec = get_verifier("adasd")
    fresh = dataclasses.replace(spec, new_state=lambda: AdaSDState())  # no ``example``: audited fresh
    for case in range(12):
        p, q = random_tables(4, 100 + case, concentration=0.7)
        tree = Tree.chain(1 + case % 3)
        tv, _ = tv_and_kl(target_law(p, (0,), tree.max_depth + 1, 4), verifier_law(fresh, p, q, tree, 4))
        assert tv < 1e-12
    trained = max(tv_and_kl(target_law(p, (0,), 3, 4), verifier_law(spec, p, q, Tree.chain(2), 4))[0]
                  for p, q in (random_tables(4, 200 + c, concentration=0.7) for c in range(12)))
    assert trained > 1e-3  # with data (the audit's example state) it is biased, and the audit sees it


def test_adasd_labels_by_the_lossless_coin():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    d = float(js_distance(p, q))
    state = AdaSDState(accepted=[d - 0.01, d, d + 0.01], rejected=[0.97, 0.98])  # Bayesian coin ~ certain
    draft = Draft(Tree.chain(1), torch.tensor([0, 2]), torch.stack([q, torch.zeros_like(q)]),
                  torch.tensor([1.0, 0.6], dtype=torch.float64), "iid")
    verdict = get_verifier("adasd")(draft, torch.stack([p, p]), TorchRandomness(0), state)
    assert verdict.path == (1,)  # p(x) = 0, yet accepted by the Bayesian coin
    assert verdict.feedback == ((pytest.approx(d), False),)  # learned as a lossless rejection


def test_adasd_learns_through_the_loop():
    target = tiny_model("llama", seed=0, layers=4)
    target.eos_token_ids = frozenset()
    state = AdaSDState()
    generate(target, ModelDrafter(tiny_model("llama", seed=1, layers=2)), get_verifier("adasd"), [5, 17, 33, 8],
             tree=Tree.chain(4), policy="fixed", max_new_tokens=40, temperature=1.0, verifier_state=state)
    assert len(state.accepted) + len(state.rejected) > 10 and state.has_data


def lossy_specs():
    return [get_verifier(n) for n in LOSSY] + [get_verifier("chain")]


def state_for(spec):
    return AdaSDState.example() if spec.new_state is not None else None


@pytest.mark.parametrize("name", [*LOSSY, "chain"])
def test_distortion_analytic_law_matches_monte_carlo(name):
    spec = get_verifier(name)
    draws = 6000
    for seed in range(3):
        p, q = random_pair(seed)
        law = position_law(spec.position_rule, p, q, state_for(spec))
        assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
        emp = monte_carlo_position(spec, p, q, draws, seed=seed, state=state_for(spec))
        se = (law * (1 - law) / draws).sqrt()
        assert float(0.5 * (emp - law).abs().sum()) <= float(0.5 * 4 * se.sum()) + 1e-12
    if name == "chain":
        assert torch.allclose(position_law(exact_rule, p, q), p, atol=1e-12)


def test_monte_carlo_can_tell_a_biased_law_from_p():
    spec = get_verifier("typical")
    p, q = random_pair(5)
    emp = monte_carlo_position(spec, p, q, 6000, seed=5)
    law = position_law(spec.position_rule, p, q)
    assert float(0.5 * (law - p).abs().sum()) > 0.05
    assert float(0.5 * (emp - p).abs().sum()) > float(0.5 * 4 * (p * (1 - p) / 6000).sqrt().sum())


DEGENERATE = {
    "one-hot same": (torch.eye(V, dtype=torch.float64)[2], torch.eye(V, dtype=torch.float64)[2]),
    "one-hot disjoint": (torch.eye(V, dtype=torch.float64)[2], torch.eye(V, dtype=torch.float64)[5]),
    "disjoint supports": (torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0], dtype=torch.float64),
                          torch.tensor([0, 0, 0.25, 0.25, 0.25, 0.25, 0, 0], dtype=torch.float64)),
    "uniform vs one-hot": (torch.full((V,), 1.0 / V, dtype=torch.float64), torch.eye(V, dtype=torch.float64)[0]),
}


@pytest.mark.parametrize("case", list(DEGENERATE))
@pytest.mark.parametrize("name", LOSSY)
def test_lossy_rules_survive_degenerate_distributions(name, case):
    spec = get_verifier(name)
    p, q = DEGENERATE[case]
    law = position_law(spec.position_rule, p, q, state_for(spec))
    assert torch.isfinite(law).all() and float(law.sum()) == pytest.approx(1.0, abs=1e-12)
    rng = TorchRandomness(1)
    for _ in range(20):
        x = int(rng.categorical(q))
        draft = Draft(Tree.chain(2), torch.tensor([0, x, x]), torch.stack([q, q, torch.zeros_like(q)]),
                      torch.tensor([1.0, float(q[x]), float(q[x])], dtype=torch.float64), "iid")
        v = spec(draft, torch.stack([p, p, p]), rng, state_for(spec))
        assert 0 <= v.token < V and (v.path or p[v.token] > 0)
    if case.startswith("one-hot") and name in TRUNCATION:  # temperature 0: exactly greedy
        assert torch.allclose(law, p)
    if case == "disjoint supports" and name in ("adasd", "fsd"):
        assert torch.allclose(law, p)  # JS = 1: always rejected


def test_distortion_rows_and_warm_state():
    pairs = [random_pair(s, vocab=12) for s in range(40)]
    specs = lossy_specs()
    rows = {r.verifier: r for r in distortion(specs, pairs, temperature=1.0)}
    assert rows["chain"].max_tv < 1e-12 and rows["chain"].mean_overshoot < 1e-12
    assert rows["chain"].acceptance == pytest.approx(rows["chain"].exact_acceptance)
    for name in LOSSY:
        assert rows[name].mean_tv > 1e-3, name
        assert rows[name].acceptance >= 0 and rows[name].mean_overshoot >= 0
    assert rows["adasd"].acceptance >= rows["adasd"].exact_acceptance - 1e-12  # AdaSD never accepts less
    state = warm_state(get_verifier("adasd"), pairs)
    assert 0 < len(state.accepted) + len(state.rejected) <= len(pairs)
    s = position_stats(get_verifier("adasd"), torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs]),
                       state)
    assert float(s["tv"].mean()) == pytest.approx(rows["adasd"].mean_tv)


def test_adasd_rule_never_accepts_less_than_exact():
    state = AdaSDState.example()
    for seed in range(20):
        p, q = random_pair(seed)
        a, _ = adasd_rule(p, q, state)
        a0, _ = exact_rule(p, q)
        assert (a >= a0 - 1e-15).all() and (a <= 1 + 1e-15).all()


def test_parametrised_rules():
    assert get_verifier("fsd").param == 0.3 and get_verifier("fsd:0.1").name == "fsd:0.1"
    assert get_verifier("bild:3").param == 3.0 and not get_verifier("bild:3").exact
    with pytest.raises(VerispecError, match="takes no parameter"):
        get_verifier("chain:2")
    with pytest.raises(VerispecError, match="bad parameter"):
        get_verifier("fsd:abc")
    p, q = random_pair(3)
    loose, strict = get_verifier("fsd:1.01"), get_verifier("fsd:0")
    assert torch.allclose(position_law(strict.position_rule, p, q), p)  # never accepts: draws from p
    assert torch.allclose(position_law(loose.position_rule, p, q), q)  # always accepts: the draft's law


@pytest.mark.parametrize("seed", range(8))
def test_collaborative_rules_have_their_closed_form_distortion_and_acceptance(seed):
    """mix:l emits (1 - l) p + l q (total variation l TV(p, q)); budget:e moves p towards q by at most e of total
    variation, and accepts 1 - max(TV(p, q) - e, 0)."""
    p, q = random_pair(seed)
    tv = float(0.5 * (p - q).abs().sum())
    for weight in (0.0, 0.2, 0.7):
        rule = get_verifier(f"mix:{weight}").position_rule
        law = position_law(rule, p, q)
        assert torch.allclose(law, (1 - weight) * p + weight * q, atol=1e-12)
        assert float(0.5 * (law - p).abs().sum()) == pytest.approx(weight * tv, abs=1e-12)
    for eps in (0.0, 0.05, 0.3, 1.0):
        rule = get_verifier(f"budget:{eps}").position_rule
        law = position_law(rule, p, q)
        assert float(0.5 * (law - p).abs().sum()) == pytest.approx(min(eps, tv), abs=1e-12)
        accept, _ = rule(p, q)
        assert float((q * accept).sum()) == pytest.approx(1 - max(tv - eps, 0.0), abs=1e-12)
    assert set(COLLABORATIVE) <= set(LOSSY) and not set(COLLABORATIVE) & set(TRUNCATION)
    with pytest.raises(VerispecError, match="mix:l"):
        get_verifier("mix:1.5")
