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


def test_point_mass_rows_are_drawn_by_argmax_without_changing_later_draws():
    """A greedy row takes the point-mass shortcut; the draw and the stream after it equal inverse-CDF sampling's."""
    from verispec.rng import point_mass_index

    one_hot = torch.zeros(2, 50)
    one_hot[0, 7], one_hot[1, 0] = 1.0, 1.0
    law = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), 0)
    fast, slow = TorchRandomness(5), TorchRandomness(5)
    assert fast.categorical(one_hot).tolist() == [7, 0]
    cdf = torch.cumsum(one_hot.double(), -1)  # the inverse-CDF draw, by hand, on the same uniform numbers
    u = slow.uniform((2, 1))
    assert torch.searchsorted(cdf, u, right=True).squeeze(-1).tolist() == [7, 0]
    assert torch.equal(fast.categorical(law.expand(100, -1)), slow.categorical(law.expand(100, -1)))
    assert point_mass_index(one_hot).tolist() == [7, 0]
    assert point_mass_index(one_hot[0]).tolist() == 7  # one row: a 0-d index, as argmax gives
    assert point_mass_index(law) is None
    for rows in (one_hot, one_hot.repeat(5, 1)):  # the per-row test (<= 8 rows) and the vectorised one
        almost = rows.clone()
        almost[0, 3] = 1e-30  # any other mass, however small: not a point mass
        assert point_mass_index(almost) is None
        assert point_mass_index(rows).tolist() == rows.argmax(-1).tolist()
        nan = rows.clone()
        nan[1, 9] = float("nan")
        assert point_mass_index(nan) is None
    assert point_mass_index(torch.zeros(1, 50)) is None
    assert TorchRandomness(0).categorical(torch.zeros(1, 50)).tolist() == [49]  # no mass: inverse-CDF's answer


def test_draws_equal_torch_float64_inverse_cdf():
    """``categorical`` is float64 inverse-CDF sampling on the same uniform numbers, for every row shape and dtype
    (a faster rewrite must keep the same draws: a numpy cumsum was tried here and was 3x slower than torch's)."""

    def reference(rng, probs):
        u = rng.uniform(probs.shape[:-1] + (1,))
        cdf = torch.cumsum(probs.double(), dim=-1)
        idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1)
        return idx.clamp_max(probs.shape[-1] - 1)

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for shape in ((1000,), (3, 1000), (2, 4, 7)):
            law = torch.softmax(3 * torch.randn(shape, generator=gen, dtype=dtype), -1)
            law = law * (torch.rand(shape, generator=gen, dtype=dtype) > 0.3)  # impossible tokens, unnormalised rows
            for seed in range(20):
                assert torch.equal(TorchRandomness(seed).categorical(law), reference(TorchRandomness(seed), law))
