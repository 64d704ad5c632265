"""Token trees, written declaratively and compiled once into parents, depths, masks and paths.

Node 0 is the root: the last committed token, whose target logits give ``p`` for the first
drafted position. Every other node is a drafted token. Nodes are numbered breadth-first, siblings
in candidate order, so ``parents[i] < i`` and each depth is a contiguous block. The *rank* of a
node is its index among its siblings (candidate 0, 1, ...).

Shapes:
    ``Tree.chain(g)``                 a chain of g drafted tokens;
    ``Tree.complete(b, d)``           every node down to depth d has b children (e.g. 3 x 5);
    ``Tree.from_branching([3,1,1])``  every node at depth i has branching[i] children;
    ``Tree.from_paths([(0,), (1,), (0, 0)])``  Medusa-style list of rank paths (prefixes are implied).
    ``Tree.parse("chain:5" | "3x5" | "3,1,1,1" | "paths:0;1;0.0")``  the same, from a CLI string.

A ``DynamicTree`` (``Tree.parse("dyn:6,4,24")``) is not a shape but a rule the drafter follows (EAGLE-2):
expand the K most probable frontier nodes at each depth with their K most probable children, then keep
the N most probable drafted nodes overall. Either is what ``Tree.parse`` returns and what drafters
and the loop take (``size``, ``max_depth``, ``is_chain``, ``describe``).

``Tree.parse`` refuses, before building anything, a tree of more than ``MAX_NODES`` drafted nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from .errors import VerispecError

MAX_NODES = 1024  # drafted nodes per step; a larger tree is refused (its mask alone would be millions of cells)


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise VerispecError("a tree needs a root: parents[0] must be -1")
        for i, par in enumerate(self.parents[1:], start=1):
            if not 0 <= par < i:
                raise VerispecError(f"node {i} has parent {par}; parents must come before their children")
        depth = [0] * len(self.parents)
        for i, par in enumerate(self.parents[1:], start=1):
            depth[i] = depth[par] + 1
        if any(depth[i] < depth[i - 1] for i in range(1, len(depth))):
            raise VerispecError("nodes must be numbered breadth-first (depths non-decreasing)")

    # ---------- constructors ----------
    @classmethod
    def root_only(cls) -> "Tree":
        return cls((-1,))

    @classmethod
    def chain(cls, g: int) -> "Tree":
        if g < 0:
            raise VerispecError(f"chain length must be >= 0, got {g}")
        return cls(tuple(range(-1, g)))

    @classmethod
    def from_branching(cls, branching: list[int]) -> "Tree":
        if any(b < 1 for b in branching):
            raise VerispecError(f"every branching factor must be >= 1, got {branching}")
        parents, level = [-1], [0]
        for b in branching:
            nxt = []
            for node in level:
                for _ in range(b):
                    parents.append(node)
                    nxt.append(len(parents) - 1)
            level = nxt
        return cls(tuple(parents))

    @classmethod
    def complete(cls, branching: int, depth: int) -> "Tree":
        return cls.from_branching([branching] * depth)

    @classmethod
    def from_paths(cls, paths) -> "Tree":
        """Medusa-style: each path is a tuple of sibling ranks from the root; missing prefixes are added."""
        full = set()
        for path in paths:
            path = tuple(int(r) for r in path)
            if any(r < 0 for r in path):
                raise VerispecError(f"ranks in a path must be >= 0, got {path}")
            for n in range(1, len(path) + 1):
                full.add(path[:n])
        ordered = sorted(full, key=lambda t: (len(t), t))
        index = {(): 0}
        parents = [-1]
        for path in ordered:
            if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in full:
                raise VerispecError(f"path {path} has rank {path[-1]} but its sibling of rank {path[-1] - 1} is missing")
            parents.append(index[path[:-1]])
            index[path] = len(parents) - 1
        return cls(tuple(parents))

    @classmethod
    def parse(cls, text: str) -> "Tree | DynamicTree":
        """CLI form: ``chain:G``, ``BxD`` (complete), ``b1,b2,...`` (per-depth), ``paths:0;1;0.0``, ``dyn:D,K,N``, or
        ``none`` (the root alone: no draft)."""
        s = str(text).strip().lower()
        usage = ("use chain:G, BxD (e.g. 3x5), b1,b2,... (e.g. 3,1,1), paths:0;1;0.0 or dyn:DEPTH,K,N "
                 "(e.g. dyn:6,4,24)")
        if s == "none":
            return cls.root_only()
        try:
            if s.startswith("chain:"):
                n = _count(int(s[6:]), text)
                if n < 1:
                    raise VerispecError(f"tree {text!r} drafts nothing; a chain needs G >= 1 (for no draft say so: "
                                        "the tree 'none', the draft 'none' or the method 'ar')")
                return cls.chain(n)
            if s.startswith("dyn:"):
                tree = DynamicTree(*(int(v) for v in s[4:].split(",")))
                _count(tree.size - 1, text)
                return tree
            if s.startswith("paths:"):
                paths = [tuple(int(r) for r in p.split(".")) for p in s[6:].split(";") if p.strip()]
                if not paths:
                    raise VerispecError(f"tree {text!r} lists no paths; {usage}")
                _count(len(paths), text)
                return cls.from_paths(paths)
            if "x" in s:
                b, d = (int(v) for v in s.split("x"))
                if b < 1 or d < 1:
                    raise VerispecError(f"tree {text!r} needs B >= 1 and D >= 1")
                _count(sum(b**i for i in range(1, min(d, 64) + 1)) if b > 1 else d, text)
                return cls.complete(b, d)
            branching = [int(v) for v in s.split(",")]
            total, level = 0, 1
            for b in branching:
                level *= max(b, 0)
                total += level
                _count(total, text)
            return cls.from_branching(branching)
        except VerispecError:
            raise
        except (ValueError, TypeError):
            raise VerispecError(f"cannot parse tree {text!r}: {usage}") from None

    # ---------- derived structure ----------
    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return self.depths[-1]

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        ch = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            ch[self.parents[i]].append(i)
        return tuple(tuple(c) for c in ch)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        r = [0] * self.size
        for kids in self.children:
            for k, node in enumerate(kids):
                r[node] = k
        return tuple(r)

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Nodes of the tree cut below each depth 0..max_depth (``truncate(d).size``)."""
        return tuple(sum(1 for d in self.depths if d <= k) for k in range(self.max_depth + 1))

    @property
    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    @property
    def branching(self) -> int:
        """The most children any node has (0 for a root alone)."""
        return max(len(c) for c in self.children)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf node lists, excluding the root (a root-only tree has one empty path)."""
        out = []
        for leaf in range(self.size):
            if not self.children[leaf]:
                path, n = [], leaf
                while n > 0:
                    path.append(n)
                    n = self.parents[n]
                out.append(tuple(reversed(path)))
        return tuple(out)

    def ancestors_mask(self) -> torch.Tensor:
        """``[N, N]`` bool: ``m[i, j]`` iff node j is node i or one of its ancestors (the tree attention mask)."""
        n = self.size
        m = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            m[i] |= m[self.parents[i]]
        return m

    def truncate(self, depth: int) -> "Tree":
        """The same tree cut below ``depth`` (node numbering is preserved since depths are blocks); the same object
        each time for the same tree and depth (a batch's plan cuts every sequence's tree every step)."""
        return self if depth >= self.max_depth else _truncated(self, max(depth, 0))

    def describe(self) -> str:
        widths = [sum(1 for d in self.depths if d == k) for k in range(1, self.max_depth + 1)]
        return f"tree({self.size - 1} drafted nodes, depth {self.max_depth}, width per depth {widths})"


@lru_cache(maxsize=4096)
def _truncated(tree: Tree, depth: int) -> Tree:
    return Tree(tree.parents[:tree.sizes[depth]])


def _count(nodes: int, text: str) -> int:
    if nodes > MAX_NODES:
        raise VerispecError(f"tree {text!r} has {nodes if nodes < 10**6 else 'millions of'} drafted nodes; at most "
                            f"{MAX_NODES} are allowed")
    return nodes


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic draft tree: at each of ``depth`` levels expand the ``k`` frontier nodes with the highest
    draft path probability, each with its ``k`` most probable children; finally keep the ``nodes`` drafted nodes
    with the highest path probability (ancestors first, so the kept set is a tree).

    The tree depends only on the draft, never on the target, so verification stays exact; but its children
    must be the draft's top-k (pruning *sampled* children by their own probability would bias their law),
    so it runs with ``--children topk`` (the ``topk`` verifier) or greedy decoding.
    """

    depth: int
    k: int
    nodes: int

    def __post_init__(self):
        if self.depth < 1 or self.k < 1 or self.nodes < 1:
            raise VerispecError(f"dyn:DEPTH,K,N needs positive numbers, got dyn:{self.depth},{self.k},{self.nodes}")

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def size(self) -> int:
        """At most this many nodes, root included."""
        return 1 + min(self.nodes, self.k + (self.depth - 1) * self.k * self.k)  # k at depth 1, then k x k per depth

    @property
    def is_chain(self) -> bool:
        return self.k == 1

    def __str__(self) -> str:
        return f"dyn:{self.depth},{self.k},{self.nodes}"

    def describe(self) -> str:
        return f"dynamic tree (depth {self.depth}, top-{self.k} expansion, {self.nodes} nodes kept)"


