import pytest
import torch

from verispec.errors import VerispecError
from verispec.probs import Sampling, logits_to_probs, residual


def test_temperature_and_greedy():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0])
    g = logits_to_probs(logits, Sampling(0))
    assert g.tolist() == [0, 1, 0, 0]  # first maximal index, like argmax
    p = logits_to_probs(logits, Sampling(2.0))
    assert torch.allclose(p, torch.softmax(logits / 2, -1))


def test_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert logits_to_probs(logits, Sampling(1.0, top_k=2)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    # top_p 0.8: mass before token 2 is 0.8, not < 0.8, so only the first two stay
    assert logits_to_probs(logits, Sampling(1.0, top_p=0.8)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert logits_to_probs(logits, Sampling(1.0, top_p=0.81)).tolist() == pytest.approx([0.5 / .95, 0.3 / .95, .15 / .95, 0])


@pytest.mark.parametrize("temperature", [1.0, 0.0])  # greedy reads the check off the chosen entries
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_and_inf_logits_raise(temperature, dtype):
    nan, inf = float("nan"), float("inf")
    for bad in ([0.0, nan], [nan, 0.0], [0.0, inf], [-inf, -inf], [[0.0, 1.0], [2.0, nan]]):
        with pytest.raises(VerispecError, match="NaN"):
            logits_to_probs(torch.tensor(bad, dtype=dtype), Sampling(temperature))
    # -inf alone marks an impossible token and is fine
    assert logits_to_probs(torch.tensor([0.0, -inf], dtype=dtype), Sampling(temperature)).tolist() == [1.0, 0.0]


def test_greedy_law_without_numpy_is_the_same():
    """A tensor numpy cannot view (one that requires grad; on a GPU likewise) takes torch's path: same rows, same
    errors."""
    x = torch.tensor([[0.0, 2.0, 2.0, -1.0], [float("-inf"), -3.0, -3.0, -5.0]])
    assert torch.equal(logits_to_probs(x.clone().requires_grad_(), Sampling(0)), logits_to_probs(x, Sampling(0)))
    for bad in ([0.0, float("nan")], [float("-inf"), float("-inf")]):
        with pytest.raises(VerispecError, match="NaN"):
            logits_to_probs(torch.tensor(bad, requires_grad=True), Sampling(0))


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_settings(kw):
    with pytest.raises(VerispecError):
        Sampling(**kw)


def test_residual():
    p = torch.tensor([0.4, 0.3, 0.3], dtype=torch.float64)
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    assert residual(p, q).tolist() == pytest.approx([0, 0, 1])
    assert residual(p, p).tolist() == pytest.approx(p.tolist())  # no mass: fall back to p


def _residual_by_formula(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def test_residual_of_a_point_mass_is_itself_and_equals_the_formula_bit_for_bit():
    """A greedy target's law is read off ``p`` without the passes over the vocabulary; the result must be the
    formula's, bit for bit, whatever the draft's law (elsewhere, at the token, all of it, or the same point mass), and
    a row with one positive entry that is not 1 (not a law) must still go through the formula."""
    gen = torch.Generator().manual_seed(0)
    p = torch.zeros(3, 50, dtype=torch.float64)
    p[0, 7] = p[1, 0] = p[2, 49] = 1.0
    soft = torch.softmax(torch.randn(3, 50, generator=gen, dtype=torch.float64), -1)
    at_token = soft.clone()
    at_token[0, 7] = 1.0
    for q in (soft, at_token, p.clone(), torch.zeros_like(p)):
        assert torch.equal(residual(p, q), _residual_by_formula(p, q))
        assert torch.equal(residual(p[0], q[0]), _residual_by_formula(p[0], q[0]))
    half = p * 0.5
    assert torch.equal(residual(half, soft), _residual_by_formula(half, soft))
    assert residual(half, soft)[0, 7] == 1.0
    mixed = torch.stack([p[0], soft[1], p[2]])  # one row sampled: the formula for all of them
    assert torch.equal(residual(mixed, soft), _residual_by_formula(mixed, soft))
    assert residual(p.float(), soft).dtype == torch.float64  # the promoted type, as the formula gives


def test_argmax_and_point_mass_match_torch_including_ties():
    from verispec.probs import argmax, point_mass

    x = torch.tensor([[0.0, 2.0, 2.0, -1.0], [float("-inf"), -3.0, -3.0, -5.0]])
    assert argmax(x).tolist() == x.argmax(-1).tolist() == [1, 1]
    assert argmax(x.double()).tolist() == [1, 1]
    big = torch.randn(3, 262144, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax(big), big.argmax(-1))
    assert torch.equal(point_mass(argmax(big), big.shape[-1], big.dtype),
                       torch.nn.functional.one_hot(big.argmax(-1), big.shape[-1]).float())
    assert torch.equal(logits_to_probs(big, Sampling(0.0)).argmax(-1), big.argmax(-1))
