"""Sequoia-style tree shape search: the draft tree that maximises expected accepted tokens per second.

Model (Sequoia, Chen et al. 2024): a drafted node of rank i among its siblings lies on the accepted path,
given that its parent does, with probability ``p[i]`` (the unconditional positional acceptance: the first
i - 1 siblings rejected and this one accepted; ``sum(p) <= 1``), the same at every node. The expected
number of accepted drafted tokens of a tree is then the sum over its nodes of the product of ``p`` along
the path to them, and one step emits that plus the recovered or bonus token.

``best_value[n][d]`` (the largest such sum over trees of n nodes, root included, and depth <= d) obeys
``f(1, d) = 0`` and ``f(n, d) = max sum_i p[i] (1 + f(s_i, d - 1))`` over children sizes ``s_1..s_m``
(m <= len(p), sizes >= 1, summing to n - 1), solved by a knapsack over the ranks. The best shape for a
machine divides ``1 + f(n, d)`` by the measured cost of one step: a target forward over n tokens and d
draft forwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import VerispecError
from .tree import Tree

NEG = float("-inf")


def positional_acceptance(conditional: Sequence[float]) -> list[float]:
    """Unconditional ``p[i]`` from the conditional ``P(candidate i accepted | 1..i-1 rejected)`` (the
    per-candidate acceptance the benchmark reports); NaN entries (never reached) count as 0."""
    out, left = [], 1.0
    for r in conditional:
        r = 0.0 if r != r else float(r)
        out.append(left * r)
        left *= 1 - r
    return out


@dataclass(frozen=True)
class TreeTable:
    """``value[d][n]`` = best expected accepted drafted tokens with n nodes (root included), depth <= d, and
    the children sizes that reach it (for rebuilding the tree)."""

    p: tuple[float, ...]
    value: list[list[float]]
    split: list[list[tuple[int, ...] | None]]

    def tree(self, nodes: int, depth: int) -> Tree:
        if self.value[depth][nodes] == NEG:
            raise VerispecError(f"no tree of {nodes} nodes has depth <= {depth} with {len(self.p)} children per node")
        paths: list[tuple[int, ...]] = []

        def build(prefix: tuple[int, ...], n: int, d: int) -> None:
            for rank, size in enumerate(self.split[d][n] or ()):
                child = (*prefix, rank)
                paths.append(child)
                build(child, size, d - 1)

        build((), nodes, depth)
        return Tree.from_paths(paths) if paths else Tree.root_only()


def tree_table(p: Sequence[float], max_nodes: int, max_depth: int) -> TreeTable:
    """Solve the recursion in the module docstring for every n <= ``max_nodes`` and d <= ``max_depth``."""
    p = tuple(float(x) for x in p)
    if not p or any(x < 0 for x in p) or sum(p) > 1 + 1e-9:
        raise VerispecError("positional acceptances must be >= 0 and sum to at most 1")
    if max_nodes < 1 or max_depth < 0:
        raise VerispecError("max_nodes must be >= 1 and max_depth >= 0")
    k = len(p)
    value = [[NEG] * (max_nodes + 1) for _ in range(max_depth + 1)]
    split: list[list[tuple[int, ...] | None]] = [[None] * (max_nodes + 1) for _ in range(max_depth + 1)]
    for d in range(max_depth + 1):
        value[d][1], split[d][1] = 0.0, ()
        if d == 0:
            continue
        child = value[d - 1]
        # g[i][m]: best value of children ranks i..k-1 (used in order, each >= 1 node) holding m nodes in total
        g = [[NEG] * max_nodes for _ in range(k + 1)]
        arg = [[0] * max_nodes for _ in range(k + 1)]
        for i in range(k, -1, -1):
            g[i][0] = 0.0
            if i == k:
                continue
            for m in range(1, max_nodes):
                best, best_s = NEG, 0
                for s in range(1, m + 1):
                    if child[s] == NEG:
                        continue
                    rest = 0.0 if m == s else g[i + 1][m - s]
                    if rest == NEG:
                        continue
                    v = p[i] * (1 + child[s]) + rest
                    if v > best + 1e-15:
                        best, best_s = v, s
                g[i][m], arg[i][m] = best, best_s
        for n in range(2, max_nodes + 1):
            if g[0][n - 1] == NEG:
                continue
            sizes, i, m = [], 0, n - 1
            while m > 0:
                s = arg[i][m]
                sizes.append(s)
                m -= s
                i += 1
            value[d][n], split[d][n] = g[0][n - 1], tuple(sizes)
    return TreeTable(p, value, split)


@dataclass(frozen=True)
class ShapeChoice:
    nodes: int  # drafted nodes (root excluded)
    depth: int
    accepted: float  # expected tokens per step, bonus included
    step_cost: float
    tokens_per_cost: float
    tree: Tree


def best_shape(p: Sequence[float], step_cost: Callable[[int, int], float], max_nodes: int = 64,
               max_depth: int = 8) -> tuple[ShapeChoice, list[ShapeChoice]]:
    """The tree maximising ``(1 + f(n, d)) / step_cost(drafted nodes, depth)``; also every (n, d) optimum."""
    table = tree_table(p, max_nodes + 1, max_depth)
    choices = []
    for d in range(max_depth + 1):
        for n in range(1, max_nodes + 2):
            v = table.value[d][n]
            if v == NEG or (d > 0 and v <= table.value[d - 1][n] + 1e-12):
                continue  # infeasible, or no better than a shallower tree of the same size
            cost = float(step_cost(n - 1, d))
            if not cost > 0 or math.isinf(cost):
                raise VerispecError(f"step cost must be positive and finite, got {cost} for {n - 1} nodes, depth {d}")
            choices.append(ShapeChoice(n - 1, d, 1 + v, cost, (1 + v) / cost, table.tree(n, d)))
    return max(choices, key=lambda c: (c.tokens_per_cost, -c.nodes)), choices


def tree_spec(tree: Tree) -> str:
    """``tree`` in ``--tree`` syntax (``chain:G`` or ``paths:...``), so the bench and the CLI can use it."""
    if tree.size == 1:
        return "none"
    if tree.is_chain:
        return f"chain:{tree.size - 1}"
    paths = []
    for node in range(1, tree.size):
        ranks, n = [], node
        while n > 0:
            ranks.append(tree.ranks[n])
            n = tree.parents[n]
        paths.append(".".join(map(str, ranks[::-1])))
    return "paths:" + ";".join(paths)
