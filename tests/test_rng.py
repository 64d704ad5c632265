import pytest
import torch

from verispec.rng import TorchRandomness, enumerate_outcomes


def test_enumeration_is_a_law():
    p = torch.tensor([0.2, 0.0, 0.8], dtype=torch.float64)

    def fn(rng):
        a = int(rng.categorical(p))
        coin = bool(rng.bernoulli(torch.tensor(0.25)))
        return a, coin

    out = enumerate_outcomes(fn)
    law = {v: w for w, v in out}
    assert len(out) == 4  # token 1 has probability 0 and is never offered
    assert abs(sum(law.values()) - 1) < 1e-15
    assert abs(law[(2, True)] - 0.2) < 1e-15


def test_torch_randomness_is_seeded_and_never_draws_zero_mass():
    p = torch.tensor([0.0, 0.5, 0.0, 0.5])
    a = TorchRandomness(3).categorical(p.expand(1000, 4))
    b = TorchRandomness(3).categorical(p.expand(1000, 4))
    assert torch.equal(a, b)
    assert set(a.tolist()) == {1, 3}
    assert TorchRandomness(0).bernoulli(torch.tensor([0.0, 1.0])).tolist() == [False, True]


def test_point_mass_rows_are_drawn_by_argmax_without_changing_later_draws(monkeypatch):
    """A greedy row takes the reduction shortcut; the draw and the stream after it equal inverse-CDF sampling's."""
    import verispec.rng

    one_hot = torch.zeros(2, 50)
    one_hot[0, 7], one_hot[1, 0] = 1.0, 1.0
    law = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), 0)
    fast, slow = TorchRandomness(5), TorchRandomness(5)
    assert fast.categorical(one_hot).tolist() == [7, 0]
    cdf = torch.cumsum(one_hot.double(), -1)  # the inverse-CDF draw, by hand, on the same uniform numbers
    u = slow.uniform((2, 1))
    assert torch.searchsorted(cdf, u, right=True).squeeze(-1).tolist() == [7, 0]
    assert torch.equal(fast.categorical(law.expand(100, -1)), slow.categorical(law.expand(100, -1)))
    almost = one_hot.clone()
    almost[0, 3] = 5e-8  # lost in a float32 sum, not in the float64 one: not a point mass, no shortcut

    def no_shortcut(x):
        raise AssertionError("took the point-mass shortcut")

    monkeypatch.setattr(verispec.rng, "argmax", no_shortcut)
    assert set(TorchRandomness(0).categorical(almost).tolist()) <= {7, 0, 3}
    with pytest.raises(AssertionError, match="shortcut"):
        TorchRandomness(0).categorical(one_hot)
    assert TorchRandomness(0).categorical(torch.zeros(1, 50)).tolist() == [49]  # no mass: as before, no shortcut
