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
