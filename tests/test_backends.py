import pytest
import torch
from conftest import VOCAB, gguf_weight, tiny_model

from verispec.tree import Tree

PROMPT = [5, 17, 33, 8, 9, 41]
SHAPES = [Tree.chain(4), Tree.complete(2, 3), Tree.from_branching([3, 1, 1]), Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0, 0)])]


def fresh_logits(model, seq):
    with torch.no_grad():
        return model.hf(input_ids=torch.tensor([seq])).logits[0, -1].float()


def random_tokens(tree, root, seed):
    toks = torch.randint(3, VOCAB, (tree.size,), generator=torch.Generator().manual_seed(seed))
    toks[0] = root
    return toks


def node_seq(tree, toks, node):
    path = []
    while node > 0:
        path.append(int(toks[node]))
        node = tree.parents[node]
    return path[::-1]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda t: t.describe())
def test_tree_forward_equals_path_by_path_forward(tiny, shape):
    state = tiny.new_state()
    tiny.prefill(state, PROMPT[:-1])
    toks = random_tokens(shape, PROMPT[-1], 1)
    out = tiny.forward(state, toks, state.committed + torch.tensor(shape.depths), shape.ancestors_mask())
    for node in range(shape.size):
        ref = fresh_logits(tiny, PROMPT + node_seq(shape, toks, node))
        assert torch.allclose(out.logits[node], ref, atol=1e-5, rtol=1e-5), node


@pytest.mark.parametrize("shape", SHAPES, ids=lambda t: t.describe())
def test_commit_path_then_next_step_equals_fresh_forward(tiny, shape):
    state = tiny.new_state()
    tiny.prefill(state, PROMPT[:-1])
    seq = list(PROMPT)
    for step, path in enumerate([shape.paths[-1], shape.paths[0][:1], ()]):
        toks = random_tokens(shape, seq[-1], 10 + step)
        tiny.forward(state, toks, state.committed + torch.tensor(shape.depths), shape.ancestors_mask())
        tiny.commit(state, [0, *path])
        seq += [int(toks[n]) for n in path] + [60 + step]  # accepted path, then a recovered token
        assert state.committed == len(seq) - 1
        # next step: a single root forward must see exactly the committed sequence
        one = tiny.forward(state, torch.tensor([seq[-1]]), torch.tensor([state.committed]), torch.ones(1, 1, dtype=torch.bool))
        assert torch.allclose(one.logits[0], fresh_logits(tiny, seq), atol=1e-5, rtol=1e-5)
        tiny.commit(state, [])  # drop it again: the next loop iteration feeds the root itself


def test_layer_subset_shares_weights_and_matches_a_truncated_model():
    target = tiny_model("llama", layers=4)
    sub = target.layer_subset([0, 1])
    assert sub.num_layers == 2 and target.num_layers == 4
    assert len(target.hf.base_model.layers) == 4  # the target is untouched
    assert sub.hf.base_model.layers[1].mlp.up_proj.weight is target.hf.base_model.layers[1].mlp.up_proj.weight
    # reference: a real 2-layer model with the same weights
    ref = tiny_model("llama", layers=2)
    ref.hf.load_state_dict({k: v for k, v in target.hf.state_dict().items() if ".layers.2." not in k and ".layers.3." not in k})
    state = sub.new_state()
    logits = sub.prefill(state, PROMPT)
    assert torch.allclose(logits, fresh_logits(ref, PROMPT), atol=1e-5)


def test_layer_subset_non_contiguous_runs_with_a_cache():
    target = tiny_model("qwen2", layers=4)
    sub = target.layer_subset([0, 2])
    state = sub.new_state()
    a = sub.prefill(state, PROMPT[:-1])
    b = sub.prefill(state, PROMPT[-1:])
    whole = sub.prefill(sub.new_state(), PROMPT)
    assert a is not None and torch.allclose(b, whole, atol=1e-5)


def test_layer_subset_rejects_bad_indices():
    from verispec.errors import VerispecError

    target = tiny_model("llama", layers=4)
    for bad in ([], [4], [2, 1], [1, 1]):
        with pytest.raises(VerispecError):
            target.layer_subset(bad)


def test_nan_logits_raise_a_clear_error():
    """The loop checks the target's logits once per step (when they become probabilities) and stops with a clear
    error instead of sampling from NaN."""
    from verispec import NoDrafter, generate, get_verifier
    from verispec.errors import VerispecError

    m = tiny_model("llama")
    with torch.no_grad():
        m.hf.get_output_embeddings().weight[7, 0] = float("nan")
    with pytest.raises(VerispecError, match="NaN"):
        generate(m, NoDrafter(), get_verifier("chain"), PROMPT, tree=Tree.root_only(), max_new_tokens=3)


def test_sliding_window_layers_match_hugging_face_beyond_the_window():
    """Gemma-3-style mixed layers with a window of 4: our per-layer masks must reproduce HF's own."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from verispec.backends import CausalLM

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = CausalLM(Gemma3ForCausalLM(cfg).float().eval(), None, "tiny-gemma3")
    prompt = PROMPT + [12, 13, 14]  # longer than the window
    state = model.new_state()
    model.prefill(state, prompt[:-1])
    shape = Tree.complete(2, 3)
    toks = random_tokens(shape, prompt[-1], 1)
    out = model.forward(state, toks, state.committed + torch.tensor(shape.depths), shape.ancestors_mask())
    for node in range(shape.size):
        with torch.no_grad():
            ref = model.hf(input_ids=torch.tensor([prompt + node_seq(shape, toks, node)]), use_cache=False).logits[0, -1]
        assert torch.allclose(out.logits[node], ref, atol=1e-5), node


def test_cropping_a_prefix_equals_reselecting_it(tiny):
    """Committing a prefix of the pending entries crops the cache; re-selecting the same entries gives the same
    next logits."""
    from verispec.backends.hf import _keep_after

    shape = Tree.chain(4)
    outs = []
    for crop in (True, False):
        state = tiny.new_state()
        tiny.prefill(state, PROMPT[:-1])
        toks = random_tokens(shape, PROMPT[-1], 3)
        tiny.forward(state, toks, state.committed + torch.tensor(shape.depths), shape.ancestors_mask())
        if crop:
            tiny.commit(state, [0, 1, 2])
        else:
            c = state.committed
            _keep_after(state, 0, torch.arange(c + 3))  # every entry copied to where it is
            state.committed, state.pending_positions = c + 3, []
        one = tiny.forward(state, torch.tensor([9]), torch.tensor([state.committed]), torch.ones(1, 1, dtype=torch.bool))
        outs.append(one.logits[0])
    seq = PROMPT + [int(t) for t in toks[1:3]] + [9]
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.allclose(outs[0], fresh_logits(tiny, seq), atol=1e-5)


def test_a_parsed_gguf_tokenizer_is_kept_for_the_next_load(tmp_path, monkeypatch):
    """Parsing a GGUF tokenizer takes about a minute for Gemma 3's 262k tokens; the llama backend keeps it."""
    from verispec.backends import loading

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("VERISPEC_NO_CACHE", raising=False)
    first = loading.tokenizer_for("smollm2-135m")  # no converted model in this cache: parsed from the GGUF file
    kept = list((tmp_path / "converted").glob("*"))
    assert len(kept) == 1 and (kept[0] / "done").exists()
    calls = []
    monkeypatch.setattr(loading, "_save_tokenizer", lambda *a: calls.append(a))
    second = loading.tokenizer_for("smollm2-135m")
    assert not calls  # read back, not parsed and saved again
    text = "Speculative decoding, verified: 12 + 30 = 42."
    assert second.encode(text) == first.encode(text) and second.chat_template == first.chat_template


def test_a_gguf_files_copy_is_keyed_by_its_content_and_the_old_keyed_copies_are_pruned(tmp_path, monkeypatch):
    """A reinstalled model package (the same file at a new path, written later) finds the de-quantised copy made
    before; a changed file gets another; saving a copy removes the copies keyed by path and time (one per
    reinstall: 15 GB of them on one machine), and nothing else."""
    import os

    from verispec.backends import loading

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VERISPEC_NO_CACHE", raising=False)
    data = os.urandom(3 * loading.SAMPLE + 7)
    for venv in ("a", "b"):
        (tmp_path / venv).mkdir()
        (tmp_path / venv / "m.Q4.gguf").write_bytes(data)
    os.utime(tmp_path / "b" / "m.Q4.gguf", (1, 1))
    first = loading._converted_dir(str(tmp_path / "a"), "m.Q4.gguf", "float32")
    assert loading._converted_dir(str(tmp_path / "b"), "m.Q4.gguf", "float32") == first
    assert loading._converted_dir(str(tmp_path / "a"), "m.Q4.gguf", "bfloat16") != first
    changed = bytearray(data)
    changed[-1] ^= 1
    (tmp_path / "b" / "m.Q4.gguf").write_bytes(bytes(changed))
    assert loading._converted_dir(str(tmp_path / "b"), "m.Q4.gguf", "float32") != first

    folder = first.parent
    old = [folder / "m.Q4-0123456789abcdef", folder / "m.Q4-fedcba9876543210"]  # the old keys: done files empty
    (old[0] / "done").parent.mkdir(parents=True)
    (old[0] / "done").touch()
    old[1].mkdir()
    (old[1] / "done").write_text("ok\n")  # an old tokenizer copy
    kept = [folder / "m.Q4-00000000000000aa",  # keyed by content: another dtype's copy
            folder / "m.Q4-00000000000000bb",  # no done file: being written
            folder / "m.Q4-v2-0123456789abcdef",  # another model's
            folder / "m.Q4-00000000000000cc.tmp42"]  # a copy being written
    for k in kept:
        k.mkdir()
    (kept[0] / "done").write_text(loading.DONE)
    (kept[2] / "done").touch()
    first.mkdir()
    (first / "done").write_text(loading.DONE)
    assert sorted(loading.prune_stale_copies(first)) == old
    assert all(k.is_dir() for k in kept + [first]) and not any(o.exists() for o in old)


def test_the_kernel_plan_computes_what_a_linear_layer_does():
    """``kernels``' plan (the native kernel where it builds, else ``W @ x^T`` with padding) equals ``x @ W^T + b``
    for every planned row count and beyond; so does every plan that does not use the native kernel."""
    from verispec.backends.kernels import DEFAULT_PLAN, MAX_ROWS, default_plan, use_fast_linear

    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    with torch.no_grad():
        layer.bias.normal_()
        for plan in {default_plan(), DEFAULT_PLAN}:
            undo = use_fast_linear(layer, plan)
            for rows in [*range(1, MAX_ROWS + 3), 40]:
                x = torch.randn(rows, 24)
                y = layer(x)
                assert y.is_contiguous() and torch.allclose(y, x @ layer.weight.T + layer.bias, atol=1e-5), rows
            assert layer._verispec_plan == plan
            undo()
            assert "forward" not in layer.__dict__


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_weight_of_gguf_blocks_runs_from_its_blocks_with_the_float32_panels_results_bit_for_bit(kind, monkeypatch):
    """The default model's layers are de-quantised Q4_1 blocks and its output head Q8_0: the native kernel packs
    such a weight back into its blocks (``pack_exact``, recomputing each weight with the de-quantisation's roundings),
    and every row count gives the float32 panels' results bit for bit; a weight that is not such blocks everywhere
    (one weight moved by one ulp, or random) is packed in float32."""
    from verispec.backends import kernels, native

    kernel = native.linear()
    if kernel is None:
        pytest.skip("the native linear kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    weight = gguf_weight(kind, 40, 96, seed=1)  # 40 outputs: a last panel of 8 columns
    bias = torch.randn(40)
    exact, plain = kernel.pack_exact(weight), kernel.pack(weight)
    assert exact.dtype == torch.uint8 and exact.numel() < plain.numel() * 4 / 3  # at most a third of the bytes
    for rows in [*range(1, 14), 40, 48, 49, 70]:  # every way linear.cpp runs rows: one pass, by blocks, by panels
        x = torch.randn(rows, 96)
        assert torch.equal(kernel.linear(x, exact, 40, bias), kernel.linear(x, plain, 40, bias)), rows
    nudged = weight.clone()
    nudged[17, 50] = torch.nextafter(nudged[17, 50], torch.tensor(1.0))
    assert kernel.pack_exact(nudged).numel() == 0 and kernel.pack_exact(torch.randn(40, 96)).numel() == 0
    layer = torch.nn.Linear(96, 40)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
        kernels.use_fast_linear(layer)
        x = torch.randn(3, 96)
        y = layer(x)
        assert layer._verispec_packed.dtype == torch.uint8
        monkeypatch.setenv(kernels.FLOAT_PANELS, "1")
        layer.weight.add_(0)  # a new version of the weight: packed again, now in float32
        assert torch.equal(layer(x), y) and layer._verispec_packed.dtype == torch.float32


def test_the_512_bit_build_of_the_linear_kernel_gives_the_256_bit_builds_results_bit_for_bit():
    """On an AVX-512 CPU ``native.linear()`` is linear.cpp built with its 512-bit paths (16 columns to a register, up
    to 16 rows against GGUF blocks and 8 against float panels in one pass); every way it runs rows gives what the
    256-bit build (every other x86 CPU's) gives, bit for bit: GGUF Q4_1 and Q8_0 panels, float32 and float16 panels,
    a last panel of 8 columns, with and without a bias."""
    from verispec.backends import native

    wide, narrow = native.linear_avx512(), native.linear_avx2()
    if wide is None or narrow is None:
        pytest.skip("needs a CPU with AVX-512 (F, BW, VL, DQ), AVX2, FMA and F16C, a C++ compiler and ninja")
    assert native.linear() is wide and native.linear_name() == native.LINEAR512_NAME
    torch.manual_seed(3)
    weights = {kind: gguf_weight(kind, 40, 96, seed=4) for kind in ("q4_1", "q8_0")}
    panels = {kind: narrow.pack_exact(w) for kind, w in weights.items()}
    assert all(p.dtype == torch.uint8 and p.numel() for p in panels.values())
    other = torch.randn(40, 96)
    panels.update(float32=narrow.pack(other), float16=narrow.pack_half(other))
    bias = torch.randn(40)
    for kind, packed in panels.items():
        for rows in [*range(1, 21), 40, 48, 49, 70]:
            x = torch.randn(rows, 96)
            for b in (bias, None):
                assert torch.equal(wide.linear(x, packed, 40, b), narrow.linear(x, packed, 40, b)), (kind, rows)


def test_a_layer_allowed_float16_reads_gguf_blocks_unrounded_and_anything_else_in_float16():
    """A draft's layer may be rounded to float16 (``_verispec_half``, the head's restricted output layer): where its
    weight is de-quantised GGUF blocks it reads the blocks instead, fewer bytes and the float32 results bit for bit;
    any other weight reads float16 panels (its float16 rounding)."""
    from verispec.backends import native
    from verispec.eagle.head import _SubsetHead

    kernel = native.linear()
    if kernel is None:
        pytest.skip("the native linear kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    blocks, other = gguf_weight("q8_0", 48, 96, seed=2), torch.randn(48, 96)
    vocab = torch.tensor([3, 0, 47, 20, 9])
    x = torch.randn(3, 96)
    for weight in (blocks, other):
        full = torch.nn.Linear(96, 48, bias=False)
        full.weight.data.copy_(weight)
        layer = _SubsetHead(full, vocab)  # a float32 target's: float32, on the native kernel
        assert layer.weight.dtype == torch.float32
        with torch.inference_mode():
            y = layer(x)
            if weight is blocks:
                assert layer._verispec_packed.dtype == torch.uint8
                assert torch.equal(y, kernel.linear(x, kernel.pack(weight[vocab]), 5, None))
            else:
                assert layer._verispec_packed.dtype == torch.float16
                assert torch.equal(y, kernel.linear(x, kernel.pack(weight[vocab].half().float()), 5, None))


def test_a_plan_is_checked_and_its_native_entries_fall_back_where_the_kernel_does_not_build(monkeypatch):
    from verispec.backends import kernels

    layer = torch.nn.Linear(8, 16)
    with pytest.raises(ValueError, match="a plan gives"):
        kernels.use_fast_linear(layer, (0, 2) * 8 + (2,))  # one entry short
    with pytest.raises(ValueError, match="a plan gives"):
        kernels.use_fast_linear(layer, kernels.DEFAULT_PLAN[:-1] + (4,))  # more rows: NATIVE or 0 only
    monkeypatch.setattr(kernels.native, "linear", lambda: None)
    assert kernels.default_plan() == kernels.DEFAULT_PLAN
    undo = kernels.use_fast_linear(layer, (0,) + (kernels.NATIVE,) * (kernels.MAX_ROWS + 1))
    assert set(layer._verispec_plan) == {0}
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, atol=1e-6)
    undo()


def test_calibration_returns_a_plan_the_model_runs_with_and_the_same_logits():
    """``kernels.calibrate`` times every candidate (the native kernel among them where it builds) for 1..16 rows and
    for a prompt chunk, and its plan is one ``use_fast_linear`` accepts; the model's logits stay what they were."""
    from verispec.backends import kernels

    model = tiny_model("llama")
    state = model.new_state()
    before = model.prefill(state, list(range(1, 20)))
    out = kernels.calibrate(model, repeats=1, save=False)
    plan = tuple(out["plan"])
    assert len(plan) == kernels.MAX_ROWS + 2 and set(out["ms"]) == {*range(1, kernels.MAX_ROWS + 1),
                                                                     kernels.CALIBRATE_MORE}
    assert (kernels.NATIVE in out["ms"][1]) == (kernels.native.linear() is not None)
    with kernels.fast_linear(model.hf, plan):
        after = model.prefill(model.new_state(), list(range(1, 20)))
    assert torch.allclose(before, after, atol=1e-4)


def test_the_native_linear_kernel_is_a_linear_layer_whose_rows_never_depend_on_their_batch():
    """``native.linear``: ``x @ W^T + b`` for any rows, widths that are not a multiple of its 16-column panels and odd
    inner sizes; each row's result bit for bit the same alone and in any batch; a weight changed in place is packed
    again."""
    from verispec.backends import native
    from verispec.backends.kernels import native_rows

    if native.linear() is None:
        pytest.skip("the native linear kernel cannot be built here (a C++ compiler, ninja, AVX2 and FMA)")
    torch.manual_seed(0)
    with torch.no_grad():
        for n_in, n_out, bias in ((33, 50, True), (64, 48, False), (576, 1536, False)):
            layer = torch.nn.Linear(n_in, n_out, bias=bias)
            x = torch.randn(131, n_in)
            y = native_rows(x, layer)
            ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
            assert y.shape == ref.shape and torch.allclose(y, ref, atol=1e-4, rtol=1e-4), (n_in, n_out)
            for rows in (1, 2, 5, 6, 7, 13, 17):
                for start in (0, 3, 131 - rows):
                    assert torch.equal(native_rows(x[start:start + rows], layer), y[start:start + rows]), rows
        layer.weight.mul_(2)
        assert torch.allclose(native_rows(x, layer), 2 * y, atol=1e-4, rtol=1e-4)


def test_q8_0_values_are_blocks_the_native_kernel_packs_back_within_half_a_step():
    """``q8_0_values``: every block of 32 weights of a row becomes integers times one float16 scale, each weight within
    half that block's step of where it was; rounding again changes nothing; ``pack_exact`` finds the blocks (Q8_0's
    1.125 bytes a weight) and computes with them what float32 panels of the rounded weight compute, bit for bit. A
    weight whose rows do not come in blocks of 32 is refused."""
    from verispec.backends import native
    from verispec.backends.kernels import q8_0_values

    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.rand(40, 1)
    w[3, :32] = 0.0  # a block of zeros: scale 0
    v = q8_0_values(w)
    blocks, got = w.reshape(-1, 32), v.reshape(-1, 32)
    d = (blocks.abs().amax(1, keepdim=True) / 127).half().float()
    q = got / torch.where(d > 0, d, torch.ones_like(d))
    assert torch.equal(q, q.round()) and q.abs().max() <= 128 and torch.equal(got, q * d)
    assert ((got - blocks).abs() <= d * 0.5 + d * 1e-3).all() and torch.equal(q8_0_values(v), v)
    assert not torch.signbit(v[3, :32]).any()  # +0.0: what a block gives, not -0.0
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_values(torch.randn(4, 40))
    kernel = native.linear()
    if kernel is None:
        pytest.skip("the native linear kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    packed = kernel.pack_exact(v)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 * 3 * 576  # 3 panels of 16 columns, 3 blocks, Q8_0
    for rows in (1, 5, 9, 50):
        x = torch.randn(rows, 96)
        assert torch.equal(kernel.linear(x, packed, 40, None), kernel.linear(x, kernel.pack(v), 40, None)), rows


def test_float16_panels_give_the_float32_kernels_results_for_float16_weights_and_round_others_once():
    """``use_fast_linear(half=True)`` (a draft head's layers): the native kernel reads float16 panels; for weights
    that are float16 values the results are bit for bit those of float32 panels, any other weight is rounded to
    float16 once; undo takes the mark away."""
    from verispec.backends import native
    from verispec.backends.kernels import native_rows, use_fast_linear

    if native.linear() is None:
        pytest.skip("the native linear kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    torch.manual_seed(0)
    with torch.no_grad():
        layer = torch.nn.Linear(576, 100)
        layer.weight.copy_(layer.weight.half().float())
        x = torch.randn(9, 576)
        full = native_rows(x, layer)
        undo = use_fast_linear(torch.nn.Sequential(layer), half=True)
        assert torch.equal(layer(x), full) and layer._verispec_packed.dtype == torch.float16  # packed again
        layer.weight.add_(1e-5)  # no longer float16 values: rounded once when packed again
        y = layer(x)
        panels = layer._verispec_packed
        assert torch.equal(panels.transpose(1, 2).reshape(-1, 576)[:100], layer.weight.half())
        assert torch.allclose(y, torch.nn.functional.linear(x, layer.weight.half().float(), layer.bias), atol=1e-4)
        undo()
        assert "_verispec_half" not in layer.__dict__


def test_bfloat16_layers_run_on_prepacked_weights_bitwise_as_a_linear_layer_and_whatever_the_row_count():
    """A bfloat16 layer under ``use_fast_linear``: oneDNN on a prepacked copy of the weight gives ``F.linear``'s
    products bit for bit, each row the same whatever rows it comes with, and a changed weight is packed again."""
    from verispec.backends.kernels import packing_available, use_fast_linear

    if not packing_available():
        pytest.skip("this torch or CPU has no oneDNN bfloat16 linear")
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 72).bfloat16()
    x = torch.randn(33, 48).bfloat16()
    with torch.no_grad():
        ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
        undo = use_fast_linear(layer)
        assert torch.equal(layer(x), ref) and "_verispec_packed" in layer.__dict__
        for rows in (1, 2, 3, 5, 8, 16, 17):
            assert torch.equal(layer(x[:rows]), ref[:rows]), rows
        assert torch.equal(layer(x.view(3, 11, 48)), ref.view(3, 11, 72))
        layer.weight.mul_(2)  # in place: the packed copy is stale and must be made again
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        undo()
    assert "forward" not in layer.__dict__ and "_verispec_packed" not in layer.__dict__


def test_bfloat16_rows_run_at_few_row_counts_with_the_same_results():
    """oneDNN keeps a compiled kernel for every row count it meets: ``packed_rows`` pads the rows to one of a few
    counts (copies of the first row), so a server meeting every prompt length asks for a bounded set, which
    ``warm_packed`` compiles up front; each row's result is the one it has alone."""
    from verispec.backends import kernels

    widths = kernels.packed_widths(1024)
    assert widths[:7] == [2, 3, 4, 5, 6, 7, 8] and len(widths) <= 30
    assert all(kernels.packed_width(n) >= n and kernels.packed_width(n) in widths for n in range(1, 1025))
    if not kernels.packing_available():
        pytest.skip("this torch or CPU has no oneDNN bfloat16 linear")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 40).bfloat16()
    x = torch.randn(70, 64).bfloat16()
    with torch.no_grad():
        undo = kernels.use_fast_linear(layer)
        whole = layer(x)  # 70 rows run as 96
        for rows in (0, 1, 9, 13, 70):
            assert torch.equal(layer(x[:rows]), whole[:rows]), rows
        assert kernels.warm_packed(100) >= len(kernels.packed_widths(100))  # this layer, and any other alive
        undo()


def test_auto_dtype_is_bfloat16_only_where_the_cpu_has_bfloat16_arithmetic(monkeypatch):
    from verispec.backends import loading
    from verispec.errors import VerispecError

    monkeypatch.setattr(loading, "native_bfloat16", lambda: True)
    assert loading.resolve_dtype("auto") == "bfloat16"
    monkeypatch.setattr(loading, "native_bfloat16", lambda: False)
    assert loading.resolve_dtype("auto") == "float32" and loading.resolve_dtype("bfloat16") == "bfloat16"
    with pytest.raises(VerispecError, match="unknown dtype 'int3'"):
        loading.resolve_dtype("int3")
    # an explicit bfloat16 there runs, with one line saying float32 is faster
    cpu = torch.device("cpu")
    assert "no bfloat16 arithmetic" in loading.slow_dtype_notice("bfloat16", cpu)
    assert loading.slow_dtype_notice("float32", cpu) is None
    assert loading.slow_dtype_notice("bfloat16", torch.device("cuda")) is None
    monkeypatch.setattr(loading, "native_bfloat16", lambda: True)
    assert loading.slow_dtype_notice("bfloat16", cpu) is None


@pytest.mark.slow
def test_a_target_loaded_from_its_gguf_file_makes_an_int8_draft(monkeypatch):
    """Straight from the GGUF file (no de-quantised copy cached: a machine's first run), the target carries no
    quantizer marks, so its int8 draft can be made (``.float()`` refused it before)."""
    from verispec import load
    from verispec.backends.hf import quantized_copy

    monkeypatch.setenv("VERISPEC_NO_CACHE", "1")
    target = load()
    assert not getattr(target.hf, "is_quantized", False) and getattr(target.hf, "hf_quantizer", None) is None
    draft = quantized_copy(target)
    assert draft.name.endswith("[int8]") and draft.vocab_size == target.vocab_size


def test_keeping_cache_entries_keeps_those_asked_for_in_order():
    """``KVBuffer.keep_after``: a kept prefix, then the entries asked for in order, whatever they are (a verdict's
    path off the first branch, entries moving down past others, a reordering from the start, nothing moved)."""
    from verispec.backends.kv import KVBuffer

    g = torch.Generator().manual_seed(0)
    for first, moved in ((4, [6, 8]), (4, []), (0, [2, 0, 1]), (2, [5, 2]), (0, [4])):
        k, v = torch.randn(2, 3, 9, 4, generator=g)
        buf = KVBuffer()
        buf.append(k, v)
        buf.keep_after(first, torch.tensor(moved, dtype=torch.long))
        idx = list(range(first)) + moved
        assert torch.equal(buf.keys, k[:, idx]) and torch.equal(buf.values, v[:, idx]), (first, moved)
