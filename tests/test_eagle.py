"""The EAGLE-style draft head: it trains (loss falls, at every depth), saves and loads, drafting with it is exact, and
the loop feeds it exactly what training does (in-loop acceptance equals teacher-forced agreement)."""

import pytest
import torch
from conftest import VOCAB, ByteTokenizer, tiny_model

from verispec import Tree, generate, get_verifier
from verispec.bench.agreement import in_loop_check
from verispec.drafters import NoDrafter
from verispec.drafters.eagle import EagleDrafter
from verispec.eagle import EagleHead, TrainConfig, evaluate, features, head_loss, train


def accounted(out, target, budget: int) -> None:
    """Every step's record accounts for the text: a step emits its accepted length (the last one may be cut by EOS
    or the budget), the steps together emit the text, and the run stops exactly at the budget or at EOS."""
    assert [len(s.emitted) for s in out.steps[:-1]] == [s.accepted_length for s in out.steps[:-1]]
    assert 1 <= len(out.steps[-1].emitted) <= out.steps[-1].accepted_length
    assert [t for s in out.steps for t in s.emitted] == out.token_ids
    stopped_at_eos = out.token_ids[-1] in target.eos_token_ids
    assert (out.num_tokens == budget or stopped_at_eos) and out.num_tokens <= budget
    assert out.stop_reason == ("eos" if stopped_at_eos else "max_new_tokens")

def corpus(target, n=6, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):  # the target's own greedy continuations of random starts
        start = torch.randint(3, target.vocab_size, (3,), generator=g).tolist()
        ids = target.hf.generate(torch.tensor([start]), max_new_tokens=length, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        out.append(ids[0].tolist())
    return out


def train_steps(head, data, steps, lr=3e-3, depths=1):
    """Full-batch AdamW steps on ``data`` (training depths 1..``depths``); returns the evaluation afterwards."""
    opt = torch.optim.AdamW(head.trainable(), lr=lr)
    head.train()
    for _ in range(steps):
        opt.zero_grad()
        for d in data:
            (head_loss(head, d, depths)[0] / len(data)).backward()
        opt.step()
    return evaluate(head, data, 2)


def test_head_shares_the_targets_tables_and_trains():
    target = tiny_model("llama")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    head = EagleHead(target)
    names = {n for n, _ in head.named_parameters()}
    assert not any("lm_head" in n for n in names)
    assert head.lm.hf.get_output_embeddings() is target.hf.get_output_embeddings()
    data = [features(target, s, top_k=8) for s in corpus(target)]
    before = evaluate(head, data, 2)
    after = train_steps(head, data, 40)
    assert after["ce_1"] < 0.7 * before["ce_1"] and after["feat"] < before["feat"]
    assert after["top1_1"] > before["top1_1"]


def test_training_on_its_own_outputs_lowers_the_depth_2_loss():
    """The training-time test: a head trained at depths 1-2 (reading its own depth-1 output at depth 2, as the loop
    does) ends with a lower depth-2 loss than the same head trained at depth 1 only, on the same data and steps."""
    target = tiny_model("llama")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    data = [features(target, s, top_k=8) for s in corpus(target, n=8)]
    results = {}
    for depths in (1, 2):
        torch.manual_seed(0)
        head = EagleHead(target)
        results[depths] = train_steps(head, data, 40, depths=depths)
    assert results[2]["ce_2"] < results[1]["ce_2"] - 0.05, results
    assert results[2]["top1_2"] >= results[1]["top1_2"]


def test_loss_from_response_logits_only_equals_the_dense_loss():
    """Training computes the output layer only where a response token is predicted, at every depth; the loss and its
    gradient equal those of the dense computation (which the counting path still uses)."""
    from verispec.eagle.corpus import Record
    from verispec.eagle.train import new_counts

    target = tiny_model("llama")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    head = EagleHead(target)
    data = features(target, Record(list(range(3, 40)), [[10, 20], [25, 37]], "x", 0), top_k=8)
    grads = []
    for counts in (None, new_counts(3)):
        head.zero_grad()
        loss, stats = head_loss(head, data, 3, counts=counts)
        loss.backward()
        grads.append((float(loss), stats, [p.grad.clone() for p in head.trainable()]))
    (a, sa, ga), (b, sb, gb) = grads
    assert a == pytest.approx(b, rel=1e-6) and sa == pytest.approx(sb, rel=1e-6)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(ga, gb))


@pytest.mark.parametrize("layers", [(-1,), (1, 3, -1)])
def test_a_packed_batch_gives_the_mean_of_its_sequences_losses_gradients_and_counts(layers):
    """A training step's sequences run as one packed forward a depth, each row seeing its own sequence only: the
    loss, its gradient and the statistics are the means of the sequences' own (noise included: drawn sequence by
    sequence from the same generator), and the greedy-chain counts their sums, whatever their lengths and spans."""
    from verispec.eagle.corpus import Record
    from verispec.eagle.train import new_counts

    target = tiny_model("llama")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    torch.manual_seed(2)
    head = EagleHead(target, torch.arange(0, VOCAB, 2), torch.float32, feature_layers=layers)
    records = [Record(list(range(3, 40)), [[10, 20], [25, 37]], "x", 0), Record(list(range(50, 62)), [[4, 12]], "x", 0),
               Record(list(range(20, 29)), [[2, 3]], "x", 0), Record(list(range(7, 33)), [[5, 26]], "x", 0)]
    data = [features(target, r, 8, layers) for r in records]
    head.train()
    runs = []
    for packed in (False, True):
        head.zero_grad()
        torch.manual_seed(5)
        if packed:
            loss, stats = head_loss(head, data, 3, noise=0.05)
            loss.backward()
        else:
            loss, stats = 0.0, {}
            for d in data:
                one, s = head_loss(head, d, 3, noise=0.05)
                (one / len(data)).backward()
                loss += float(one) / len(data)
                stats = {k: stats.get(k, 0.0) + s.get(k, 0.0) / len(data) for k in {*stats, *s}}
        runs.append((float(loss), stats, [p.grad.clone() for p in head.trainable()]))
    (a, sa, ga), (b, sb, gb) = runs
    assert b == pytest.approx(a, rel=1e-5) and sb == pytest.approx(sa, rel=1e-5, abs=1e-6)
    assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(ga, gb))
    alone, together = new_counts(3), new_counts(3)
    with torch.no_grad():
        for d in data:
            head_loss(head, d, 3, counts=alone)
        head_loss(head, data, 3, counts=together)
    assert together == alone and together["n"][2] > 0


@pytest.mark.parametrize("layers,decoder_layers", [((-1,), 1), ((1, 3, -1), 1), ((1, 3, -1), 2)])
def test_in_loop_acceptance_equals_teacher_forced_agreement(layers, decoder_layers):
    """Greedy chains of 3 in the real loop: at every depth, the loop's accept/reject decisions equal the teacher-forced
    agreement computed from one full forward over the same text (only float rounding could split them)."""
    target = tiny_model("llama")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    torch.manual_seed(1)
    head = EagleHead(target, feature_layers=layers, decoder_layers=decoder_layers)
    train_steps(head, [features(target, s, 8, layers) for s in corpus(target, n=8)], 30, depths=3)
    check = in_loop_check(target, head, [[5, 17, 33, 8, 61, 42], [7, 8, 9, 10], [44, 3, 90]], depths=3,
                          max_new_tokens=40)
    assert check["positions"][0] > 60 and check["positions"][1] > 5  # enough decisions at depths 1 and 2
    assert check["mismatches"] == 0, check
    assert torch.equal(torch.tensor(check["in_loop"]).nan_to_num(-1), torch.tensor(check["teacher_forced"]).nan_to_num(-1))


@pytest.mark.parametrize("decoder_layers", [1, 2])
def test_eagle_greedy_equals_autoregressive_and_sampling_runs(tmp_path, decoder_layers):
    target = tiny_model("llama")
    head = EagleHead(target, decoder_layers=decoder_layers)  # untrained: exactness must not depend on its quality
    path = tmp_path / "head.pt"
    head.save(path, {"target": target.name}, half=False)
    loaded = EagleHead.load(path, target)
    assert len(loaded.body.layers) == decoder_layers
    for name, tensor in head.head_state().items():
        assert torch.equal(tensor, loaded.head_state()[name])
    prompt = [5, 17, 33, 8, 61, 2 + 40]
    ar = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), max_new_tokens=30,
                  temperature=0.0)
    for tree, verifier in (("chain:4", "chain"), ("2x3", "greedy"), ("3,2,1", "greedy"), ("chain:1", "chain")):
        out = generate(target, EagleDrafter(loaded), get_verifier(verifier), prompt, tree=Tree.parse(tree),
                       policy="fixed",
                       max_new_tokens=30, temperature=0.0)
        assert out.token_ids == ar.token_ids, tree
    for verifier, tree in (("chain", "chain:5"), ("specinfer", "2x3"), ("reserve", "3,1"), ("swor", "2x2")):
        out = generate(target, EagleDrafter(loaded), get_verifier(verifier), prompt, tree=Tree.parse(tree),
                       policy="fixed",
                       max_new_tokens=20, temperature=0.8, seed=3)
        accounted(out, target, 20)
        assert all(len(s.accepted_ranks) <= s.draft_depth for s in out.steps)
        again = generate(target, EagleDrafter(loaded), get_verifier(verifier), prompt, tree=Tree.parse(tree),
                         policy="fixed",
                         max_new_tokens=20, temperature=0.8, seed=3)
        assert again.token_ids == out.token_ids  # the head's state is reset per sequence: same seed, same text


def test_trained_head_drafts_better_than_untrained(tmp_path):
    target = tiny_model("llama")
    target.tokenizer = ByteTokenizer(target.vocab_size)
    cfg = TrainConfig(rounds=4, gen_batch=3, top_k=8, epochs=30, batch=4, lr=3e-3, checkpoint_every=20,
                      vocab=VOCAB - 16, depths=2)
    path = train(target, tmp_path / "run", cfg, progress=False, log=lambda m: None, max_steps=40)
    assert not path.exists() and (tmp_path / "run" / "checkpoint.pt").exists()
    assert (tmp_path / "run" / "features" / "00000.pt").exists()  # the corpus keeps its features; reused on resume
    path = train(target, tmp_path / "run", cfg, progress=False, log=lambda m: None)  # resumes at step 40
    assert path.exists()
    import json
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "log.jsonl").open()]
    assert steps == list(range(1, len(steps) + 1))
    trained = EagleHead.load(path, target)
    assert len(trained.vocab) == VOCAB - 16
    # the head is the checkpoint best on the held-out rounds: it drafts better than an untrained one there (greedy
    # continuations of the held-out records' openings)
    from verispec.eagle.corpus import read_corpus
    from verispec.eagle.train import _split

    records = read_corpus(tmp_path / "run")
    prompts = [records[i].tokens[:8] for i in _split(records, cfg)[1]]
    lengths = {}
    for name, head in (("untrained", EagleHead(target)), ("trained", trained)):
        outs = [generate(target, EagleDrafter(head), get_verifier("chain"), p, tree=Tree.chain(4), policy="fixed",
                         max_new_tokens=40,
                         temperature=0.0) for p in prompts]
        lengths[name] = sum(o.mean_accepted_length for o in outs) / len(outs)
    assert lengths["trained"] > lengths["untrained"]
    with pytest.raises(Exception, match="another configuration"):
        train(target, tmp_path / "run", TrainConfig(rounds=4, gen_batch=5), progress=False)
    other = TrainConfig(**{**cfg.__dict__, "lr": 1e-3})  # same corpus, other training: refused at the checkpoint
    with pytest.raises(Exception, match="delete it"):
        train(target, tmp_path / "run", other, progress=False, log=lambda m: None)


def test_a_shipped_heads_step_costs_apply_to_the_float32_target_only(tmp_path, monkeypatch):
    """tune-tree measures the sidecar's step costs on the float32 target; in bfloat16 a forward's rows cost otherwise,
    so there the drafter carries none and the policy goes by that target's own measured forwards."""
    import json

    import verispec.eagle.head as eagle
    from verispec.backends.hf import CausalLM
    from verispec.drafters import build_drafter

    target = tiny_model("llama")
    monkeypatch.setattr(eagle, "HEADS_DIR", tmp_path)
    EagleHead(target).save(tmp_path / f"{target.name}.pt", {"target": target.name})
    (tmp_path / f"{target.name}.json").write_text(json.dumps({"step_costs": [1.0, 1.5, 2.0]}))
    assert build_drafter("eagle", target).step_costs == (1.0, 1.5, 2.0)
    half = CausalLM(tiny_model("llama").hf.bfloat16(), None, name=target.name)
    assert half.dtype == torch.bfloat16 and build_drafter("eagle", half).step_costs is None


def test_the_shipped_way_a_head_drafts_from_q8_0_blocks_and_stays_exact(tmp_path, monkeypatch):
    """The head ``build_drafter`` loads drafts from Q8_0 blocks (``draft_from_blocks``): its own layers' weights are
    rounded to block values, each within half a block's step, that the native kernel reads as blocks (uint8 panels);
    its layers then compute what torch's products compute on those weights, to float rounding; the draft's cached
    costs are named apart from the float16 head's; greedy decoding with it is plain decoding's text."""
    import verispec.eagle.head as eagle
    from verispec.backends import native
    from verispec.drafters import build_drafter

    target = tiny_model("llama")
    monkeypatch.setattr(eagle, "HEADS_DIR", tmp_path)
    trained = EagleHead(target, feature_layers=(1, 3, -1))
    trained.save(tmp_path / f"{target.name}.pt", {"target": target.name}, half=False)
    drafter = build_drafter("eagle", target)
    head = drafter.head
    if native.linear() is None:
        assert head.blocks is None and "q8_0" not in drafter.cost_id
        pytest.skip("the native linear kernel cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
    assert head.blocks == "q8_0" and drafter.cost_id.endswith("|q8_0")
    layers = {n: m for n, m in head.named_modules() if type(m) is torch.nn.Linear and not n.startswith("lm")}
    assert {"fuse", "fc", "body.layers.0.self_attn.q_proj", "body.layers.0.mlp.down_proj"} <= set(layers)
    before = dict(trained.named_modules())
    x = torch.randn(3, 96)
    with torch.inference_mode():
        for name, m in layers.items():
            w, w0 = m.weight, before[name].weight
            step = w0.reshape(-1, 32).abs().amax(1, keepdim=True) / 127
            assert ((w - w0).reshape(-1, 32).abs() <= step * 0.51 + 1e-12).all(), name
            assert not torch.equal(w, w0), name  # rounded, not float32 as saved
            rows = x[:, :w.shape[1]] if w.shape[1] <= 96 else torch.randn(3, w.shape[1])
            got = m(rows)
            assert m._verispec_packed.dtype == torch.uint8, name  # Q8_0 blocks, not float16 panels
            assert torch.allclose(got, torch.nn.functional.linear(rows, w, m.bias), atol=1e-5, rtol=1e-5), name
    prompt = [5, 17, 33, 8, 61, 42]
    ar = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), max_new_tokens=24,
                  temperature=0.0)
    out = generate(target, drafter, get_verifier("chain"), prompt, tree=Tree.chain(3), policy="fixed",
                   max_new_tokens=24, temperature=0.0)
    assert out.token_ids == ar.token_ids


def test_a_depth_in_one_native_call_computes_what_the_forward_does(tmp_path, monkeypatch):
    """``EagleHead.depth`` (the fused input, decoder layer, norm and output layer of ``native.layer``'s ``draft_depth``)
    gives the logits and hidden states of ``lm.forward`` on the head's input, for a prefill of committed pairs (the
    target's three fused features) and for a level of drafted nodes (the head's own outputs), for one sequence and for
    two in one call, and leaves the head's caches as the forward does; it declines rows beyond the float32 attention
    kernel's, or everything where the native kernels do not build (the caller runs the forward), and greedy decoding
    either way, alone and in a batch, is plain decoding's text."""
    import verispec.eagle.head as eagle
    from verispec.backends import native
    from verispec.drafters import build_drafter
    from verispec.engine import Engine, run_all
    from verispec.methods import Recipe
    from verispec.probs import Sampling

    target = tiny_model("llama", head_dim=64)
    monkeypatch.setattr(eagle, "HEADS_DIR", tmp_path)
    EagleHead(target, feature_layers=(1, 3, -1)).save(tmp_path / f"{target.name}.pt", {"target": target.name},
                                                      half=False)
    drafter = build_drafter("eagle", target)
    head = drafter.head
    prompt = [5, 17, 33, 8, 61, 42, 9, 70, 11, 3, 25, 44, 19, 27, 50, 6, 81, 30, 2, 14, 7]
    feats = target.prefill_output(target.new_state(), prompt, features=head.feature_layers).hidden

    def causal(n):
        return torch.ones(n, n, dtype=torch.bool).tril()

    if native.layer() is None:  # no native call here: the drafter runs the forward (greedy equality below)
        assert head.depth([head.lm.new_state()], [torch.tensor(prompt[1:3])], [torch.arange(2)], [causal(2)],
                          feats[:2], True, True) is None
    with torch.inference_mode():
        for sizes in ((1,), (4,), (3, 2)) if native.layer() is not None else ():  # one sequence, then two at once
            starts = [0, 6][:len(sizes)]
            refs = [head.lm.new_state() for _ in sizes]
            fused = [head.lm.new_state() for _ in sizes]
            tokens = [torch.tensor(prompt[s + 1:s + n + 1]) for s, n in zip(starts, sizes)]
            given = torch.cat([feats[s:s + n] for s, n in zip(starts, sizes)])
            want = [head.lm.prefill_output(st, t, head.target_inputs(feats[s:s + n], t))
                    for st, t, s, n in zip(refs, tokens, starts, sizes)]
            got = head.depth(fused, tokens, [torch.arange(n) for n in sizes], [causal(n) for n in sizes], given, True,
                             True)
            assert got is not None and [st.pending for st in fused] == list(sizes)
            for st, n in zip(fused, sizes):
                head.lm.commit(st, list(range(n)))
            for w, g in zip(want, got):
                assert g.logits.shape == w.logits.shape == (1, 97)
                assert torch.allclose(g.logits, w.logits, atol=1e-5) and torch.allclose(g.hidden, w.hidden, atol=1e-5)
            # a level of drafted nodes below each sequence's last pair: two siblings and a grandchild
            parents = torch.cat([w.hidden[-1:].expand(3, -1) for w in want])
            nodes = [torch.tensor([5, 9, 12]) for _ in sizes]
            positions = [torch.tensor([n, n, n + 1]) for n in sizes]
            attend = [torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool) for _ in sizes]
            want = [head.lm.forward(st, t, p, a, head.draft_inputs(parents[3 * i:3 * i + 3], t))
                    for i, (st, t, p, a) in enumerate(zip(refs, nodes, positions, attend))]
            got = head.depth(fused, nodes, positions, attend, parents, False, False)
            for w, g in zip(want, got):
                assert g.logits.shape == w.logits.shape == (3, 97)
                assert torch.allclose(g.logits, w.logits, atol=1e-5) and torch.allclose(g.hidden, w.hidden, atol=1e-5)
            for ref, st in zip(refs, fused):
                assert st.pending == ref.pending == 3
                assert [layer._len for layer in st.cache.layers] == [layer._len for layer in ref.cache.layers]
        long = torch.tensor(prompt[1:20])  # beyond the attention kernel's rows: declined wherever it builds
        assert head.depth([head.lm.new_state()], [long], [torch.arange(19)], [causal(19)], feats[:19], True,
                          True) is None
    ar = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), max_new_tokens=24,
                  temperature=0.0)
    out = generate(target, drafter, get_verifier("chain"), prompt, tree=Tree.chain(3), policy="fixed",
                   max_new_tokens=24, temperature=0.0)
    assert out.token_ids == ar.token_ids
    engine = Engine(target, max_batch=2)  # the two sequences' depths in one call each
    seqs = [engine.submit(p, Recipe(get_verifier("chain"), Tree.chain(3), drafter.fork()), sampling=Sampling(0.0),
                          max_new_tokens=24) for p in (prompt, prompt[:12])]
    run_all(engine)
    assert seqs[0].token_ids == ar.token_ids
    assert seqs[1].token_ids == generate(target, NoDrafter(), get_verifier("chain"), prompt[:12],
                                         tree=Tree.root_only(), max_new_tokens=24, temperature=0.0).token_ids


def test_a_head_drafts_only_in_its_targets_dtype():
    """The head's body shares the target's embedding table: casting it to another dtype would change the target."""
    target = tiny_model("llama")
    head = EagleHead(target)
    with pytest.raises(ValueError, match="target's dtype"):
        head._compute_in(torch.bfloat16)
    assert target.hf.get_input_embeddings().weight.dtype == torch.float32


def test_auto_draft_picks_the_shipped_head(tmp_path, monkeypatch):
    import verispec.eagle.head as eagle
    from verispec.drafters import HybridDrafter, NgramDrafter, build_drafter
    from verispec.errors import VerispecError

    target = tiny_model("llama")
    monkeypatch.setattr(eagle, "HEADS_DIR", tmp_path)
    assert isinstance(build_drafter("auto", target), NgramDrafter)
    with pytest.raises(VerispecError, match="no draft head ships"):
        build_drafter("eagle", target)
    EagleHead(target).save(tmp_path / f"{target.name}.pt", {"target": target.name})
    auto = build_drafter("auto", target)  # with a head: prompt lookup where the text repeats, the head elsewhere
    assert isinstance(auto, HybridDrafter) and isinstance(auto.model, EagleDrafter)
    assert isinstance(build_drafter(f"eagle:{tmp_path / (target.name + '.pt')}", target), EagleDrafter)
    other = tiny_model("llama", layers=2, vocab=50)
    with pytest.raises(VerispecError, match="does not fit"):
        EagleHead.load(tmp_path / f"{target.name}.pt", other)
    for bad in (0, target.num_layers + 1, True, 1.5):
        with pytest.raises(VerispecError, match="decoder layers"):
            EagleHead(target, decoder_layers=bad)


def test_draft_vocabulary_keeps_eos_then_frequent_then_low_ids():
    from verispec.eagle.train import draft_vocabulary

    corpus = [[9, 9, 9, 7, 7, 5], [7, 9, 11]]
    assert draft_vocabulary(corpus, 3, 20, always=[2]).tolist() == [2, 7, 9]
    assert draft_vocabulary(corpus, 6, 20, always=[2]).tolist() == [0, 2, 5, 7, 9, 11]  # then unseen id 0
    assert draft_vocabulary(corpus, 8, 20).tolist() == [0, 1, 2, 3, 5, 7, 9, 11]


def test_restricted_vocabulary_head_is_exact_cheaper_and_trains(tmp_path):
    target = tiny_model("llama")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    prompt = [5, 17, 33, 8, 61, 42]
    ar = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), max_new_tokens=30,
                  temperature=0.0)
    # leave out half of the tokens the target will emit: exactness must not rely on the draft covering them
    emitted = sorted(set(ar.token_ids))
    vocab = torch.tensor(sorted(set(range(0, target.vocab_size, 3)) - set(emitted[::2]) | set(emitted[1::2])))
    head = EagleHead(target, vocab)
    assert head.lm.hf.get_output_embeddings().weight.shape == (len(vocab), head.hidden)
    assert not any("lm_head" in n for n, _ in head.own_parameters())
    full = head.full_logits(torch.randn(3, len(vocab)))
    assert full.shape == (3, target.vocab_size) and torch.isinf(full[:, 1]).all() == (1 not in vocab.tolist())
    path = tmp_path / "head.pt"
    head.save(path, {"target": target.name}, half=False)
    loaded = EagleHead.load(path, target)
    assert torch.equal(loaded.vocab, vocab) and loaded.shape()["draft_vocab"] == len(vocab)
    for tree, verifier in (("chain:4", "chain"), ("2x3", "greedy")):
        out = generate(target, EagleDrafter(loaded), get_verifier(verifier), prompt, tree=Tree.parse(tree),
                       policy="fixed",
                       max_new_tokens=30, temperature=0.0)
        assert out.token_ids == ar.token_ids, tree
    out = generate(target, EagleDrafter(loaded), get_verifier("specinfer"), prompt, tree=Tree.parse("2x2"),
                   policy="fixed",
                   max_new_tokens=20, temperature=0.8, seed=1)
    accounted(out, target, 20)
    # the loss is the cross-entropy against the target's law conditioned on the draft vocabulary, and it falls
    data = [features(target, s, top_k=8) for s in corpus(target)]
    before = evaluate(head, data, 2)
    after = train_steps(head, data, 30)
    assert after["ce_1"] < 0.8 * before["ce_1"] and after["top1_1"] > before["top1_1"]


def test_dynamic_tree_is_exact_greedy_prunes_by_path_probability_and_refuses_sampled_children():
    from verispec.drafters.model import layer_skip_drafter
    from verispec.errors import VerispecError
    from verispec.probs import Sampling
    from verispec.rng import TorchRandomness
    from verispec.tree import DynamicTree

    target = tiny_model("llama")
    prompt = [5, 17, 33, 8, 61, 42]
    ar = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), max_new_tokens=30,
                  temperature=0.0)
    shape = Tree.parse("dyn:4,3,7")
    assert shape == DynamicTree(4, 3, 7) and shape.size == 8 and shape.max_depth == 4
    for drafter in (EagleDrafter(EagleHead(target)), layer_skip_drafter(target, 2)):
        out = generate(target, drafter, get_verifier("greedy"), prompt, tree=shape, policy="fixed",
                       max_new_tokens=30, temperature=0.0)
        assert out.token_ids == ar.token_ids
    drafter = layer_skip_drafter(target, 2)
    drafter.reset(prompt)
    draft = drafter.propose(prompt, shape, Sampling(1.0), "topk", TorchRandomness(0))
    tree = draft.tree
    assert tree.size == 8 and tree.max_depth <= 4
    # path probabilities: every kept node beats every node it could have been swapped with (its ancestors come first)
    logp = [0.0]
    for n in range(1, tree.size):
        logp.append(logp[tree.parents[n]] + float(torch.log(draft.q[tree.parents[n], draft.tokens[n]])))
        assert logp[n] <= logp[tree.parents[n]] + 1e-9
        assert draft.q[tree.parents[n]].sum() > 0.99  # the parent's law is recorded
    for n in range(tree.size):  # leaves carry no law; siblings are the parent's most probable tokens in order
        if not tree.children[n]:
            assert draft.q[n].sum() == 0
        else:
            kids = [int(draft.tokens[c]) for c in tree.children[n]]
            assert kids == draft.q[n].topk(len(kids)).indices.tolist()
    out = generate(target, layer_skip_drafter(target, 2), get_verifier("topk"), prompt, tree=shape, policy="fixed",
                   max_new_tokens=20,
                   temperature=0.8, seed=2, children="topk")
    accounted(out, target, 20)
    with pytest.raises(VerispecError, match="children topk"):
        generate(target, layer_skip_drafter(target, 2), get_verifier("specinfer"), prompt, tree=shape, policy="fixed",
                 max_new_tokens=5, temperature=0.8)
    with pytest.raises(VerispecError, match="dyn:DEPTH"):
        Tree.parse("dyn:0,2,3")


def test_teacher_forced_agreement_runs_on_a_freshly_loaded_target():
    """``verispec eval-draft`` on a target as loaded (its weights still require gradients, the features come from
    inference mode): counting needs no gradient, and the result does not depend on the flag."""
    from verispec.bench.agreement import teacher_forced

    target = tiny_model("llama")
    assert all(p.requires_grad for p in target.hf.parameters())
    torch.manual_seed(2)
    head = EagleHead(target, feature_layers=(1, 3, -1))
    records = corpus(target, n=4)
    loaded = teacher_forced(head, records, depths=3)
    for p in target.hf.parameters():
        p.requires_grad_(False)
    frozen = teacher_forced(head, records, depths=3)
    assert len(loaded["agreement"]) == 3 and loaded.keys() == frozen.keys()
    assert loaded.pop("per_sequence") == frozen.pop("per_sequence")
    assert all(loaded[k] == pytest.approx(frozen[k], nan_ok=True) for k in loaded)
    assert all(0 <= a <= 1 for a in loaded["agreement"] + loaded["chain_acceptance"] if a == a)


def test_two_heads_on_the_same_sequences_compare_paired():
    from verispec.bench.agreement import agreement_difference, teacher_forced

    target = tiny_model("llama")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    records = corpus(target, n=6)
    torch.manual_seed(3)
    one = EagleHead(target, feature_layers=(1, 3, -1))
    trained = EagleHead(target, feature_layers=(1, 3, -1), decoder_layers=2)
    train_steps(trained, [features(target, s, 8, (1, 3, -1)) for s in corpus(target, n=8)], 30, depths=2)
    a, b = teacher_forced(trained, records, depths=2), teacher_forced(one, records, depths=2)
    for rep in (a, b):  # each sequence's counts add up to the totals
        assert len(rep["per_sequence"]) == len(records)
        assert [sum(s[1][k] for s in rep["per_sequence"]) for k in range(2)] == rep["positions"]
        assert sum(s[0][0] for s in rep["per_sequence"]) / rep["positions"][0] == pytest.approx(rep["agreement"][0])
    est, low, high = agreement_difference(a, b)
    assert est == pytest.approx(a["agreement"][0] - b["agreement"][0]) and low <= est <= high
    assert agreement_difference(a, a) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same sequences"):
        agreement_difference(a, teacher_forced(one, records[:3], depths=2))
