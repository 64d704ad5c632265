"""Shadow verification: more verifiers judged on the very same steps as the one that drives the text.

At every step of a run, the method's own verifier (the *driver*) decides what is kept; each shadow verifier is also
run on that step's draft and target probabilities -- no extra model forward -- with ``seeds`` coin streams of its
own, and what it would have accepted is recorded beside the step (``Shadow.observe``). The driver's randomness is
never touched, so shadowing cannot change the text.

Why this settles comparisons: every exact verifier emits the target's law, so the states an exact driver visits are
distributed as under any other exact verifier. The mean over the driven steps of a shadow's accepted length is then
an unbiased estimate of what that verifier would accept in a run of its own, and the per-step differences between
two shadows (or a shadow and the driver) are paired: the trajectory-to-trajectory noise that swamps separate runs
cancels. For an inexact rule (``resispec``) a shadow measures its acceptance on the target's own states, not on the
(biased) states it would drive itself to. Shadows see the driver's draft, so they must take children drawn the way
the driver's were: ``swor`` and ``topk`` need drafts of their own, and are compared by paired per-prompt runs.
"""

from __future__ import annotations

import dataclasses

from ..rng import TorchRandomness
from ..verifiers import get_verifier
from ..verifiers.base import VerifierSpec


def check_shadows(names: list[str], driver: VerifierSpec, children: str,
                  chain_only_tree: bool) -> tuple[list[VerifierSpec], list[str]]:
    """The shadow verifiers that can judge a driver's drafts, and a one-line reason for each one left out (a shadow
    that needs children drawn another way, learns as it goes, or verifies chains only while the method drafts a
    tree). An unknown name is an error."""
    specs, skipped = [], []
    for name in names:
        spec = get_verifier(name)
        if children not in spec.modes:
            skipped.append(f"shadow {name!r} skipped for {driver.name!r}: it needs children drawn {spec.children!r}, "
                           f"the method draws {children!r} (compare it by a run of its own)")
        elif spec.new_state is not None:
            skipped.append(f"shadow {name!r} skipped: it learns as it goes (run it as a method instead)")
        elif spec.chain_only and not chain_only_tree:
            skipped.append(f"shadow {name!r} skipped for {driver.name!r}: it verifies chains only, the method "
                           f"drafts a tree")
        else:
            specs.append(spec)
    return specs, skipped


@dataclasses.dataclass
class Shadow:
    """Wraps a driver verifier: calls it, then each shadow on the same (draft, p) with ``seeds`` coin streams."""

    driver: VerifierSpec
    shadows: list[VerifierSpec]
    seeds: int
    base_seed: int
    records: list[dict] = dataclasses.field(default_factory=list)  # one per step: shadow name -> per-seed outcomes

    def spec(self) -> VerifierSpec:
        def fn(draft, p, rng, *state):
            verdict = self.driver.fn(draft, p, rng, *state)
            self.records.append(self.observe(draft, p))
            return verdict

        return dataclasses.replace(self.driver, fn=fn)

    def undrafted(self) -> dict:
        """The record of a step with nothing drafted (the loop calls no verifier there): every shadow emits one
        token."""
        return {spec.name: [{"accepted_length": 1, "tested": [], "accepted_ranks": []}] * self.seeds
                for spec in self.shadows}

    def observe(self, draft, p) -> dict:
        step = len(self.records)
        ranks = draft.tree.ranks
        out = {}
        for j, spec in enumerate(self.shadows):
            runs = []
            for s in range(self.seeds):
                rng = TorchRandomness(((self.base_seed * 1_000_003 + step) * 101 + j) * 31 + s)
                v = spec(draft, p, rng)
                runs.append({"accepted_length": len(v.path) + 1, "tested": list(v.tested),
                             "accepted_ranks": [ranks[n] for n in v.path]})
            out[spec.name] = runs
        return out
