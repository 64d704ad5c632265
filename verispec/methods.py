"""Named methods and the one resolver: what a run decodes with, from the names a user gives.

A *method* is a named recipe: a verifier, a draft-length policy and a draft tree (``default`` is what ``verispec
generate`` does with no options; ``fixed``, ``ar`` and AdaSD's rows are others). ``resolve`` turns a method name
and any overrides (``--verifier``, ``--policy``, ``--tree``, ``--children``) into a ``Plan``, checked without a model;
``Plan.build(target, drafter)`` makes the run's pieces (``Recipe``): the tree (``auto``: the one tuned for the draft,
else ``DEFAULT_TREE``), the policy (``auto`` weighs depths by this machine's measured step costs) and a fresh
learning state. The CLI, the transformers door, the benchmark and ``decode.generate`` all go through here
(``verifiers.check`` is the one place where a verifier, a tree, a child mode, a policy and a temperature are found
compatible).

A method name may also be a registered verifier (``specinfer``, ``fsd:0.2``: fixed-length drafting of
``DEFAULT_TREE``), and any method takes a tree after ``@`` (``specinfer@3x5``, ``fixed@chain:8``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .backends.costs import forward_costs
from .errors import VerispecError
from .policies import Fixed, PerSource, Policy, get_policy
from .tree import DynamicTree, Tree
from .verifiers import VERIFIERS, VerifierSpec, check, get_verifier

DEFAULT_TREE = "chain:5"  # the tree of a draft with no tuned tree (and of a verifier named as a method)
DEFAULT_VERIFIER = "chain"
DEFAULT_METHOD = "default"  # what ``verispec generate`` runs with no options


@dataclass(frozen=True)
class Method:
    name: str
    verifier: str
    policy: str
    tree: str  # ``Tree.parse`` syntax, "none" for no drafting, "auto" for the draft's tuned tree
    note: str


_ROWS = [
    Method("default", DEFAULT_VERIFIER, "auto", "auto",
           "what 'verispec generate' does with no options: the default draft and its tuned tree, exact chain "
           "verification, the draft length chosen step by step from measured acceptance (policy auto)"),
    Method("auto-gate", DEFAULT_VERIFIER, "auto:gate", "auto",
           "the default plus the auto policy's confidence gate: each further token drafted only while the draft's "
           "calibrated confidence in it makes it pay"),
    Method("ar", "chain", "fixed", "none", "plain autoregressive decoding of the target in verispec's loop"),
    Method("fixed", "chain", "fixed", DEFAULT_TREE,
           "exact chain speculative sampling, 5 tokens (the papers' Vanilla)"),
    Method("hf", "chain", "hf", "chain:20",
           "exact verification with Hugging Face's draft-length rules (20, confidence 0.4, ROC)"),
    Method("hf-heuristic", "chain", "hf:heuristic", "chain:20", "exact verification, Hugging Face +2/-1 schedule"),
    Method("adaedl", "chain", "adaedl", "chain:10", "exact verification, AdaEDL entropy stop (cap 10)"),
    Method("adasd", "adasd", "adasd-entropy", "chain:10",
           "AdaSD: entropy stop + Bayesian JS acceptance (cap 10; lossy)"),
    Method("adasd-gen-only", "chain", "adasd-entropy", "chain:10", "AdaSD generation rule only (exact verification)"),
    Method("adasd-verify-only", "adasd", "fixed", DEFAULT_TREE, "AdaSD verification only, 5 tokens (lossy)"),
    Method("adasd-hybrid", "adasd", "hf", "chain:20", "AdaSD verification + Hugging Face length control (lossy)"),
    Method("fsd", "fsd", "fixed", DEFAULT_TREE, "FSD, JS threshold 0.3, 5 tokens (lossy)"),
    Method("typical", "typical", "fixed", DEFAULT_TREE, "Medusa typical acceptance, 5 tokens (lossy)"),
    Method("bild", "bild", "bild", "chain:10", "BiLD fallback 0.6 + rollback 5 (cap 10; lossy)"),
]
METHODS = {m.name: m for m in _ROWS}
METHODS_HELP = (
    "a named method (" + ", ".join(METHODS) + "), or a verifier name (fixed-length chain of 5), "
    "optionally with a draft tree after '@': specinfer@3x5, reserve@3,1,1, fixed@chain:8"
)


@dataclass
class Recipe:
    """A run's pieces, built for a target and a draft: fresh for each run, or reused across prompts to keep what
    the policy and a learning verifier have learned. ``drafter`` is the draft state the run drafts with (one per
    sequence: ``Plan.start`` forks it); what ``Engine.submit`` takes whole."""

    verifier: VerifierSpec
    tree: Tree | DynamicTree
    drafter: object = None  # a ``Drafter``
    children: str = "iid"
    policy: Policy = field(default_factory=Fixed)
    verifier_state: object | None = None


@dataclass(frozen=True)
class Plan:
    """A resolved method: checked, but not yet built (no model is needed to make one)."""

    name: str  # the method's name as given (``specinfer@3x5``)
    verifier: VerifierSpec
    policy: str | Policy  # a spec string, or a policy object passed through
    tree: str | Tree | DynamicTree  # "auto" (the draft's tuned tree), "none" (no draft), a spec string, or a tree
    children: str

    @property
    def drafts(self) -> bool:
        """Whether the output depends on a draft (plain decoding does not)."""
        return not (isinstance(self.tree, str) and self.tree == "none")

    def tree_for(self, drafter=None) -> Tree | DynamicTree:
        """The draft tree: ``auto`` is the drafter's tuned one (``Drafter.default_tree``), else ``DEFAULT_TREE``."""
        if not isinstance(self.tree, str):
            return self.tree
        if self.tree == "none":
            return Tree.root_only()
        if self.tree == "auto":
            return Tree.parse((drafter.default_tree if drafter is not None else None) or DEFAULT_TREE)
        return Tree.parse(self.tree)

    def build(self, target=None, drafter=None, verifier_state=None) -> Recipe:
        """The run's pieces for ``target`` and ``drafter`` (both needed for the ``auto`` policy's measured costs and
        the ``auto`` tree; without them the generic costs and ``DEFAULT_TREE``)."""
        tree = self.tree_for(drafter) if drafter is None or drafter.drafts else Tree.root_only()
        policy = self.policy if not isinstance(self.policy, str) else build_policy(self.policy, target, drafter)
        check(self.verifier, tree, self.children, policy.name)
        if verifier_state is None and self.verifier.new_state is not None:
            verifier_state = self.verifier.new_state()
        return Recipe(self.verifier, tree, drafter, self.children, policy, verifier_state)

    def start(self, target, drafter) -> Recipe:
        """A new sequence's pieces: ``drafter`` forked (its own draft state), and ``build`` for it."""
        return self.build(target, drafter.fork())


def resolve(method: str | None = None, *, verifier: str | VerifierSpec | None = None,
            policy: str | Policy | None = None, tree: str | Tree | DynamicTree | None = None,
            children: str | None = None, temperature: float | None = None, info=None) -> Plan:
    """The plan for ``method`` (default ``DEFAULT_METHOD``; ``NAME[@TREE]``, see ``METHODS_HELP``) with the given
    overrides, checked (against ``temperature`` too, when it is known). ``info`` receives notes (the deprecated
    ``--method VERIFIER`` spelling)."""
    name = method or DEFAULT_METHOD
    base, at, shape = name.partition("@")
    if base not in METHODS and base.partition(":")[0] in VERIFIERS:
        if verifier is not None:
            raise VerispecError("give the verifier once: --verifier, or the old --method VERIFIER")
        if info is not None:
            info(f"note: --method {name} names a verifier; this spelling is deprecated, use --verifier {base}")
        verifier = verifier or base
        row = Method(name, base, "fixed", DEFAULT_TREE, "")
    elif base in METHODS:
        row = METHODS[base]
    else:
        raise VerispecError(f"unknown method {base!r}: use {METHODS_HELP}")
    if at:
        if row.tree == "none":
            raise VerispecError(f"method {base!r} drafts nothing; it takes no tree (got {name!r})")
        row = Method(name, row.verifier, row.policy, shape, row.note)
    spec = verifier if isinstance(verifier, VerifierSpec) else get_verifier(verifier or row.verifier)
    chosen_tree = tree if tree is not None else row.tree
    parsed = chosen_tree if not isinstance(chosen_tree, str) else \
        None if chosen_tree in ("auto", "none") else Tree.parse(chosen_tree)  # fails early on a bad tree
    chosen_policy = policy if policy is not None else row.policy
    if isinstance(chosen_policy, str):
        get_policy(chosen_policy)  # fails early on a bad policy
    child = children or spec.default_children
    check(spec, parsed, child, chosen_policy if isinstance(chosen_policy, str) else chosen_policy.name, temperature)
    return Plan(name, spec, chosen_policy, chosen_tree, child)


def step_costs(target, drafter) -> tuple[float, ...] | None:
    """Relative cost of a step drafting a chain of d tokens (d = 0..COSTED_ROWS - 1), a plain step = 1, never
    decreasing: a shipped head's measured costs (its sidecar), else the target's measured forward costs plus the
    draft's own cost per depth (``Drafter.depth_cost``). None without a target (the policy's generic costs)."""
    if target is None:
        return None
    if drafter.step_costs and target.backend == "hf":
        return tuple(drafter.step_costs)
    fwd = forward_costs(target)
    if not fwd:
        return None
    costs = (fwd[d] / fwd[0] + d * drafter.depth_cost for d in range(len(fwd)))
    return tuple(itertools.accumulate(costs, max))


def build_policy(spec: str, target=None, drafter=None) -> Policy:
    """A policy from its spec (``policies.POLICIES``). ``auto`` and ``auto:gate`` weigh depths by the step costs of
    this target and draft and know whether the draft's first depth is free; a drafter with several sources gets one
    such policy per source (``PerSource``)."""
    if spec.partition(":")[0] != "auto" or drafter is None or not drafter.drafts:
        return get_policy(spec)
    if drafter.sources:
        return PerSource({name: build_policy(spec, target, sub) for name, sub in drafter.sources.items()})
    return get_policy(spec, step_costs(target, drafter), free_root=drafter.free_root)
