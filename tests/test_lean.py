"""The lean Llama forward (``verispec.backends.lean``) against the ``transformers`` forward of the same model."""

import os
from pathlib import Path

import pytest
import torch
from conftest import gguf_weight, tiny_model, tiny_target

from verispec import NgramDrafter, generate, get_verifier
from verispec.backends import CausalLM
from verispec.backends.hf import quantized_copy
from verispec.backends.kernels import use_fast_linear
from verispec.backends.lean import supports
from verispec.tree import Tree

FEATURES = (0, 2, 4, -1)


def pair(kind="llama", **kw):
    lean = tiny_model(kind, **kw)
    with torch.no_grad():  # Qwen2's q, k and v biases start at zero; give them values a lost bias would show
        for module in lean.hf.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    use_fast_linear(lean.hf)  # the kernel plan for up to 16 rows, as verispec.load gives real models (both forwards)
    stock = CausalLM(lean.hf, name="stock", lean=False)
    assert lean._lean is not None and stock._lean is None
    return lean, stock


def test_lean_serves_plain_llama_and_qwen2_models_only():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    assert supports(tiny_model("llama").hf) and supports(tiny_model("qwen2").hf)
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert not supports(gemma)  # another architecture keeps the transformers forward
    assert not supports(quantized_copy(tiny_model("llama")).hf)  # int8 linear layers
    sliding = tiny_model("llama")
    sliding.hf.config.sliding_window = 8
    assert not supports(sliding.hf)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", ["3x2", "2,1", "chain:4", "1"])
def test_tree_forward_commit_and_features_match_transformers(shape, kind):
    lean, stock = pair(kind)
    tree = Tree.parse(shape)
    prompt = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]
    outs = []
    for m in (lean, stock):
        state = m.new_state()
        pre = m.prefill_output(state, prompt, features=FEATURES)
        tokens = torch.arange(3, 3 + tree.size)
        out = m.forward(state, tokens, state.committed + torch.tensor(tree.depths), tree.ancestors_mask(),
                        features=FEATURES)
        deepest = max(range(tree.size), key=lambda n: (tree.depths[n], -n))
        path = []
        while deepest:
            path.append(deepest)
            deepest = tree.parents[deepest]
        m.commit(state, [0, *path[::-1]])  # not a prefix of the pending entries for wide trees
        nxt = m.forward(state, torch.tensor([7, 8]), state.committed + torch.arange(2),
                        torch.ones(2, 2, dtype=torch.bool).tril())
        outs.append((pre, out, nxt))
    (p1, o1, n1), (p2, o2, n2) = outs
    for a, b in ((p1.logits, p2.logits), (p1.hidden, p2.hidden), (o1.logits, o2.logits), (o1.hidden, o2.hidden),
                 (n1.logits, n2.logits)):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    assert o1.hidden.shape[-1] == len(FEATURES) * lean.config.hidden_size


def test_positions_beyond_the_rotary_table_are_computed(monkeypatch):
    from verispec.backends import lean as lean_module

    monkeypatch.setattr(lean_module.LeanLlama, "TABLE", 8)  # the table covers positions 0..7 only
    lean, stock = pair()
    logits = []
    for m in (lean, stock):
        state = m.new_state()
        logits.append(m.prefill(state, list(range(3, 23))))
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_the_native_rotary_kernel_rounds_as_torch_does_bit_for_bit():
    """``native.rope`` rotates a float32 layer output in place with torch's three roundings per element (no fused
    multiply-add): its results equal the torch expression's exactly, and a lean forward with it equals one without."""
    from verispec.backends import native

    kernel = native.rope()
    if kernel is None:
        pytest.skip("the native rotary kernel cannot be built here (a C++ compiler and ninja)")
    torch.manual_seed(0)
    for rows, heads, dim in ((1, 9, 64), (5, 3, 8), (37, 2, 128)):
        x = torch.randn(rows, heads, dim) * 10
        cos, sin = torch.randn(rows, dim), torch.randn(rows, dim)
        half = dim // 2
        want = x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]
        got = x.clone()
        kernel.rope_(got, cos, sin)
        assert torch.equal(got, want), (rows, heads, dim)
    lean, _ = pair()
    assert lean._lean.rotary is not None
    outs = []
    for rotary in (kernel, None):
        lean._lean.rotary = rotary
        state = lean.new_state()
        outs.append(lean.prefill(state, list(range(3, 23))))
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
        out = lean.forward(state, torch.tensor([5, 6, 7]), state.committed + torch.tensor([0, 1, 1]), tree)
        outs += [out.logits, out.hidden]
    lean._lean.rotary = kernel
    assert all(torch.equal(a, b) for a, b in zip(outs[:3], outs[3:]))


def test_a_prompts_prefill_attends_causally_without_a_mask_and_gets_the_masked_result_bit_for_bit(monkeypatch):
    """A whole prompt under the causal mask attends with ``is_causal`` (torch skips the masked blocks); anything else
    keeps its mask. The logits and features equal the masked call's exactly."""
    from verispec.backends.lean import LeanLlama

    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert LeanLlama._plain_causal(causal)
    assert not LeanLlama._plain_causal(torch.ones(5, 5, dtype=torch.bool))  # a square that is not causal
    assert not LeanLlama._plain_causal(torch.ones(5, 7, dtype=torch.bool).tril(2))  # entries cached before
    assert not LeanLlama._plain_causal(torch.ones(1, 1, dtype=torch.bool))
    prompt = list(range(3, 43))
    lean, _ = pair()
    calls = []
    real = LeanLlama._plain_causal
    monkeypatch.setattr(LeanLlama, "_plain_causal", staticmethod(lambda v: calls.append(real(v)) or calls[-1]))
    fast = lean.prefill_output(lean.new_state(), prompt, features=FEATURES)
    assert calls == [True]
    monkeypatch.setattr(LeanLlama, "_plain_causal", staticmethod(lambda v: False))
    masked = lean.prefill_output(lean.new_state(), prompt, features=FEATURES)
    assert torch.equal(fast.logits, masked.logits) and torch.equal(fast.hidden, masked.hidden)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_generation_equals_the_transformers_forward_token_for_token(kind):
    lean, stock = pair(kind, seed=3)
    prompt = [1, 10, 20, 30, 10, 20, 30, 10, 20]
    texts = [generate(m, NgramDrafter(lean.vocab_size), get_verifier("specinfer"), prompt, tree=Tree.parse("2x2"),
                      policy="fixed",
                      max_new_tokens=40, temperature=0.0).token_ids for m in (lean, stock)]
    assert texts[0] == texts[1] and len(texts[0]) == 40


def test_a_bfloat16_model_runs_lean_and_matches_its_transformers_forward():
    """In bfloat16 the lean forward keeps transformers' norms (float32 statistics) and rotary tables (float32, then
    cast) and attends in float32 over exact upcasts; logits agree with transformers' bfloat16 forward to its
    rounding, and greedy tokens are the same."""
    from verispec.backends.kernels import packing_available

    lean, _ = pair(seed=3)
    lean.hf.bfloat16()
    mixed = tiny_model("llama")
    mixed.hf.model.embed_tokens.float()
    mixed.hf.model.layers.bfloat16()
    assert supports(lean.hf) and not supports(mixed.hf)  # one dtype for every layer
    if packing_available():
        use_fast_linear(lean.hf)
    lean, stock = CausalLM(lean.hf, name="lean"), CausalLM(lean.hf, name="stock", lean=False)
    assert lean._lean is not None and lean.dtype == torch.bfloat16 and lean.forward_id != stock.forward_id
    prompt = [1, 10, 20, 30, 10, 20, 30, 10, 20]
    a, b = (m.prefill(m.new_state(), prompt) for m in (lean, stock))
    assert torch.allclose(a, b, atol=0.1, rtol=0.02), (a - b).abs().max()
    texts = [generate(m, NgramDrafter(lean.vocab_size), get_verifier("specinfer"), prompt, tree=Tree.parse("2x2"),
                      policy="fixed",
                      max_new_tokens=24, temperature=0.0).token_ids for m in (lean, stock)]
    assert texts[0] == texts[1]


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    """torch's ``cpp_extension`` waits forever, silently, on a lock file that a process killed mid-build left."""
    import os

    from verispec.backends.native import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    now = lock.stat().st_mtime
    assert not clear_stale_lock(tmp_path, now + 10) and lock.exists()  # a build may be running: wait for it
    os.utime(lock, (now - STALE_LOCK_S - 1, now - STALE_LOCK_S - 1))
    assert clear_stale_lock(tmp_path, now) and not lock.exists()
    assert "stale build lock" in capsys.readouterr().err
    assert not clear_stale_lock(tmp_path, now)  # no lock: nothing to do


def test_a_kernels_build_folder_is_keyed_by_what_it_is_built_from_and_not_by_the_checkout(tmp_path, monkeypatch):
    """Every checkout shares one build of a kernel, and none loads or rebuilds over another's made from other
    sources or flags: the folder's name is the sources' contents, the flags, torch, the compiler and the CPU."""
    import shutil
    import subprocess
    import sys

    from verispec.backends import native

    monkeypatch.setenv(native.HOME, str(tmp_path / "kernels"))
    here = native.build_dir("k", ("rope.cpp",), ["-O3"])
    assert here.parent == tmp_path / "kernels" and here == native.build_dir("k", ("rope.cpp",), ["-O3"])
    assert native.build_dir("k", ("rope.cpp",), ["-O2"]) != here  # other flags
    assert native.build_dir("k", ("linear.cpp",), ["-O3"]) != here  # other sources
    copied = native._sources_in(here, ("layer.cpp", "linear.cpp"))
    assert copied == [str(here / "src" / "layer.cpp")] and (here / "src" / "linear.cpp").read_bytes() == \
        (Path(native.__file__).parent / "linear.cpp").read_bytes()
    # a second checkout of the same sources, elsewhere on disk: the same folder
    other = tmp_path / "checkout" / "verispec"
    shutil.copytree(Path(native.__file__).parents[2], other, ignore=shutil.ignore_patterns("__pycache__"))
    ask = "from verispec.backends import native; print(native.build_dir('k', ('rope.cpp',), ['-O3']))"
    out = subprocess.run([sys.executable, "-c", ask], cwd=other.parent, capture_output=True, text=True,
                         env={**os.environ, native.HOME: str(tmp_path / "kernels"), "PYTHONPATH": str(other.parent)})
    assert out.stdout.strip() == str(here), out.stderr
    (other / "backends" / "native" / "rope.cpp").write_text("// changed\n")  # ... and a changed source: another
    out = subprocess.run([sys.executable, "-c", ask], cwd=other.parent, capture_output=True, text=True,
                         env={**os.environ, native.HOME: str(tmp_path / "kernels"), "PYTHONPATH": str(other.parent)})
    assert out.stdout.strip() not in ("", str(here)), out.stderr


def test_a_built_kernel_is_loaded_as_it_is_so_another_checkout_builds_nothing(monkeypatch):
    """torch's ``load`` runs ninja, whose command names the building environment's include folders: another
    checkout's environment would build the kernel again. A file in its keyed folder is loaded as it is."""
    import torch.utils.cpp_extension as cpp_extension

    from verispec.backends import native

    if native.rope() is None:
        pytest.skip("the native kernels cannot be built here (a C++ compiler and ninja)")
    folder = native.build_dir(native.ROPE_NAME, ("rope.cpp",), ["-O3", "-ffp-contract=off"])
    assert (folder / f"{native.ROPE_NAME}.so").exists()
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("the kernel was built again"))
    again = native._build(native.ROPE_NAME, "rope.cpp", set(), ["-ffp-contract=off"], "rotary kernel")
    assert again is not None and hasattr(again, "rope_")


def test_the_float32_attention_kernel_is_softmax_attention_and_a_rows_result_ignores_its_company():
    """``native.attention_f32``: tree masks with holes, rows ending at different keys, a span that is no multiple of
    the kernel's fours; equal to torch's masked softmax attention to float rounding, and a sequence's rows give the
    same bits alone, beside other sequences and over a longer span of masked padding."""
    from verispec.backends import native

    kernel = native.attention_f32()
    if kernel is None:
        pytest.skip("the native float32 attention cannot be built here (a C++ compiler, ninja, AVX2 and FMA)")
    g = torch.Generator().manual_seed(0)
    slots, kv, group, n, span = 4, 2, 3, 5, 203
    keys, values = torch.randn(2, slots, kv, 256, 64, generator=g)
    visible = torch.zeros(slots, n, span, dtype=torch.bool)
    for s, length in enumerate((1, 60, 150, span - n)):
        visible[s, :, :length] = torch.rand(n, length, generator=g) > 0.2
        visible[s, :, 0] = True
        visible[s, :, length:length + n] = torch.ones(n, n, dtype=torch.bool).tril()
    limits = (visible * torch.arange(1, span + 1, dtype=torch.int32)).amax(-1).to(torch.int32)
    q = 3 * torch.randn(slots, kv, group * n, 64, generator=g)
    k, v = keys[:, :, :span], values[:, :, :span]
    out = kernel.attend(q, k, v, visible, limits, 0.125)
    rows = visible[:, None, None].expand(slots, kv, group, n, span).reshape(slots, kv, group * n, span)
    scores = (q @ k.transpose(-1, -2) * 0.125).masked_fill(~rows, float("-inf"))
    assert torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-5), (out - torch.softmax(scores, -1) @ v).abs().max()
    for s in range(slots):  # alone, and over the whole buffer (53 masked entries more)
        wide = torch.nn.functional.pad(visible[s:s + 1], (0, 256 - span)).contiguous()
        assert torch.equal(kernel.attend(q[s:s + 1].contiguous(), k[s:s + 1], v[s:s + 1], visible[s:s + 1].contiguous(),
                                         limits[s:s + 1].contiguous(), 0.125), out[s:s + 1])
        assert torch.equal(kernel.attend(q[s:s + 1].contiguous(), keys[s:s + 1], values[s:s + 1], wide,
                                         limits[s:s + 1].contiguous(), 0.125), out[s:s + 1])


def test_the_float32_kernel_writes_a_steps_keys_then_attends_as_attend_does_bit_for_bit():
    """``append_attend`` (what the lean float32 forward calls): a step's rows of several slots, a slot's rows
    consecutive, fewer rows for some slots than others, values in a strided view; it writes each row's key and value
    at its slot and position, and each row's result is ``attend``'s on the written buffers, bit for bit. Rows out of
    range, or a slot's rows apart, are refused."""
    from verispec.backends import native

    kernel = native.attention_f32()
    if kernel is None:
        pytest.skip("the native float32 attention cannot be built here (a C++ compiler, ninja, AVX2 and FMA)")
    g = torch.Generator().manual_seed(2)
    slots, kv, group, cap = 3, 2, 3, 128
    heads, counts, lengths = kv * group, (2, 1, 3), (40, 7, 90)  # rows and cached entries of each slot
    n, span = max(counts), max(lengths) + max(counts)
    keys, values = torch.randn(2, slots + 1, kv, cap, 64, generator=g)  # one more slot than the step uses
    slot = torch.tensor([s for s, c in enumerate(counts) for _ in range(c)], dtype=torch.int32)
    row = torch.tensor([r for c in counts for r in range(c)], dtype=torch.int32)
    pos = torch.tensor([lengths[s] + r for s, r in zip(slot.tolist(), row.tolist())], dtype=torch.int32)
    visible = torch.zeros(slots, n, span, dtype=torch.bool)
    for s, (c, length) in enumerate(zip(counts, lengths)):
        visible[s, :, :length] = torch.rand(n, length, generator=g) > 0.3
        visible[s, :, 0] = True
        visible[s, :c, length:length + c] = torch.ones(c, c, dtype=torch.bool).tril()
    limits = (visible * torch.arange(1, span + 1, dtype=torch.int32)).amax(-1).to(torch.int32)
    q = 3 * torch.randn(len(slot), heads, 64, generator=g)
    k_new = torch.randn(len(slot), kv, 64, generator=g)
    v_new = torch.randn(len(slot), 2 * kv, 64, generator=g)[:, kv:]  # a strided view, as the stacked v
    kb, vb = keys.clone(), values.clone()
    out = kernel.append_attend(q, k_new, v_new, kb, vb, slot, pos, row, visible, limits, span, 0.125)
    written_k, written_v = keys.clone(), values.clone()
    written_k[slot.long(), :, pos.long()] = k_new
    written_v[slot.long(), :, pos.long()] = v_new
    assert torch.equal(kb, written_k) and torch.equal(vb, written_v)  # nothing else written
    padded = torch.zeros(slots, heads, n, 64)
    padded[slot.long(), :, row.long()] = q
    qg = padded.reshape(slots, kv, group * n, 64)  # attend's layout: a key/value head's query heads as its rows
    want = kernel.attend(qg, kb[:slots, :, :span], vb[:slots, :, :span], visible, limits, 0.125)
    assert torch.equal(out, want.view(slots, heads, n, 64)[slot.long(), :, row.long()])
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.append_attend(q, k_new, v_new, kb, vb, slot, pos + span, row, visible, limits, span, 0.125)
    apart = torch.tensor([0, 1, 0, 2, 2, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="consecutive"):
        kernel.append_attend(q, k_new, v_new, kb, vb, apart, pos, row, visible, limits, span, 0.125)


def _forward_everything(model, pool) -> list[torch.Tensor]:
    """Logits and features of three sequences of one pool: their prompts' prefills, then steps of 1, 3 and 17 rows
    (a pooled batch, trees, prompt-sized chunks), each step's rows committed."""
    g = torch.Generator().manual_seed(1)
    states = [pool.acquire() for _ in range(3)]
    outs = [model.prefill_output(s, torch.randint(3, 90, (9 + 7 * j,), generator=g).tolist(), features=FEATURES)
            for j, s in enumerate(states)]
    outs = [t for o in outs for t in (o.logits, o.hidden)]
    for n in (1, 3, 17):
        tokens = [torch.randint(3, 90, (n,), generator=g) for _ in states]
        got = model.forward_batch(states, tokens, [s.committed + torch.arange(n) for s in states],
                                  [torch.ones(n, n, dtype=torch.bool).tril()] * 3, features=FEATURES)
        outs += [t for o in got for t in (o.logits, o.hidden)]
        for s in states:
            model.commit(s, list(range(n)))
    for s in states:
        pool.release(s)
    return outs


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_layers_linear_layers_run_as_four_native_calls_with_each_layers_own_results_bit_for_bit(kind, monkeypatch):
    """In float32 the lean forward runs a decoder layer's seven linear layers as four calls of the native kernel: q, k
    and v stacked as one weight (Qwen2's biases stacked too), o, gate and up as one, down (``_native_calls``). Logits
    and features equal those of the layers run one by one, bit for bit, for prompts, trees and pooled batches; after a
    weight changes in place the calls follow it; a group whose weights are GGUF blocks of different formats keeps a
    call per layer (stacked, they would lose their blocks); a layer without the plan runs them all one by one."""
    from verispec.backends import lean as lean_module
    from verispec.backends import native

    if native.linear() is None:
        pytest.skip("the native linear kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    model, _ = pair(kind)
    lean = model._lean
    pool = model.state_pool(3, 64)
    one_by_one = lean_module.LeanLlama._native_calls
    with torch.inference_mode():
        joint = _forward_everything(model, pool)
        assert all(len(group) == 1 for layer in lean._calls for group in layer)  # four calls a layer
        assert [group[0][3] for group in lean._calls[0]] == [(32, 16, 16), (32,), (64, 64), (32,)]
        assert (lean._calls[0][0][0][2] is not None) == (kind == "qwen2")  # the stacked bias
        monkeypatch.setattr(lean_module.LeanLlama, "_native_calls", lambda self, parts, rows: None)
        alone = _forward_everything(model, pool)
        assert len(joint) == len(alone) == 24
        assert all(torch.equal(a, b) for a, b in zip(joint, alone))

        first = model.hf.model.layers[0]
        first.self_attn.k_proj.weight.mul_(1.5)  # changed in place: the stacked panels are made again
        first.self_attn.q_proj.weight.copy_(gguf_weight("q8_0", 32, 32, seed=5))  # and q, k of two block formats
        first.self_attn.k_proj.weight.copy_(gguf_weight("q4_1", 16, 32, seed=6))
        alone = _forward_everything(model, pool)
        monkeypatch.setattr(lean_module.LeanLlama, "_native_calls", one_by_one)
        changed = _forward_everything(model, pool)
        assert not torch.equal(changed[0], joint[0])
        assert all(torch.equal(a, b) for a, b in zip(changed, alone))
        assert len(lean._calls[0][0]) == 3 and lean._calls[0][0][0][0].dtype == torch.uint8  # q from its blocks
        assert all(len(group) == 1 for layer in lean._calls[1:] for group in layer)

        first.mlp.up_proj._verispec_plan = (0,) * 18  # a layer on another plan (the stock kernel): one by one
        assert lean._native_calls(lean._parts(), 1) is None


def _own_cache_steps(model) -> list[torch.Tensor]:
    """Logits and features of one sequence on its own cache (no pool): its prompt, then trees of 1, 4 and 2 rows."""
    g = torch.Generator().manual_seed(2)
    state = model.new_state()
    out = model.prefill_output(state, torch.randint(3, 90, (12,), generator=g).tolist(), features=FEATURES)
    outs = [out.logits, out.hidden]
    for tree in (Tree.root_only(), Tree.chain(3), Tree.chain(1)):
        tokens = torch.randint(3, 90, (tree.size,), generator=g)
        (got,) = model.forward_batch([state], [tokens], [state.committed + torch.tensor(tree.depths)],
                                     [tree.ancestors_mask()], features=FEATURES)
        outs += [got.logits, got.hidden]
        model.commit(state, [0, 1] if tree.size > 1 else [0])
    return outs


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_every_decoder_layer_runs_in_one_native_call_bit_for_bit_as_the_python_loop(kind):
    """In float32, where the float32 attention kernel serves every sequence of a forward (a pooled batch of short
    sequences, or one sequence on its own cache), the lean forward runs all its decoder layers in one native call
    (``native.layer``): logits and features equal the Python loop's bit for bit, for prompts, trees and pooled batches;
    a prompt chunk beyond the pooled rows, and a group whose weights are GGUF blocks of different formats, keep the
    loop; after a weight changes in place the call follows it."""
    from verispec.backends import native

    if native.layer() is None:
        pytest.skip("the native decoder layer kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    model, _ = pair(kind, head_dim=64)
    lean = model._lean
    kernel, ran = lean.layers_kernel, []

    class Spy:
        def layers(self, x, *rest):
            ran.append(x.shape[0])
            return kernel.layers(x, *rest)

    def both():
        lean.layers_kernel = Spy()
        ran.clear()
        pool = model.state_pool(3, 96)
        fused = _forward_everything(model, pool) + _own_cache_steps(model)
        calls = list(ran)
        lean.layers_kernel = None
        loop = _forward_everything(model, pool) + _own_cache_steps(model)
        lean.layers_kernel = kernel
        assert len(fused) == len(loop) == 32
        assert all(torch.equal(a, b) for a, b in zip(fused, loop))
        return fused, calls

    with torch.inference_mode():
        fused, calls = both()
        # the prompts of 9 and 16 rows, steps of 3 x 1 and 3 x 3 rows pooled; alone: a prompt of 12, trees of 1, 4, 2
        assert calls == [9, 16, 3, 9, 12, 1, 4, 2]
        first = model.hf.model.layers[0]
        first.self_attn.k_proj.weight.mul_(1.5)  # changed in place: the call reads the new panels
        changed, calls = both()
        assert not torch.equal(changed[0], fused[0]) and len(calls) == 8
        first.self_attn.q_proj.weight.copy_(gguf_weight("q8_0", 256, 256, seed=5))  # q, k of two block formats
        first.self_attn.k_proj.weight.copy_(gguf_weight("q4_1", 128, 256, seed=6))
        _, calls = both()
        assert calls == []


def test_the_native_rms_norm_is_a_rows_own_and_torchs_within_float_rounding():
    """Where the decoder layer kernel builds, the lean forward's float32 RMS norm is its own (a fixed order of sums,
    the same on the 256- and 512-bit builds): each row's result does not depend on the rows beside it, it is within
    float rounding of torch's ``F.rms_norm``, and the loop and the one-call layers use it alike."""
    from verispec.backends import native

    kernel = native.layer()
    if kernel is None:
        pytest.skip("the native decoder layer kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 576, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    w = torch.randn(576, generator=g)
    out = kernel.rms_norm(x, w, 1e-5)
    want = torch.nn.functional.rms_norm(x.double(), (576,), w.double(), 1e-5)
    assert torch.allclose(out.double(), want, rtol=2e-6, atol=1e-6)
    assert all(torch.equal(kernel.rms_norm(x[i:i + 1].clone(), w, 1e-5), out[i:i + 1]) for i in range(37))
    assert not torch.equal(out, kernel.rms_norm(x, w, 1e-3))  # eps counts
    model, _ = pair("llama", head_dim=64)
    assert model._lean.norm_kernel is kernel
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernel.rms_norm(torch.ones(2, 12), torch.ones(12), 1e-5)


def test_the_native_silu_times_up_is_a_rows_own_and_torchs_within_float_rounding():
    """Where the decoder layer kernel builds, the lean forward's float32 SiLU(gate) * up is its own (a fixed
    arithmetic, the same on the 256- and 512-bit builds): within float rounding of the exact value over the range
    activations take, each row's result its own, views of one output read as they are, and a width that is not a
    multiple of eight computed as the rest."""
    from verispec.backends import native

    kernel = native.layer()
    if kernel is None:
        pytest.skip("the native decoder layer kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    g = torch.Generator().manual_seed(5)
    gate = torch.randn(37, 1536, generator=g) * torch.logspace(-3, 1.5, 37)[:, None]
    up = torch.randn(37, 1536, generator=g)
    out = kernel.silu_mul(gate, up)
    exact = torch.nn.functional.silu(gate.double()) * up.double()
    assert ((out.double() - exact).abs() <= 4e-7 * exact.abs() + 1e-30).all()
    sweep = torch.linspace(-80, 80, 100_001)[None]
    exact = torch.nn.functional.silu(sweep.double())
    assert ((kernel.silu_mul(sweep, torch.ones_like(sweep)).double() - exact).abs() <= 4e-7 * exact.abs()).all()
    assert all(torch.equal(kernel.silu_mul(gate[i:i + 1].clone(), up[i:i + 1].clone()), out[i:i + 1])
               for i in range(37))
    both = torch.cat([gate, up], dim=1)  # gate and up as views of one output, as the linear kernel gives them
    assert torch.equal(kernel.silu_mul(*both.split(1536, dim=1)), out)
    odd = kernel.silu_mul(gate[:, :13].contiguous(), up[:, :13].contiguous())
    assert torch.equal(odd[:, :8], out[:, :8]) and torch.equal(odd, kernel.silu_mul(gate[:, :13], up[:, :13]))
    assert torch.allclose(odd[:, 8:].double(), torch.nn.functional.silu(gate[:, 8:13].double()) * up[:, 8:13].double(),
                          rtol=4e-7, atol=1e-30)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernel.silu_mul(gate.t(), up.t())


def test_a_prompts_rows_run_apart_on_the_plans_kernel_for_more_rows_and_fill_the_same_cache_whole_or_chunked(
        monkeypatch):
    """Where a float32 plan runs more than 16 rows on the stock kernel (``kernels.prompt_plan``, where that is measured
    faster), the lean forward multiplies a prompt's rows in blocks cut at multiples of ``PROMPT_BLOCK`` of its
    positions, each block on its own, and every other row (a decoding step, a draft tree) in the native kernel: so a
    prompt's rows meet the same products whether it is prefilled whole or in aligned chunks beside decoding
    sequences, and the decoding sequences beside the chunks get the logits they get alone, bit for bit."""
    from verispec.backends import kernels
    from verispec.backends.lean import LeanLlama

    monkeypatch.setattr(LeanLlama, "PROMPT_BLOCK", 32)
    model = tiny_target("lean-native")  # skipped where the native float32 kernels cannot be built
    use_fast_linear(model.hf, kernels.default_plan()[:-1] + (0,))  # prompts on the stock kernel
    many = []  # row counts the stock kernel was asked for
    stock = kernels.rows_forward

    def spy(x, module, plan):
        if kernels.plan_entry(plan, x.shape[0]) == 0:
            many.append(x.shape[0])
        return stock(x, module, plan)

    monkeypatch.setattr(kernels, "rows_forward", spy)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 90, (101,), generator=g).tolist()
    others = [torch.randint(3, 90, (20,), generator=g).tolist() for _ in range(2)]
    tree = Tree.complete(2, 2)  # 7 rows, not consecutive positions: the native kernel's

    def step(state, tokens, t=Tree.root_only()):
        out = model.forward_batch([state], [torch.tensor(tokens)], [state.committed + torch.tensor(t.depths)],
                                  [t.ancestors_mask()])[0]
        model.commit(state, [0])
        return out.logits

    with torch.inference_mode():
        whole = model.new_state()
        model.prefill_output(whole, prompt[:-1])
        assert many == [32] * 3 * 7 * 4  # rows 0-31, 32-63, 64-95 on their own, in 7 layers of 4; rows 96-99 native
        expect = step(whole, prompt[-1:])
        alone = [model.new_state() for _ in others]
        for s, o in zip(alone, others):
            model.prefill_output(s, o[:-1])
        beside = [model.new_state() for _ in others]
        for s, o in zip(beside, others):
            model.prefill_output(s, o[:-1])
        chunked, p, many[:] = model.new_state(), 0, []
        while p < len(prompt) - 1:
            chunk = prompt[p:min(p + 32, len(prompt) - 1)]
            n = len(chunk)
            toks = [torch.tensor(others[0][-1:]), torch.randint(3, 90, (tree.size,), generator=g), torch.tensor(chunk)]
            pos = [beside[0].committed + torch.zeros(1, dtype=torch.long), beside[1].committed +
                   torch.tensor(tree.depths), p + torch.arange(n)]
            got = model.forward_batch([*beside, chunked], toks, pos, [torch.ones(1, 1, dtype=torch.bool),
                                                                      tree.ancestors_mask(),
                                                                      torch.ones(n, n, dtype=torch.bool).tril()],
                                      logits_from=[0, 0, n - 1])
            own = [model.forward_batch([s], [t], [s.committed + (pos[i] - pos[i][0])], [m])[0]
                   for i, (s, t, m) in enumerate(zip(alone, toks, (torch.ones(1, 1, dtype=torch.bool),
                                                                   tree.ancestors_mask())))]
            for a, b in zip(got, own):
                assert torch.equal(a.logits, b.logits)  # a step's rows beside a prompt chunk: as alone
            for s in (*beside, *alone):
                model.commit(s, [0])
            model.commit(chunked, list(range(n)))
            p += n
        assert many == [32] * 3 * 7 * 4  # the same blocks; the last chunk's 4 rows are the native kernel's
        # the same linear products; attention over a chunk is not bit for bit that over the whole prompt (as before)
        assert torch.allclose(step(chunked, prompt[-1:]), expect, atol=1e-5)
