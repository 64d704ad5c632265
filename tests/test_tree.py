import pytest
import torch

from verispec.errors import VerispecError
from verispec.tree import Tree


def test_chain():
    t = Tree.chain(3)
    assert t.parents == (-1, 0, 1, 2)
    assert t.depths == (0, 1, 2, 3)
    assert t.is_chain and t.paths == ((1, 2, 3),)


def test_complete_3x2_breadth_first():
    t = Tree.complete(3, 2)
    assert t.size == 1 + 3 + 9
    assert t.children[0] == (1, 2, 3)
    assert t.children[2] == (7, 8, 9)
    assert t.ranks[8] == 1
    assert len(t.paths) == 9 and t.paths[0] == (1, 4)


def test_branching_list():
    t = Tree.from_branching([3, 1, 1])
    assert t.size == 1 + 3 + 3 + 3
    assert [len(c) for c in t.children[:4]] == [3, 1, 1, 1]
    assert len(t.paths) == 3 and all(len(p) == 3 for p in t.paths)


def test_paths_medusa_style_adds_prefixes():
    t = Tree.from_paths([(0, 0), (1,), (0, 1)])
    # nodes: root, (0), (1), (0,0), (0,1)
    assert t.parents == (-1, 0, 0, 1, 1)
    with pytest.raises(VerispecError, match="sibling"):
        Tree.from_paths([(1,)])  # rank 1 without rank 0


def test_mask_is_ancestor_or_self():
    t = Tree.complete(2, 2)
    m = t.ancestors_mask()
    for i in range(t.size):
        anc, n = {i}, i
        while t.parents[n] >= 0:
            n = t.parents[n]
            anc.add(n)
        assert set(torch.nonzero(m[i]).flatten().tolist()) == anc


@pytest.mark.parametrize("text,size", [("chain:5", 6), ("3x5", 1 + 3 + 9 + 27 + 81 + 243), ("3,1,1", 10), ("paths:0;1;0.0", 4)])
def test_parse(text, size):
    assert Tree.parse(text).size == size


@pytest.mark.parametrize("bad", ["", "chain:x", "3x", "0,1", "paths:-1"])
def test_parse_errors_are_clear(bad):
    with pytest.raises(VerispecError):
        Tree.parse(bad)


def test_truncate_keeps_numbering():
    t = Tree.complete(2, 3).truncate(1)
    assert t.parents == (-1, 0, 0)
