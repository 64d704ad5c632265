"""What a verifier receives and returns, and the registry that names verifiers.

A verifier is a pure function ``fn(draft, p, rng) -> Verdict``:

* ``draft`` -- the drafted tree, its tokens, the draft law ``q`` at each node and how children were drawn;
* ``p [N, V]`` -- the target distribution after each node (row 0: after the root), from one target forward;
* ``rng`` -- the randomness to use (see ``verispec.rng``); a verifier never creates its own.

It walks from the root, accepting at most one child per node, and ends by emitting one token: the
*recovered* token (drawn from a residual after a rejection) or the *bonus* token (drawn from ``p``
after a leaf). The accepted length of a step is ``len(path) + 1``. With nothing drafted (a root alone) the
verdict is the bonus token ``rng.categorical(p[0])`` with nothing tested and no feedback: the decoding loop relies
on it and draws that token itself instead of calling the verifier (tests/test_verifiers.py checks every
registered verifier).

Adding a verifier is one small module with a function decorated by ``@register(...)`` and an import
line in ``verispec/verifiers/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..drafters.base import CHILD_MODES, Draft
from ..errors import VerispecError
from ..probs import Sampling, greedy_index, logits_to_probs, point_mass
from ..rng import Randomness
from ..tree import DynamicTree, Tree


@dataclass(frozen=True)
class Verdict:
    path: tuple[int, ...]  # accepted drafted nodes, root-to-leaf (root excluded)
    token: int  # recovered token after a rejection, or bonus token after a leaf
    tested: tuple[int, ...]  # per depth reached: candidates tested there (the accepted one is the last tested)
    feedback: tuple = ()  # what a learning verifier learns from this step (see ``VerifierSpec.new_state``)


VerifyFn = Callable[[Draft, torch.Tensor, Randomness], Verdict]


def draw_root(logits: torch.Tensor, sampling: Sampling, rng: Randomness) -> int:
    """The token of a step with nothing drafted, from the target's ``logits [1+, V]`` (row 0 read): what every verifier
    returns for a root alone, ``rng.categorical`` of the target's law, or at temperature 0 the argmax of the logits
    itself (the greedy law's point mass without building it, and without a draw)."""
    if sampling.greedy:
        return int(greedy_index(logits[:1])[0])
    return int(rng.categorical(logits_to_probs(logits[:1], sampling)[0]))


def greedy_prefix_verdict(draft: Draft, logits: torch.Tensor) -> Verdict:
    """A chain's verdict where the target's law is greedy (a point mass on each row's first maximum, ``logits [g+1,
    V]``) and the verifier's is the chain rule's: a drafted token is accepted with probability ``min(1, p(x) / q(x))``,
    1 where it is the argmax and the draft could propose it (``q(x) > 0``; top-k children always could), else 0; after
    the first rejection the residual of a point mass is that point mass. So the verdict is the drafted prefix that
    equals the argmax tokens, then the argmax after it, whatever the coins: read off ``g + 1`` argmaxes, without the
    laws, their vocabulary-sized rows or a draw (as ``draw_root`` does for a root alone)."""
    g = draft.num_drafted
    best = greedy_index(logits[:g + 1])
    x = draft.tokens[1:g + 1]
    agree = x == best[:g]
    if draft.children != "topk":  # the chain's nodes are 0..g-1, node i's child token x[i]
        agree &= draft.q[torch.arange(g), x] > 0
    n = int(agree.long().cumprod(0).sum())
    return Verdict(tuple(range(1, n + 1)), int(best[n]), (1,) * min(n + 1, g))


def step_verdict(spec: "VerifierSpec", draft: Draft, logits: torch.Tensor, sampling: Sampling, rng: Randomness,
                 state=None) -> Verdict:
    """A decoding step's verdict from the target's ``logits [N, V]`` after the draft's nodes: ``spec``'s on their laws
    under ``sampling`` (a learning verifier's ``state`` then learns its feedback), or with nothing drafted
    ``draw_root``'s token."""
    if not draft.num_drafted:
        return Verdict((), draw_root(logits, sampling, rng), ())
    if sampling.greedy and spec.greedy_prefix and draft.tree.is_chain:
        return greedy_prefix_verdict(draft, logits)
    verdict = spec(draft, logits_to_probs(logits, sampling), rng, state)
    if state is not None:
        state.update(verdict.feedback)
    return verdict


@dataclass(frozen=True)
class VerifierSpec:
    name: str
    fn: VerifyFn
    exact: bool  # claims that the output law equals the target's (the audit checks the claim)
    note: str  # one line: what it is, or why it is not exact
    chain_only: bool = False
    greedy_only: bool = False  # only meaningful at temperature 0
    children: str | None = None  # the child mode it needs (None: any)
    node_rule: "NodeRule | None" = None  # set for verifiers that are a walk of per-node rules (the audit recurses)
    # Learning verifiers (AdaSD): ``new_state()`` makes what they learn; ``fn(draft, p, rng, state)`` only
    # reads it and returns ``Verdict.feedback``; the decoding loop then calls ``state.update(feedback)``.
    new_state: Callable[[], object] | None = None
    position_rule: "PositionRule | None" = None  # chain rules given per position (lossy family; exact law known)
    param: float | None = None  # the value of a parametrised rule's parameter (``fsd:0.2``)
    # its verdict on a chain at a greedy target is ``greedy_prefix_verdict``'s (the chain rule's): ``step_verdict``
    # computes it so, from the logits
    greedy_prefix: bool = False
    with_param: Callable[[float], "VerifierSpec"] | None = None

    @property
    def modes(self) -> tuple[str, ...]:
        """The child modes it takes, its default first."""
        return CHILD_MODES if self.children is None else (self.children,)

    @property
    def default_children(self) -> str:
        return self.modes[0]

    def __call__(self, draft: Draft, p: torch.Tensor, rng: Randomness, state=None) -> Verdict:
        check(self, draft.tree, draft.children)  # the loop checked its plan once; a direct call is checked here
        if self.new_state is not None:
            return self.fn(draft, p, rng, state if state is not None else self.new_state())
        return self.fn(draft, p, rng)


def check(verifier: VerifierSpec, tree: Tree | DynamicTree | None, children: str, policy: str | None = None,
          temperature: float | None = None) -> None:
    """The one compatibility check of a run's pieces (``None``: not known yet), one message per mistake: the CLI and
    every entry point find their plan compatible with it (``methods.resolve``), the loop before it starts, and a
    verifier called directly on a draft."""
    if temperature is not None and verifier.greedy_only and temperature > 0:
        raise VerispecError(f"verifier {verifier.name!r} is for temperature 0 only; got temperature {temperature}")
    drafting = tree is not None and tree.size > 1
    if drafting and children not in verifier.modes:
        raise VerispecError(f"verifier {verifier.name!r} needs --children {verifier.children}, got {children}")
    if drafting and verifier.chain_only and not tree.is_chain:
        raise VerispecError(f"verifier {verifier.name!r} only verifies chains, not {tree.describe()}")
    if drafting and children == "hub" and (isinstance(tree, DynamicTree) or tree.branching > 2):
        raise VerispecError(f"hub children come in pairs (SpecHub): use a tree of at most 2 children a node, "
                            f"not {tree.describe()}")
    if isinstance(tree, DynamicTree):
        if policy is not None and policy != "fixed":
            raise VerispecError("a dynamic tree chooses its own depth; use it with the fixed draft-length policy")
        if children != "topk" and temperature is not None and temperature > 0:
            raise VerispecError(f"a dynamic tree drafts top-k children; use --children topk (got {children!r}): "
                                "pruning sampled children by their own probability would bias their law")


VERIFIERS: dict[str, VerifierSpec] = {}


def add_verifier(spec: VerifierSpec) -> VerifierSpec:
    """The one way into the registry: refuses a second verifier of the same name."""
    if spec.name in VERIFIERS:
        raise ValueError(f"verifier {spec.name!r} registered twice")
    VERIFIERS[spec.name] = spec
    return spec


def register(
    name: str, *, exact: bool, note: str, chain_only: bool = False, greedy_only: bool = False, children: str | None = None,
    **extra,
):
    """Decorator registering ``fn`` under ``name``; ``extra`` sets the optional ``VerifierSpec`` fields."""

    def wrap(fn: VerifyFn) -> VerifyFn:
        add_verifier(VerifierSpec(name, fn, exact, note, chain_only, greedy_only, children, **extra))
        return fn

    return wrap


def register_node_rule(
    name: str, rule: "NodeRule", *, exact: bool, note: str, children: str | None = None, greedy_only: bool = False
) -> None:
    """Register a tree verifier given by its per-node rule (see ``walk_tree``)."""

    def fn(draft, p, rng):
        return walk_tree(draft, p, rng, rule)

    fn.__doc__ = rule.__doc__
    add_verifier(VerifierSpec(name, fn, exact, note, children=children, greedy_only=greedy_only, node_rule=rule))


def get_verifier(name: str) -> VerifierSpec:
    """A registered verifier by name; parametrised rules also take ``name:value`` (e.g. ``fsd:0.2``)."""
    base, _, arg = name.partition(":")
    spec = VERIFIERS.get(base)
    if spec is None:
        raise VerispecError(f"unknown verifier {name!r}; choose from {', '.join(sorted(VERIFIERS))}")
    if not arg:
        return spec
    if spec.with_param is None:
        raise VerispecError(f"verifier {base!r} takes no parameter (got {name!r})")
    try:
        value = float(arg)
    except ValueError:
        raise VerispecError(f"bad parameter in verifier {name!r}; use {base}:NUMBER") from None
    return spec.with_param(value)


def first_child_law(draft: Draft, node: int) -> torch.Tensor:
    """The law the first child of ``node`` was drawn from: ``q`` for random draws, a point mass for top-k."""
    if draft.children == "topk":
        child = draft.tree.children[node][0]
        return point_mass(draft.tokens[child], draft.q.shape[-1], draft.q.dtype)
    return draft.q[node]


class NodeOutcome(NamedTuple):
    """What a per-node rule decides: the accepted child's rank, or ``None`` and the law to draw the
    recovered token from; ``tests`` is how many candidates it tested (for per-candidate acceptance)."""

    rank: int | None
    law: torch.Tensor | None
    tests: int


NodeRule = Callable[[Draft, int, torch.Tensor, Randomness], NodeOutcome]

# A chain rule given per position: ``rule(p [g, V], q [g, V], state) -> (accept [g, V], fallback [g, V])``,
# the probability of accepting each token if it is the drafted one, and the law drawn from after a rejection.
PositionRule = Callable[[torch.Tensor, torch.Tensor, object], tuple[torch.Tensor, torch.Tensor]]


def walk_tree(draft: Draft, p: torch.Tensor, rng: Randomness, node_rule: NodeRule) -> Verdict:
    """Walk from the root, applying ``node_rule(draft, node, p[node], rng)`` at each node."""
    tree, node, path, tested = draft.tree, 0, [], []
    while tree.children[node]:
        kids = tree.children[node]
        rank, law, tests = node_rule(draft, node, p[node], rng)
        tested.append(tests)
        if rank is None:
            return Verdict(tuple(path), int(rng.categorical(law)), tuple(tested))
        node = kids[rank]
        path.append(node)
    return Verdict(tuple(path), int(rng.categorical(p[node])), tuple(tested))
