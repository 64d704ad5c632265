"""Logits -> probabilities and the small distribution helpers every verifier shares.

Glossary (used in the whole package): ``p`` is the target distribution at a position after
temperature / top-k / top-p, ``q`` the draft distribution. ``(v)_+ = max(v, 0)`` and
``norm(v) = v / sum(v)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import VerispecError

DEFAULT_TEMPERATURE = 0.6  # what ``verispec generate`` and ``verispec.generate`` sample at unless told otherwise


@dataclass(frozen=True)
class Sampling:
    """How logits become a distribution. ``temperature == 0`` means greedy (a point mass on the argmax).

    ``top_k == 0`` disables top-k; ``top_p == 1`` disables nucleus filtering.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise VerispecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise VerispecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise VerispecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}  # the float dtypes numpy can view
_NOT_POSSIBLE = "contain NaN/+inf values or a row with no finite entry"  # what check_finite(allow_masked=True) raises


def as_numpy(x: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU float tensor (a copy only if it is not contiguous), or None. A step at a 262k vocabulary
    runs right after the engine has streamed the model's weights through the caches, and there each torch call costs
    tens of microseconds however small it is (measured in the llama.cpp loop): the per-step vocabulary passes below
    go through numpy, with fewer calls."""
    if x.device.type == "cpu" and x.dtype in _NUMPY and not x.requires_grad:
        return x.contiguous().numpy()
    return None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the first maximal index of each row (NaN counts as maximal, as in torch). On the CPU through
    numpy, about 10x faster than torch's at a 262k vocabulary on this machine; the same indices."""
    a = as_numpy(x)
    return torch.from_numpy(np.asarray(a.argmax(-1))) if a is not None else x.argmax(-1)


def point_mass(index: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """One-hot rows ``[..., size]`` at ``index`` (cheaper than ``one_hot(...).to(dtype)``: no int64 matrix). Float rows
    start from numpy's zeros: fresh zero pages from the system instead of a written megabyte per row at 262k tokens
    (0.1 instead of 0.2-0.3 ms a row in the llama.cpp loop)."""
    if dtype in _NUMPY:
        out = torch.from_numpy(np.zeros((*index.shape, size), dtype=_NUMPY[dtype]))
    else:
        out = torch.zeros((*index.shape, size), dtype=dtype)
    return out.scatter_(-1, index.unsqueeze(-1), 1.0)


def check_finite(logits: torch.Tensor, what: str = "logits", allow_masked: bool = False) -> None:
    """Raise a clear error instead of letting NaN/inf logits turn into a silently wrong token.

    With ``allow_masked``, ``-inf`` marks an impossible token (n-gram drafts, audit tables), but a row
    must keep at least one finite entry; NaN and ``+inf`` are never allowed.
    """
    if logits.numel() == 0:
        return
    # reductions instead of element-wise masks (20x cheaper at a 262k vocabulary on this CPU; torch.aminmax is as
    # slow as the masks): the row maximum is NaN if the row has a NaN, +inf if it has a +inf, -inf if nothing in it
    # is possible; the minimum is -inf if anything is masked
    hi = logits.amax(-1)
    if allow_masked:
        if not bool(torch.isfinite(hi).all()):
            raise VerispecError(f"{what} {_NOT_POSSIBLE}")
        return
    if not bool((torch.isfinite(logits.amin(-1)) & torch.isfinite(hi)).all()):
        bad = (~torch.isfinite(logits)).sum().item()
        raise VerispecError(
            f"{what} contain {bad} NaN/inf value(s); refusing to sample from them "
            "(check the model weights, dtype, or inputs)"
        )


def logits_to_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Turn logits ``[..., V]`` into probabilities ``[..., V]`` under ``sampling``.

    Computation is done in at least float32; float64 input stays float64 (the audit uses it).
    Greedy gives a one-hot row on the first maximal index (the same tie rule as ``argmax``).
    ``-inf`` entries are impossible tokens; NaN and ``+inf`` raise ``VerispecError``.
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    if sampling.greedy:
        return _greedy_law(x)
    check_finite(logits, allow_masked=True)
    x = x / sampling.temperature
    if sampling.top_k and sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass strictly before it is below top_p (the first token is always kept)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = before < sampling.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = normalize(probs * keep)
    return probs


def _greedy_law(x: torch.Tensor) -> torch.Tensor:
    """Point masses on each row's first maximal entry (``greedy_index``)."""
    return point_mass(greedy_index(x), x.shape[-1], x.dtype)


def greedy_index(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index: the token the greedy law puts all its mass on, with
    ``check_finite(allow_masked=True)``'s check read off the chosen entries instead of a pass of its own (the first
    maximum is NaN if the row has a NaN, since NaN counts as maximal, +inf if it has a +inf, -inf if nothing in the
    row is possible)."""
    a = as_numpy(x)
    if a is None:
        idx = x.argmax(-1)
        finite = bool(torch.isfinite(x.gather(-1, idx.unsqueeze(-1))).all())
    else:
        i = np.asarray(a.argmax(-1))
        rows = a.reshape(-1, a.shape[-1])
        finite = all(math.isfinite(rows[r, j]) for r, j in enumerate(i.reshape(-1).tolist()))
        idx = torch.from_numpy(i)
    if not finite:
        raise VerispecError(f"logits {_NOT_POSSIBLE}")
    return idx


def point_mass_index(probs: torch.Tensor) -> torch.Tensor | None:
    """Each row's index if every row of ``probs [..., V]`` is a point mass (exactly one positive entry), else None.

    Inverse-CDF sampling returns that index whatever the uniform number is, so a greedy row is drawn by an argmax
    and one more pass instead of a float64 cumulative sum over the vocabulary (rows from a sampled law fail the test
    at their first row and pay one argmax)."""
    a = as_numpy(probs)
    if a is None or a.size == 0:
        return None
    flat = a.reshape(-1, a.shape[-1])
    idx = flat.argmax(-1)
    if len(idx) <= 8:  # few rows (a step's root, a chain): two slices per row, no temporary array
        for row, i in zip(flat, idx.tolist()):
            if not (row[i] > 0 and row[:i].max(initial=0.0) <= 0 and row[i + 1:].max(initial=0.0) <= 0):
                return None
    elif not ((flat[np.arange(len(idx)), idx] > 0).all() and (np.count_nonzero(flat > 0, axis=-1) == 1).all()):
        return None
    return torch.from_numpy(idx.reshape(a.shape[:-1]))


def normalize(v: torch.Tensor) -> torch.Tensor:
    """``norm(v)`` along the last axis."""
    return v / v.sum(-1, keepdim=True)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm((p - q)_+)``: the law to draw from after a rejection.

    If ``(p - q)_+`` has no mass (``p == q`` up to rounding), a rejection has probability zero
    and any law is correct; ``p`` is returned so that a rounding-induced rejection stays sane.
    Where every row of ``p`` is a point mass of mass 1 (a greedy target's law) the residual is ``p`` itself,
    whatever ``q`` (of ``p``'s shape): ``(p - q)_+`` is zero off ``p``'s token and ``1 - q(token) >= 0`` on it,
    which normalises to exactly 1, or has no mass. That is read off ``p`` (``point_mass_index``: an argmax and a
    pass) instead of five passes over the vocabulary in float64.
    """
    dtype = torch.result_type(p, q)
    if p.shape == q.shape:
        token = point_mass_index(p)
        if token is not None and bool((p.gather(-1, token.unsqueeze(-1)) == 1).all()):
            return p.to(dtype, copy=True)  # a new tensor, as the formula gives
    r = (p - q).clamp_min_(0)
    total = r.sum(-1, keepdim=True)
    tiny = torch.finfo(dtype).tiny
    if bool((total > 0).all()):
        return r.div_(total.clamp_min(tiny))
    return torch.where(total > 0, r / total.clamp_min(tiny), p)
