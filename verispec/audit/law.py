"""Exact output law of one speculative step, computed by enumeration (float64).

Setting: small synthetic target and draft tables ``p(. | prefix)``, ``q(. | prefix)`` (prefix-dependent),
a tree shape and a child mode. One step drafts a tree with the real drafter code
(``TableDrafter`` feeds the shared tree-growing routine), asks the target for ``p`` at every node and
runs the verifier. ``enumerate_outcomes`` walks every draw and every accept/reject outcome, so the
result is the exact law of the emitted tokens, not an estimate.

Emitted sequences have variable length (accepted tokens + one recovered/bonus token). To compare with
the target, each is completed to a fixed length with the target's own conditionals; a verifier is
exact iff that law equals the target's autoregressive law over sequences of that length.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..backends.base import ForwardOutput
from ..decode import generate_steps
from ..drafters.base import Draft, Drafter, _draw_children, _Growing
from ..engine import Engine, run_all
from ..methods import Recipe
from ..planner import CostBook
from ..policies import Fixed
from ..probs import Sampling
from ..rng import enumerate_outcomes
from ..tree import Tree
from ..verifiers.base import VerifierSpec

Table = Callable[[tuple[int, ...]], torch.Tensor]  # prefix -> distribution [V] (float64)


class TableDrafter(Drafter):
    """A drafter whose law after any prefix is read from a table (logits = log q)."""

    depth_cost = 0.01  # a table lookup, like prompt lookup

    name = "table"

    def __init__(self, q: Table):
        self.q = q

    def _root_logits(self, context):
        self._context = tuple(context)
        return self.q(self._context).log()

    def _node_logits(self, g: _Growing, nodes):
        return torch.stack([self.q(self._context + tuple(g.path(node))).log() for node in nodes])



def random_tables(vocab: int, seed: int, concentration: float = 1.0, sparsity: float = 0.0):
    """Prefix-dependent random target and draft tables (memoised), drawn from a Dirichlet.

    ``sparsity`` zeroes each entry with that probability (keeping at least one), so supports differ.
    """
    gen = torch.Generator().manual_seed(seed)
    cache: dict[tuple, torch.Tensor] = {}

    def make(tag: str) -> Table:
        def table(prefix: tuple[int, ...]) -> torch.Tensor:
            key = (tag, prefix)
            if key not in cache:
                d = torch.distributions.Gamma(torch.full((vocab,), concentration, dtype=torch.float64), 1.0)
                # the CPU generator only: torch.manual_seed would also queue a CUDA seeding with its stack trace on
                # every call (slow, and the queue grows), and Gamma sampling takes no generator argument
                torch.default_generator.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
                v = d.sample()
                if sparsity > 0:
                    keep = torch.rand(vocab, generator=gen, dtype=torch.float64) >= sparsity
                    keep[int(torch.argmax(v))] = True
                    v = v * keep
                cache[key] = v / v.sum()
            return cache[key]

        return table

    return make("p"), make("q")


def step_law(
    verifier: VerifierSpec, p: Table, q: Table, tree: Tree, children: str = "iid",
    context: tuple[int, ...] = (0,),
) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one step emits after ``context``: ``{emitted tokens: probability}``.

    Verifiers given by a per-node rule are audited node by node (children draws and the rule's own
    randomness enumerated at each node, subtree laws memoised by prefix and subtree shape, since
    subtrees draw independently); any other verifier is run end to end on every outcome.
    """
    if verifier.node_rule is not None:
        return _node_law(verifier.node_rule, p, q, tree, 0, children, tuple(context), {})
    drafter = TableDrafter(q)
    sampling = Sampling(1.0)
    state = audit_state(verifier)

    def run(rng):
        draft = drafter.propose(list(context), tree, sampling, children, rng)
        paths = [_path_tokens(draft.tree, draft.tokens, n) for n in range(draft.tree.size)]
        probs = torch.stack([p(tuple(context) + path) for path in paths])  # [N, V]
        verdict = verifier(draft, probs, rng, state)
        return tuple(int(draft.tokens[n]) for n in verdict.path) + (verdict.token,)

    law: dict[tuple[int, ...], float] = {}
    for weight, emitted in enumerate_outcomes(run):
        law[emitted] = law.get(emitted, 0.0) + weight
    return law


def audit_state(verifier: VerifierSpec):
    """The state a learning verifier is audited with: its trained ``example()`` if it has one (a fresh
    state would often make it exact, hiding what it does once it has learned), else a fresh one."""
    factory = verifier.new_state
    if factory is None:
        return None
    return factory.example() if hasattr(factory, "example") else factory()


def _path_tokens(tree: Tree, tokens: torch.Tensor, node: int) -> tuple[int, ...]:
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = tree.parents[node]
    return tuple(reversed(path))


def _shape_key(tree: Tree, node: int):
    return tuple(_shape_key(tree, c) for c in tree.children[node])


def node_outcomes(rule, p_row: torch.Tensor, q_row: torch.Tensor, k: int, children: str):
    """Every outcome at one node: ``[(probability, child tokens, accepted rank or None, recovery law)]``."""
    out = []
    for w_draw, (xs, cps) in enumerate_outcomes(lambda rng: _draw_children(q_row, q_row.log(), k, children, rng)):
        tree = Tree(tuple([-1] + [0] * len(xs)))
        q = torch.zeros(tree.size, q_row.numel(), dtype=q_row.dtype)
        q[0] = q_row
        draft = Draft(tree, torch.tensor([0, *xs]), q, torch.tensor([1.0, *cps], dtype=torch.float64), children)
        for w_rule, (rank, law, _) in enumerate_outcomes(lambda rng: rule(draft, 0, p_row, rng)):
            out.append((w_draw * w_rule, tuple(xs), rank, law))
    return out


def _node_law(rule, p, q, tree, node, children, prefix, memo):
    key = (prefix, _shape_key(tree, node))
    if key in memo:
        return memo[key]
    kids = tree.children[node]
    law: dict[tuple[int, ...], float] = {}
    p_row = p(prefix)
    if not kids:
        for y in torch.nonzero(p_row > 0).flatten().tolist():
            law[(y,)] = float(p_row[y])
    else:
        for w, xs, rank, rec in node_outcomes(rule, p_row, q(prefix), len(kids), children):
            if rank is None:
                for y in torch.nonzero(rec > 0).flatten().tolist():
                    law[(y,)] = law.get((y,), 0.0) + w * float(rec[y])
                continue
            x = xs[rank]
            for seq, w_sub in _node_law(rule, p, q, tree, kids[rank], children, prefix + (x,), memo).items():
                law[(x,) + seq] = law.get((x,) + seq, 0.0) + w * w_sub
    memo[key] = law
    return law


def node_acceptance(verifier: VerifierSpec, p_row: torch.Tensor, q_row: torch.Tensor, k: int, children: str = "iid") -> float:
    """Probability that one node with k children accepts one of them (exact, by enumeration)."""
    if verifier.node_rule is not None:
        return sum(w for w, _, rank, _ in node_outcomes(verifier.node_rule, p_row, q_row, k, children) if rank is not None)
    law = step_law(verifier, lambda s: p_row, lambda s: q_row, Tree.chain(1), children)
    return sum(w for seq, w in law.items() if len(seq) == 2)


def _complete(law: dict[tuple, float], p: Table, context: tuple, length: int, vocab: int) -> torch.Tensor:
    """Extend each emitted sequence to ``length`` tokens with the target's conditionals; dense ``[V]*length``."""
    out = torch.zeros((vocab,) * length, dtype=torch.float64)
    for seq, w in law.items():
        if len(seq) > length:
            raise ValueError(f"emitted {len(seq)} tokens, longer than the comparison length {length}")
        stack = [(seq, w)]
        while stack:
            s, weight = stack.pop()
            if len(s) == length:
                out[s] += weight
                continue
            cond = p(context + s)
            for x in range(vocab):
                if cond[x] > 0:
                    stack.append((s + (x,), weight * float(cond[x])))
    return out


def target_law(p: Table, context: tuple, length: int, vocab: int) -> torch.Tensor:
    """The target's autoregressive law over the next ``length`` tokens, dense ``[V]*length``."""
    return _complete({(): 1.0}, p, context, length, vocab)


def verifier_law(verifier, p, q, tree, vocab, children="iid", context=(0,)) -> torch.Tensor:
    """The verifier's law over the next ``tree.max_depth + 1`` tokens (one step, completed by the target)."""
    law = step_law(verifier, p, q, tree, children, context)
    return _complete(law, p, tuple(context), tree.max_depth + 1, vocab)


def tv_and_kl(target: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Total variation and KL(target || other) between two dense laws."""
    tv = 0.5 * float((target - other).abs().sum())
    mask = target > 0
    if bool((other[mask] <= 0).any()):
        return tv, math.inf
    kl = float((target[mask] * (target[mask] / other[mask]).log()).sum())
    return tv, kl




class TableTarget:
    """A target (``verispec.backends.Target``) whose law after any prefix is read from a table: the decoding loop
    runs on it unchanged, so the whole loop -- drafting, policy, verification, commits -- can be enumerated."""

    name = "table"
    backend = "table"
    forward_id = "table"
    max_context = 1 << 20
    eos_token_ids: frozenset = frozenset()

    def __init__(self, p: Table, vocab: int):
        self.p, self.vocab_size = p, vocab

    class State:
        def __init__(self):
            self.tokens: list[int] = []
            self.pending: list[tuple[int, ...]] = []  # each pending entry's full prefix (committed + ancestors + it)

        @property
        def committed(self) -> int:
            return len(self.tokens)

    def new_state(self):
        return TableTarget.State()

    def prefill_output(self, state, tokens, inputs_embeds=None, features=(-1,)):
        state.tokens += list(tokens)
        if not tokens:
            return None
        return ForwardOutput(self.p(tuple(state.tokens)).log()[None], torch.zeros(len(tokens), 0))

    def forward(self, state, tokens, positions, attend, features=(-1,)):
        base, rows = len(state.pending), []
        for i in range(int(tokens.shape[0])):
            seen = [j for j in range(base + i) if bool(attend[i, j])]
            prefix = state.pending[max(seen)] if seen else tuple(state.tokens)
            state.pending.append(prefix + (int(tokens[i]),))
            rows.append(self.p(state.pending[-1]).log())
        return ForwardOutput(torch.stack(rows), torch.zeros(len(rows), 0))

    def state_pool(self, slots, capacity):
        return None

    def forward_batch(self, states, tokens, positions, attends, features=(-1,), logits_from=None):
        outs = [self.forward(s, t, p, a, features) for s, t, p, a in zip(states, tokens, positions, attends)]
        first = logits_from or [0] * len(outs)
        return [ForwardOutput(o.logits[min(f, len(o.logits) - 1):], o.hidden) for o, f in zip(outs, first)]

    def commit(self, state, keep):
        if keep:
            state.tokens = list(state.pending[keep[-1]])
        state.pending = []


def loop_law(verifier: VerifierSpec, p: Table, q: Table, tree: Tree, vocab: int, length: int,
             policy_factory: Callable[[], object] | None = None, context: tuple[int, ...] = (0,),
             children: str = "iid", drafter: Drafter | None = None) -> dict[tuple[int, ...], float]:
    """Exact law of the first ``length`` tokens the real decoding loop (``generate_steps``) emits after
    ``context`` on table models, with a fresh policy from ``policy_factory`` (decisions of a learning policy
    depend on earlier steps, and the enumeration follows them). ``drafter`` replaces the table draft of ``q``."""
    target, drafter = TableTarget(p, vocab), drafter if drafter is not None else TableDrafter(q)

    def run(rng):
        out = []
        recipe = Recipe(verifier, tree, drafter, children, policy_factory() if policy_factory else Fixed())
        for rec in generate_steps(target, recipe, list(context), max_new_tokens=length, sampling=Sampling(1.0),
                                  rng=rng):
            out.extend(rec.emitted)
        return tuple(out)

    law: dict[tuple[int, ...], float] = {}
    for weight, emitted in enumerate_outcomes(run):
        law[emitted] = law.get(emitted, 0.0) + weight
    return law


def batch_loop_law(verifier: VerifierSpec, p: Table, q: Table, tree: Tree, vocab: int, length: int,
                   contexts: list[tuple[int, ...]], policy_factory: Callable[[], object], costs=None,
                   children: str = "iid") -> dict[tuple[tuple[int, ...], ...], float]:
    """Exact joint law of the first ``length`` tokens of several sequences decoded together by the batched engine
    (``engine.Engine``: one forward per step over all of them, the load-aware plan choosing each sequence's depth
    from the others' too when ``costs`` is given), on table models at temperature 1. Every sequence's random calls
    go to one scripted stream, so every outcome of every sequence is enumerated."""
    target = TableTarget(p, vocab)

    def run(rng):
        engine = Engine(target, max_batch=len(contexts), load_aware=costs is not None,
                        costs=CostBook(target, forward=costs) if costs is not None else None)
        seqs = [engine.submit(list(c), Recipe(verifier, tree, TableDrafter(q), children, policy_factory()),
                              sampling=Sampling(1.0), max_new_tokens=length, rng=rng) for c in contexts]
        run_all(engine)
        return tuple(tuple(s.token_ids) for s in seqs)

    law: dict[tuple[tuple[int, ...], ...], float] = {}
    for weight, emitted in enumerate_outcomes(run):
        law[emitted] = law.get(emitted, 0.0) + weight
    return law
