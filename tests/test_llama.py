"""The llama.cpp backend (run where the optional extra is installed: bash scripts/install_llama.sh; the default
install and CI skip these with the reason): tree logits equal path-by-path logits, a commit leaves the cache as a fresh
decode would, and greedy speculative decoding reproduces llama.cpp's own greedy text for every tree and draft.

    .venv/bin/python -m pytest -q tests/test_llama.py
"""

import pytest
import torch

from verispec.backends.llama import available

pytestmark = [pytest.mark.skipif(not available(), reason="llama-cpp-python is not installed (the optional "
                                                           "extra: bash scripts/install_llama.sh)"), pytest.mark.slow]

TOL = 1e-4  # logits; measured differences are 0.0 (the same kernels), the tolerance only allows for other builds


@pytest.fixture(scope="module")
def llama():
    from verispec.backends import load

    return load(backend="llama", threads=1)


@pytest.fixture(scope="module")
def prompt(llama):
    return llama.encode_prompt("Name three rivers and say where each one flows.")


def fresh(llama, ids):
    state = llama.new_state()
    return llama.prefill(state, ids)


def path_tokens(tree, tokens, node):
    out = []
    while node > 0:
        out.append(int(tokens[node]))
        node = tree.parents[node]
    return out[::-1]


@pytest.mark.parametrize("shape", ["chain:3", "2x2", "3,1", "paths:0;1;2;0.0;0.1;2.0"])
def test_tree_logits_equal_each_path_decoded_alone(llama, prompt, shape):
    from verispec import Tree

    tree = Tree.parse(shape)
    g = torch.Generator().manual_seed(1)
    tokens = torch.cat([torch.tensor(prompt[-1:]), torch.randint(100, 5000, (tree.size - 1,), generator=g)])
    state = llama.new_state()
    llama.prefill(state, prompt[:-1])
    out = llama.forward(state, tokens, state.committed + torch.tensor(tree.depths), tree.ancestors_mask()).logits
    for node in range(tree.size):
        ref = fresh(llama, prompt + path_tokens(tree, tokens, node))
        assert float((out[node] - ref).abs().max()) <= TOL, (shape, node)


@pytest.mark.parametrize("shape,keep", [("2x2", [0, 2, 6]), ("2x2", [0, 1]), ("3,1", [0, 3, 6]), ("chain:3", [0]),
                                        ("paths:0;1;2;0.0;2.0", [0, 3, 5])])
def test_after_a_commit_the_next_logits_equal_a_fresh_decode(llama, prompt, shape, keep):
    from verispec import Tree

    tree = Tree.parse(shape)
    tokens = torch.tensor(prompt[-1:] + [300 + 7 * i for i in range(1, tree.size)])
    state = llama.new_state()
    llama.prefill(state, prompt[:-1])
    llama.forward(state, tokens, state.committed + torch.tensor(tree.depths), tree.ancestors_mask())
    llama.commit(state, keep)
    for step in range(3):  # several steps after the commit, each against a fresh decode of the whole text
        nxt = llama.forward(state, torch.tensor([77 + step]), torch.tensor([state.committed]),
                            torch.ones(1, 1, dtype=torch.bool)).logits[0]
        llama.commit(state, [0])
        text = prompt[:-1] + [int(tokens[k]) for k in keep] + [77 + i for i in range(step + 1)]
        assert float((nxt - fresh(llama, text)).abs().max()) <= TOL, (shape, keep, step)
        state = _replay(llama, text)


def _replay(llama, text):
    state = llama.new_state()
    llama.prefill(state, text)
    return state


@pytest.mark.parametrize("shape,verifier", [("chain:4", "chain"), ("2x2", "greedy"), ("3,1", "greedy"),
                                            ("dyn:3,2,4", "greedy")])
@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_greedy_speculative_output_equals_llama_cpp_greedy(llama, prompt, shape, verifier, draft):
    from verispec import Tree, generate, get_policy, get_verifier
    from verispec.bench.peers import llama_generate
    from verispec.drafters import ModelDrafter, build_drafter

    ref = llama_generate("smollm2-135m", prompt, 48, 0.0, threads=1).token_ids
    drafter = build_drafter("ngram", llama) if draft == "ngram" else ModelDrafter(_second_llama())
    out = generate(llama, drafter, get_verifier(verifier), prompt, tree=Tree.parse(shape), max_new_tokens=48,
                   temperature=0.0, children="topk", policy=get_policy("fixed"))
    assert out.token_ids == ref
    if draft == "self" and shape == "chain:4":  # the same model drafting: every drafted token is the target's
        assert all(s.accepted_length == 5 for s in out.steps[:-1])


_SECOND = []


def _second_llama():
    """The same GGUF file in a second llama.cpp context: a draft that agrees with the target."""
    from verispec.backends import load

    if not _SECOND:
        _SECOND.append(load(backend="llama", threads=1))
    return _SECOND[0]


def test_sampling_through_the_llama_backend_is_seeded(llama, prompt):
    from verispec import Tree, generate, get_verifier
    from verispec.drafters import build_drafter

    runs = [generate(llama, build_drafter("ngram", llama), get_verifier("specinfer"), prompt, tree=Tree.parse("2,1"),
                     policy="fixed",
                     max_new_tokens=24, temperature=0.8, seed=s).token_ids for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


def test_drafts_that_need_the_hugging_face_model_are_refused(llama):
    from verispec import VerispecError
    from verispec.drafters import build_drafter

    for spec in ("eagle", "int8", "layerskip:4"):
        with pytest.raises(VerispecError, match="Hugging Face backend"):
            build_drafter(spec, llama)
    assert build_drafter("auto", llama).name == "ngram"


def test_llama_cpp_prompt_lookup_on_a_long_prompt_reproduces_plain_greedy(llama):
    """Prompt lookup is exact at T = 0; on a prompt past llama-cpp-python's 512-token batch it used to crash (its
    score buffer had n_batch rows while the draft model made it keep logits for every position)."""
    from verispec.bench.peers import llama_generate

    text = " ".join(f"Line {i}: the river flows north past the old mill." for i in range(60))
    prompt = llama.encode_prompt(text + "\nRepeat the last line.")
    assert len(prompt) > 600
    plain = llama_generate("smollm2-135m", prompt, 24, 0.0, threads=1).token_ids
    assert llama_generate("smollm2-135m", prompt, 24, 0.0, lookup=4, threads=1).token_ids == plain


def test_plain_decoding_and_an_accepted_chain_touch_no_cache_sequence(llama, prompt, monkeypatch):
    from verispec import Tree

    calls = []
    lib = llama._L

    class Counting:  # the llama.cpp library, counting the sequence operations
        def __getattr__(self, name):
            if name.startswith("llama_memory_seq"):
                calls.append(name)
            return getattr(lib, name)

    state = llama.new_state()
    llama.prefill(state, prompt[:-1])
    monkeypatch.setattr(llama, "_L", Counting())
    tree = Tree.chain(3)
    for keep in ([0], [0, 1, 2, 3]):  # a plain step, then a chain accepted whole
        tokens = torch.tensor([prompt[-1], 300, 301, 302][: tree.size if len(keep) > 1 else 1])
        shape = tree if len(keep) > 1 else Tree.root_only()
        llama.forward(state, tokens, state.committed + torch.tensor(shape.depths), shape.ancestors_mask())
        llama.commit(state, keep)
    assert calls == [] and state.trash == 0
    monkeypatch.undo()
    nxt = llama.forward(state, torch.tensor([77]), torch.tensor([state.committed]), torch.ones(1, 1, dtype=torch.bool))
    assert float((nxt.logits[0] - fresh(llama, state.tokens + [77])).abs().max()) <= TOL
