"""The drafter interface and the one tree-growing routine every drafter shares.

A drafter proposes a token tree after the committed context and records, for each drafted node,
the exact law its parent's children were drawn from (``q``) and the conditional probability of that
child given its parent and earlier siblings (``child_prob``). Children of a node are drawn one of three ways:

* ``iid``  -- k independent draws from q, duplicates allowed (SpecInfer);
* ``swor`` -- k draws without replacement (sequential draws from q renormalised over unused tokens,
  the same law as Gumbel-top-k);
* ``topk`` -- the k most likely draft tokens, deterministic given the prefix (child_prob = 1).

Subclasses implement two hooks: ``_root_logits(context)`` (logits after the last committed token)
and ``_node_logits(draft_so_far, nodes)`` (logits after the given drafted nodes), plus ``commit``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import VerispecError
from ..probs import Sampling, argmax, logits_to_probs
from ..rng import Randomness
from ..tree import DynamicTree, Tree
from .registry import register_draft

CHILD_MODES = ("iid", "swor", "topk", "hub")


@dataclass(frozen=True)
class Draft:
    tree: Tree
    tokens: torch.Tensor  # [N] long; tokens[0] is the root (the last committed token)
    q: torch.Tensor  # [N, V] law each node's children were drawn from (zero rows for leaves)
    child_prob: torch.Tensor  # [N] P(node | parent, earlier siblings); 1 for the root
    children: str  # how each node's children were drawn: one of CHILD_MODES
    soft_q: torch.Tensor | None = None  # at temperature 0: the draft's softmax laws (T = 1), for policies

    def policy_q(self) -> torch.Tensor:
        """The laws draft-length policies judge confidence and entropy by: ``q``, or its T = 1 softmax when
        greedy (a greedy ``q`` is a point mass; Hugging Face's confidence uses the softmax of the raw scores)."""
        return self.q if self.soft_q is None else self.soft_q

    @property
    def num_drafted(self) -> int:
        return self.tree.size - 1


@dataclass(frozen=True)
class SparseRows:
    """Draft logits of a few tokens per row, every other token impossible (``-inf``): what a draft that proposes
    from a short list returns (prompt lookup's continuations, a point mass). ``rows[i]`` is ``(tokens, logits)``,
    distinct tokens ascending with finite logits (``sparse_row``), or None for a row with no possible token. ``_grow`` works on these lists, never on the
    vocabulary, and only the finished ``Draft``'s laws are vocabulary-sized."""

    rows: list[tuple[torch.Tensor, torch.Tensor] | None]
    vocab: int

    def dense(self) -> torch.Tensor:
        out = torch.full((len(self.rows), self.vocab), float("-inf"))
        for i, row in enumerate(self.rows):
            if row is not None:
                out[i, row[0]] = row[1].float()
        return out


def whole_rows(cls: type) -> type:
    """A sparse drafter class answering whole rows of the vocabulary instead (its own rows densified), as every
    draft did before ``SparseRows``: for comparing the two growths (tests, ``scripts/experiments/draft_cost.py``)."""
    class WholeRows(cls):
        def _root_logits(self, context):
            row = self._root_sparse(context)
            return None if row is None else SparseRows([row], self.vocab_size).dense()[0]

        def _node_logits(self, g, nodes):
            return SparseRows(self._node_sparse(g, nodes), self.vocab_size).dense()

    WholeRows.__name__ = f"WholeRows{cls.__name__}"
    return WholeRows


def sparse_row(tokens: list[int], logits: list[float] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``SparseRows`` row from distinct tokens and their logits (sorted by token, as the dense row's order)."""
    t = torch.tensor(tokens, dtype=torch.long)
    x = torch.as_tensor(logits, dtype=torch.float32)
    if len(tokens) == 1:
        return t, x
    order = torch.argsort(t)
    return t[order], x[order]


@dataclass(frozen=True)
class DraftControl:
    """What a drafter may ask while it drafts: the policy's ``keep_drafting`` and the two capabilities that decide how
    it is asked (``policies.Policy``). The loop builds one per step; a drafter never sees the policy."""

    keep_drafting: Callable[..., bool]
    reads_laws: bool = True  # False: the call never reads the laws, so a greedy draft skips their softmax
    uses_confidence: bool = False  # True: asked before the laws, with the drafter's confidence only

    @classmethod
    def of(cls, policy) -> "DraftControl":
        return cls(policy.keep_drafting, policy.reads_laws, policy.uses_confidence)


@dataclass
class _Growing:
    """A draft under construction (node lists, appended breadth-first)."""

    parents: list[int]
    tokens: list[int]
    tree_node: list[int]  # the node of the tree being drafted (``propose``'s ``tree``) each drafted node stands for
    q_rows: dict[int, torch.Tensor]
    child_prob: list[float]
    soft_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def add_children(self, node: int, tokens: list[int], probs: list[float], tree: Tree) -> list[int]:
        """Append ``node``'s children (their tokens, in rank order, and conditional probabilities), each standing for
        the drafted tree's child of that rank; returns their indices."""
        slots = tree.children[self.tree_node[node]]
        first = len(self.parents)
        for rank, (x, cp) in enumerate(zip(tokens, probs)):
            self.parents.append(node)
            self.tokens.append(x)
            self.tree_node.append(slots[rank])
            self.child_prob.append(cp)
        return list(range(first, len(self.parents)))

    def path(self, node: int) -> list[int]:
        """Drafted tokens from the root's first child down to ``node``."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]


class Drafter:
    """Base class: grows a draft following a tree (a subtree of it, as the policy decides); subclasses provide
    logits."""

    name = "drafter"
    drafts = True  # False: proposes nothing ever (``NoDrafter``, plain decoding)
    sources: dict[str, "Drafter"] | None = None  # a drafter with several draft sources (``HybridDrafter``), by name
    depth_cost = 0.1  # drafting cost per depth against a plain target step, where nothing measured it
    cost_id: str | None = None  # what its drafting computes with, naming its measured batch costs (``drafters.costs``)
    vocab_size: int | None = None
    uses_target_hidden = False  # True: the loop calls ``observe`` with the target's hidden states
    uses_target_logits = False  # True: the loop calls ``observe_logits`` with each step's target logits
    feature_layers: tuple[int, ...] = (-1,)  # which of the target's hidden states ``observe`` receives
    default_tree: str | None = None  # the tree ``--tree auto`` uses with this drafter (a tuned one, if known)
    step_costs: tuple[float, ...] | None = None  # measured cost of a step drafting d depths, a plain step = 1
    free_root = False  # True: drafting the first depth costs next to nothing (no model forward)
    sparse = False  # True: it implements ``_root_sparse`` and ``_node_sparse`` (a few tokens a row, ``SparseRows``)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_root_logits" in cls.__dict__ or "_node_logits" in cls.__dict__:
            cls.sparse = False  # a subclass that answers with whole rows is asked for them, even below a sparse one

    def catch_up(self, context: list[int]) -> int:
        """Rows its first depth runs after ``context``: what its cache lacks (0 for a draft with no model)."""
        return 0

    def observe(self, hidden: torch.Tensor) -> None:
        """The target's hidden states ``[n, k H]`` (the ``feature_layers``) of the next n committed positions (the
        prompt, then at each step the root and the accepted path); only called when ``uses_target_hidden``."""

    def observe_logits(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's logits ``[n, V]`` after each input token ``[n]`` of a step's forward (the root and every
        drafted node, accepted or not); only called when ``uses_target_logits``."""

    def reset(self, prompt: list[int]) -> None:
        """Start a new sequence (drop any cached state)."""

    def source(self, context: list[int]) -> str | None:
        """Which of its draft sources proposes after ``context`` (a drafter with several, ``HybridDrafter``), or None
        (one source). The loop asks before planning the step, so a policy can keep its statistics per source."""
        return None

    def check_compatible(self, target) -> None:
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            raise VerispecError(
                f"draft vocabulary ({self.vocab_size}) differs from the target's ({target.vocab_size}); "
                "a draft must share the target's tokenizer"
            )

    def _root_logits(self, context: list[int]) -> torch.Tensor | None:
        if not self.sparse:
            raise NotImplementedError
        row = self._root_sparse(context)
        return None if row is None else SparseRows([row], self.vocab_size).dense()[0]

    def _root_sparse(self, context: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A sparse drafter's row after ``context`` (see ``SparseRows``), or None: no draft."""
        raise NotImplementedError

    def _node_sparse(self, draft: "_Growing", nodes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """A sparse drafter's rows after each of the drafted ``nodes``."""
        raise NotImplementedError

    def confidence(self, nodes: list[int], logits: torch.Tensor) -> torch.Tensor:
        """How sure the draft is of the next token below each of ``nodes`` (``logits [F, V]`` their draft logits,
        ``-inf`` for impossible tokens), a score in [0, 1] that the ``auto`` policy calibrates against acceptance:
        by default the top probability at temperature 1 (0 for a row with no possible token)."""
        x = logits.float()
        return torch.nan_to_num((x.max(-1).values - torch.logsumexp(x, -1)).exp(), nan=0.0)

    def _node_logits(self, draft: _Growing, nodes: list[int]) -> torch.Tensor:
        if not self.sparse:
            raise NotImplementedError
        return SparseRows(self._node_sparse(draft, nodes), self.vocab_size).dense()

    def commit(self, draft: Draft, path: list[int]) -> None:
        """The target accepted the drafted nodes ``path`` (root-to-leaf, root excluded)."""

    def fork(self) -> "Drafter":
        """A drafter of the same kind for another sequence: the same model weights, a state of its own (a batch gives
        each sequence one)."""
        out = copy.copy(self)
        out.reset([])
        return out

    @property
    def batch_key(self) -> object:
        """Drafters with the same key draft a batch's depth in one call (the same draft model; by default the
        class): the load-aware plan counts one drafting cost per key and depth."""
        return type(self)

    def proposer(self, context: list[int]) -> "Drafter":
        """The drafter that drafts after ``context``: itself, or for a drafter with several sources the one
        ``source`` chose (batched drafting groups the proposers that share a model)."""
        return self

    def propose(
        self,
        context: list[int],
        tree: Tree,
        sampling: Sampling,
        children: str,
        rng: Randomness,
        control: DraftControl | None = None,
    ) -> Draft:
        """Draft a tree shaped like (a subtree of) ``tree`` after ``context``; ``context[-1]`` is the root.
        ``control`` (None: draft the whole tree) decides, before each depth, whether to go on."""
        if isinstance(tree, DynamicTree):
            return self._propose_dynamic(context, tree, sampling, _checked(children))
        grow = self._grow(context, tree, sampling, _checked(children), rng, control)
        try:
            request = next(grow)
            while True:
                request = grow.send(self._answer(request))
        except StopIteration as done:
            return done.value

    def _answer(self, request: tuple) -> torch.Tensor | SparseRows | None:
        """The logits ``_grow`` asks for: ``("root", context)`` or ``("nodes", growing, nodes)``; a sparse drafter's
        as ``SparseRows``."""
        if self.sparse:
            if request[0] == "root":
                row = self._root_sparse(request[1])
                return None if row is None else SparseRows([row], self.vocab_size)
            return SparseRows(self._node_sparse(request[1], request[2]), self.vocab_size)
        return self._root_logits(request[1]) if request[0] == "root" else self._node_logits(request[1], request[2])

    @classmethod
    def _answer_batch(cls, drafters: list["Drafter"], requests: list[tuple]) -> list[torch.Tensor | None]:
        """``_answer`` for several drafters of this class at once; drafters with a model override it to run one
        forward for all of them."""
        return [d._answer(r) for d, r in zip(drafters, requests)]

    def _grow(self, context: list[int], tree: Tree, sampling: Sampling, children: str, rng: Randomness,
              control: DraftControl | None):
        """The one tree-growing routine, as a coroutine: it yields each request for draft logits (``_answer``) and
        is sent the logits, so that one sequence's draft (``propose``) and a batch's (``propose_batch``, one
        model forward per depth for all sequences) run the same code. Returns the ``Draft``."""
        g = _Growing(parents=[-1], tokens=[context[-1]], tree_node=[0], q_rows={}, child_prob=[1.0])
        frontier = [0]
        logits = None
        if tree.size > 1:
            root = yield ("root", context)
            if isinstance(root, SparseRows):
                if control is None or not (control.reads_laws or control.uses_confidence):
                    return (yield from self._grow_sparse(g, root, tree, sampling, children, rng, control))
                root = root.dense()[0]  # a policy that reads the laws gets them whole
            logits = None if root is None else root[None]
        vocab = 0 if logits is None else logits.size(-1)
        dtype = torch.float64 if logits is not None and logits.dtype == torch.float64 else torch.float32
        for depth in range(tree.max_depth):
            if logits is None:
                break
            alive = logits.amax(-1) != float("-inf")  # a row with no finite entry: that node gets no children
            if not bool(alive.any()):
                break
            gate = control is not None and control.uses_confidence
            if gate and not control.keep_drafting(depth, None, confidence=self.confidence(frontier, logits)):
                break  # decided before any vocabulary-sized work on the laws
            if not bool(alive.all()):
                logits = torch.where(alive[:, None], logits, torch.zeros_like(logits))
            laws = logits_to_probs(logits, sampling)  # [F, V]
            reads = control is None or control.reads_laws
            # greedy: the temperature-1 laws, for policies that judge confidence (and Feedback); a softmax over the
            # vocabulary per depth, skipped for those that never look
            soft = (logits_to_probs(logits, Sampling(1.0)) if reads else None) if sampling.greedy else laws
            if control is not None and not gate:
                drawn = last = None
                if reads and depth > 0:
                    rows = g.soft_rows if sampling.greedy else g.q_rows
                    drawn = torch.stack([rows[g.parents[n]] for n in frontier])
                    last = drawn.gather(1, torch.tensor([[g.tokens[n]] for n in frontier]))[:, 0]
                if not control.keep_drafting(depth, soft if reads else None, last, drawn):
                    break
            new = []
            for row, node in enumerate(frontier):
                k = len(tree.children[g.tree_node[node]])
                if k == 0 or not bool(alive[row]):
                    continue
                q = laws[row]
                g.q_rows[node] = q
                if sampling.greedy and soft is not None:
                    g.soft_rows[node] = soft[row]
                xs, probs = _draw_children(q, logits[row], k, children, rng)
                new += g.add_children(node, xs, probs, tree)
            expandable = [n for n in new if tree.children[g.tree_node[n]]]
            if not expandable or depth + 1 >= tree.max_depth:
                break
            logits = yield ("nodes", g, expandable)
            if isinstance(logits, SparseRows):
                logits = logits.dense()
            frontier = expandable
        return _finish(g, children, vocab, dtype)

    def _grow_sparse(self, g: "_Growing", rows: SparseRows, tree: Tree, sampling: Sampling, children: str,
                     rng: Randomness, control: DraftControl | None):
        """``_grow`` on ``SparseRows`` (for a control that reads no laws and no confidence, or none): the same
        decisions, draws and random calls on each row's few tokens, whose laws are those of the whole row (every
        other token has probability 0, so temperature, top-k and top-p give the same law on the list; a greedy row's
        point mass is on its first maximal token, the rows' tokens being ascending; a categorical's inverse CDF over
        the list meets the same float64 partial sums as over the whole row). Top-k siblings whose logits tie go by
        token id (a dense ``torch.topk`` takes ties as it may). The finished draft's laws are written over the
        vocabulary once, at the end: vocabulary-sized work a depth had made a "free" chain of 5 cost about a sixth
        of a target step."""
        frontier = [0]
        for depth in range(tree.max_depth):
            alive = [r is not None for r in rows.rows]  # a row's logits are finite (``sparse_row``)
            if not any(alive):
                break
            if control is not None and not control.keep_drafting(depth, None, None, None):
                break
            new = []
            for row, node in enumerate(frontier):
                k = len(tree.children[g.tree_node[node]])
                if k == 0 or not alive[row]:
                    continue
                tokens, logits = rows.rows[row]
                q = logits_to_probs(logits[None], sampling)[0]
                g.q_rows[node] = (tokens, q)
                if children == "topk" and k > 1:  # tied tokens by id (a dense row's top-k orders ties as it may)
                    order = torch.sort(logits, descending=True, stable=True).indices
                    picks = order[:min(k, int(torch.isfinite(logits).sum()))].tolist()
                    probs = [1.0] * len(picks)
                else:
                    picks, probs = _draw_children(q, logits, k, children, rng)
                new += g.add_children(node, [int(tokens[i]) for i in picks], probs, tree)
            expandable = [n for n in new if tree.children[g.tree_node[n]]]
            if not expandable or depth + 1 >= tree.max_depth:
                break
            rows = yield ("nodes", g, expandable)
            if not isinstance(rows, SparseRows):
                raise TypeError(f"{type(self).__name__} answered a sparse root with dense node rows")
            frontier = expandable
        return _finish(g, children, rows.vocab, torch.float32)

    def _propose_dynamic(self, context: list[int], tree: DynamicTree, sampling: Sampling, children: str) -> Draft:
        """EAGLE-2's dynamic tree (see ``DynamicTree``): grow by draft path probability, then keep the best nodes
        (it sets its own depth: the loop checks that the policy is ``fixed``)."""
        if children != "topk" and not sampling.greedy:
            raise VerispecError(f"a dynamic tree drafts top-k children; use --children topk (got {children!r}): "
                                "pruning sampled children by their own probability would bias their law")
        g = _Growing(parents=[-1], tokens=[context[-1]], tree_node=[0], q_rows={}, child_prob=[1.0])
        root = self._root_logits(context)  # dense: a sparse drafter's densified
        if root is None:
            return _finish(g, "topk", 0, torch.float32)
        logp = [0.0]  # draft log path probability of each node
        frontier, logits = [0], root[None]
        for depth in range(tree.depth):
            alive = torch.isfinite(logits).any(-1)
            logits = torch.where(alive[:, None], logits, torch.zeros_like(logits))
            laws = logits_to_probs(logits, sampling)
            conf = logits_to_probs(logits, Sampling(1.0)) if sampling.greedy else laws
            new = []
            for row, node in enumerate(frontier):
                if not bool(alive[row]):
                    continue
                g.q_rows[node] = laws[row]
                if sampling.greedy:
                    g.soft_rows[node] = conf[row]
                xs, _ = _draw_children(laws[row], logits[row], tree.k, "topk", None)
                lp = torch.log(conf[row, xs]).tolist()
                for x, l in zip(xs, lp):
                    g.parents.append(node)
                    g.tokens.append(x)
                    g.tree_node.append(0)
                    g.child_prob.append(1.0)
                    logp.append(logp[node] + l)
                    new.append(len(g.parents) - 1)
            if not new or depth + 1 >= tree.depth:
                break
            frontier = sorted(new, key=lambda n: (-logp[n], n))[: tree.k]
            logits = self._node_logits(g, frontier)
        # keep the best nodes; a child's path probability never exceeds its parent's, and ties go to the lower
        # (earlier) index, so every kept node's parent is kept too
        kept = [0] + sorted(sorted(range(1, len(g.parents)), key=lambda n: (-logp[n], n))[: tree.nodes])
        new_id = {old: new for new, old in enumerate(kept)}
        pruned = _Growing(parents=[-1] + [new_id[g.parents[n]] for n in kept[1:]], tokens=[g.tokens[n] for n in kept],
                          tree_node=[0] * len(kept), q_rows={}, child_prob=[1.0] * len(kept))
        has_children = {g.parents[n] for n in kept[1:]}
        pruned.q_rows = {new_id[n]: g.q_rows[n] for n in kept if n in has_children}
        pruned.soft_rows = {new_id[n]: g.soft_rows[n] for n in kept if n in has_children and n in g.soft_rows}
        self._renumber(kept)
        return _finish(pruned, "topk", root.size(-1), torch.float64 if root.dtype == torch.float64 else torch.float32)

    def _renumber(self, kept: list[int]) -> None:
        """A dynamic tree kept the grown nodes ``kept`` (new node i was node ``kept[i]``); drafters that track
        drafted nodes (e.g. their cache slots) renumber them here."""


def _finish(g: _Growing, children: str, vocab: int, dtype: torch.dtype) -> Draft:
    """The ``Draft`` of a grown tree: its q rows (zero for leaves) and conditional child probabilities."""
    tree = Tree(tuple(g.parents))
    q = torch.zeros(tree.size, vocab, dtype=dtype)
    for node, row in g.q_rows.items():
        if isinstance(row, tuple):  # a sparse row: (tokens, their probabilities)
            q[node, row[0]] = row[1].to(dtype)
        else:
            q[node] = row
    soft_q = None
    if g.soft_rows:
        soft_q = torch.zeros(tree.size, vocab, dtype=dtype)
        for node, row in g.soft_rows.items():
            soft_q[node] = row
    return Draft(
        tree=tree,
        tokens=torch.tensor(g.tokens, dtype=torch.long),
        q=q,
        child_prob=torch.tensor(g.child_prob, dtype=torch.float64),
        children=children,
        soft_q=soft_q,
    )


def _checked(children: str) -> str:
    if children not in CHILD_MODES:
        raise VerispecError(f"unknown child mode {children!r}; choose from {', '.join(CHILD_MODES)}")
    return children


def propose_batch(drafters: list[Drafter], contexts: list[list[int]], trees: list[Tree], samplings: list[Sampling],
                  children: list[str], rngs: list[Randomness],
                  controls: list[DraftControl | None]) -> list[Draft]:
    """One draft per sequence (each drafter is that sequence's own, ``Drafter.fork``), grown together: at each
    round every sequence's request for draft logits is answered in one call per class of proposer
    (``_answer_batch``: for a model draft, one forward over every sequence's nodes). Each sequence's draft, and the
    random calls it makes on its own ``rng``, are those ``propose`` makes for it alone."""
    proposers = [d.proposer(c) for d, c in zip(drafters, contexts)]
    drafts: list[Draft | None] = [None] * len(drafters)
    growing, requests = {}, {}
    for i, (p, c, t, s, ch, r, ctl) in enumerate(zip(proposers, contexts, trees, samplings, children, rngs, controls)):
        if isinstance(t, DynamicTree):  # its own search: drafted alone
            drafts[i] = p.propose(c, t, s, ch, r, ctl)
            continue
        grow = p._grow(c, t, s, _checked(ch), r, ctl)
        try:
            requests[i] = next(grow)
            growing[i] = grow
        except StopIteration as done:
            drafts[i] = done.value
    while growing:
        by_class: dict[type, list[int]] = {}
        for i in growing:
            by_class.setdefault(type(proposers[i]), []).append(i)
        answers = {}
        for cls, idx in by_class.items():
            for i, logits in zip(idx, cls._answer_batch([proposers[i] for i in idx], [requests[i] for i in idx])):
                answers[i] = logits
        for i in list(growing):
            try:
                requests[i] = growing[i].send(answers[i])
            except StopIteration as done:
                drafts[i] = done.value
                del growing[i], requests[i]
    return drafts


def _draw_children(q: torch.Tensor, logits: torch.Tensor, k: int, children: str, rng: Randomness):
    """Draw up to k children of one node in child mode ``children``; return (tokens, conditional probabilities)."""
    if children == "iid":
        xs = rng.categorical(q.expand(k, -1)).tolist()
        return xs, [float(q[x]) for x in xs]
    if children == "swor":
        xs, probs, left = [], [], q.clone()
        for _ in range(min(k, int((q > 0).sum()))):
            law = left / left.sum()
            x = int(rng.categorical(law))
            xs.append(x)
            probs.append(float(law[x]))
            left[x] = 0
        return xs, probs
    if children == "hub":
        return hub_pair(q, k, rng)
    # topk: deterministic, from the raw logits so that it does not depend on temperature
    if k == 1:  # a row that gets children has a finite entry; argmax is its first maximum
        return [int(argmax(logits))], [1.0]
    finite = int(torch.isfinite(logits).sum())
    xs = torch.topk(logits, min(k, finite)).indices.tolist()
    return xs, [1.0] * len(xs)


def hub_pair(q: torch.Tensor, k: int, rng: Randomness):
    """SpecHub's two children (Sun et al. 2024): the first from ``q``; the second is the *hub* ``a`` (``q``'s first
    maximum) unless the first is ``a``, then it is drawn from ``q`` without ``a``. Every pair holds the hub, and the
    pair ``(i, a)`` has law ``q(i)``, ``(a, i)`` law ``q(a) q(i) / sum_{j != a} q(j)``. One child is a draw from ``q``;
    a second is left out where ``q`` has no mass off the hub. Returns (tokens, conditional probabilities)."""
    if k > 2:
        raise VerispecError(f"hub children come in pairs (SpecHub): at most 2 a node, got {k}")
    x = int(rng.categorical(q))
    xs, probs = [x], [float(q[x])]
    if k == 2:
        a = int(argmax(q))
        if x != a:
            xs.append(a)
            probs.append(1.0)
        else:
            rest = q.clone()
            rest[a] = 0
            if float(rest.sum()) > 0:
                law = rest / rest.sum()
                y = int(rng.categorical(law))
                xs.append(y)
                probs.append(float(law[y]))
    return xs, probs


class NoDrafter(Drafter):
    """Drafts nothing: every step is one target forward on the root, i.e. plain autoregressive decoding."""

    name = "none"
    drafts = False

    def _root_logits(self, context):
        return None


@register_draft("none", help="'none' (plain autoregressive decoding)", takes_arg=False)
def _none(target, arg, **_) -> NoDrafter:
    return NoDrafter()
