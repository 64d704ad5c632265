"""The corpus a draft head trains on and how training reads it: text sampled in batches (sequences join as others
finish) with the features and labels training reads, which are the teacher-forced ones (bitwise in bfloat16, where
a row does not depend on the batch beside it); greedy text equal to ``generate``'s; rounds resumed with their
features, repeated records dropped; training streams the corpus a few rounds at a time, stops when the held-out
rounds stop improving and ships the best checkpoint."""

import functools
import importlib
import json

import pytest
import torch
from conftest import FORWARDS, ByteTokenizer, tiny_model, tiny_target

from verispec.eagle import TrainConfig, train
from verispec.eagle import corpus as corpus_mod
from verispec.eagle.corpus import CorpusConfig, Record, _Writer, features_path, read_corpus, round_features
from verispec.eagle.head import EagleHead
from verispec.errors import VerispecError

train_mod = importlib.import_module("verispec.eagle.train")  # the module (the package exports its function train)
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [1, 11, 12],
           [1, 40, 41, 42, 43]]
FROM = [3, 0, 2, 2, 4]  # labels from these positions on


class ChatBytes(ByteTokenizer):
    """A byte tokenizer with a chat template ('[u]text|' per user turn, '[a]text|' per assistant turn) that decodes
    what it encodes (printable ASCII), so that a conversation re-rendered with its answers extends its first part."""

    chat_template = "bytes"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3 if i - 3 >= 32 else i - 3 + 94) for i in ids if i >= 3)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"[{m['role'][0]}]{m['content']}|" for m in messages)
        return text + ("[a]" if add_generation_prompt else "")


@pytest.fixture(params=FORWARDS)
def target(request):
    t = tiny_target(request.param)
    t.tokenizer = ByteTokenizer(t.vocab_size)
    return t


def teacher_forced(t, tokens, layers, k):
    """One forward over the whole sequence on a fresh state: every row's features and top-k next-token law."""
    n = len(tokens)
    out = t.forward(t.new_state(), torch.tensor(tokens), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(),
                    features=layers)
    p, i = torch.softmax(out.logits, dim=-1).topk(k, dim=-1)
    return out.hidden.half(), p.half(), i.int()


def test_sampled_features_and_labels_are_the_teacher_forced_ones(target):
    bf16 = target.dtype == torch.bfloat16
    w = _Writer(target, (2, -1), 8, max_batch=2)  # 5 prompts through 2 slots: sequences join as others finish
    torch.manual_seed(0)
    outs, data = w.sample(PROMPTS, 20, 0.8, labels_from=FROM)
    for p, o, d, first in zip(PROMPTS, outs, data, FROM):
        tokens = p + o
        T = len(tokens)
        assert d["tokens"].tolist() == tokens and d["feat"].shape == (T, 2 * target.config.hidden_size) and d["p"].shape == (T, 8)
        feat, prob, idx = teacher_forced(target, tokens, (2, -1), 8)
        if bf16:  # the same bits: a row's result does not depend on the rows and sequences beside it
            assert torch.equal(d["feat"], feat)
            assert torch.equal(d["i"][first:T - 1], idx[first:T - 1])
            assert torch.equal(d["p"][first:T - 1], prob[first:T - 1])
        else:
            assert torch.allclose(d["feat"].float(), feat.float(), atol=2e-3, rtol=2e-3)
            assert torch.equal(d["i"][first:T - 1, :3], idx[first:T - 1, :3])
            assert torch.allclose(d["p"][first:T - 1].float(), prob[first:T - 1].float(), atol=1e-3)
        assert not d["p"][:first].any() and not d["p"][T - 1].any()  # labels only where asked (not past the end)
    if not bf16:  # greedy text is generate's
        outs, data = w.sample(PROMPTS, 12, 0.0)
        assert data == [None] * len(PROMPTS)
        for p, o in zip(PROMPTS, outs):
            ref = target.hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                                     eos_token_id=2)[0, len(p):].tolist()
            assert o == ref


def test_tasks_share_the_batch_and_each_keeps_its_own_law(target, monkeypatch):
    """Two tasks of two stages each (the second stage's prompts made from the first's answers) in flight at once
    through 4 slots: their sequences share forwards, a greedy job beside a sampled one stays greedy (generate's text
    in float32), and a job that keeps features gets the teacher-forced ones though it shares steps with one that
    keeps none."""
    bf16 = target.dtype == torch.bfloat16
    w = _Writer(target, (2, -1), 8, max_batch=4)  # a slot is free from the start: the second task starts at once
    temperatures = []  # per batched forward: the temperatures of the jobs its sequences belong to
    real = _Writer._features
    monkeypatch.setattr(_Writer, "_features", lambda self, seqs: temperatures.append(
        {s.running.spec.temperature for s in seqs}) or real(self, seqs))

    def task(temperature, keep):
        first, _ = yield corpus_mod.Job(PROMPTS[:3], 6, temperature, [len(p) - 1 for p in PROMPTS[:3]] if keep else None)
        follow = [p + o[:2] + [1] for p, o in zip(PROMPTS[:3], first)]
        second, data = yield corpus_mod.Job(follow, 8, temperature, [len(p) - 1 for p in follow] if keep else None)
        return follow, second, data

    results = dict(w.run(iter([task(0.0, keep=True), task(1.0, keep=False)]), at_once=2))
    assert set(results) == {0, 1}
    assert {0.0, 1.0} in temperatures  # a forward held sequences of both tasks
    for p, o, d in zip(*results[0]):
        feat, _, _ = teacher_forced(target, p + o, (2, -1), 8)
        if bf16:
            assert torch.equal(d["feat"], feat)
        else:
            assert torch.allclose(d["feat"].float(), feat.float(), atol=2e-3, rtol=2e-3)
            ref = target.hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                     eos_token_id=2)[0, len(p):].tolist()
            assert o == ref
    assert results[1][2] == [None] * 3


def chat_target():
    t = tiny_model("llama")
    t.tokenizer = ChatBytes(t.vocab_size)
    return t


def test_corpus_rounds_keep_their_features_resume_and_drop_repeats(tmp_path, monkeypatch):
    t = chat_target()
    path = tmp_path / "corpus"
    cfg = CorpusConfig(rounds=2, batch=3, layers=(2, -1), top_k=4)
    records = corpus_mod.write_corpus(t, path, cfg)  # round 0: chat, round 1: document
    assert {r.shape for r in records} == {"chat", "document"}
    joined = [r for r in records if r.shape == "chat" and len(r.spans) == 2]
    assert joined  # two assistant turns in one sequence, trained on both
    for rnd in (0, 1):
        recs = [r for r in records if r.round == rnd]
        for r, d in zip(recs, round_features(path, rnd, recs)):
            T = len(r.tokens)
            assert d["tokens"].tolist() == r.tokens and d["feat"].shape == (T, 64)
            labelled = d["p"].sum(-1) > 0
            first = r.spans[0][0] - 1
            assert labelled[first:T - 1].all() and not labelled[:first].any()  # the first span's labels too
            assert d["mask"].sum() == sum(b - a for a, b in r.spans)
    before = [corpus_mod.text_path(path, rnd).read_bytes() for rnd in (0, 1)]
    saved = (path / "features" / "00001.pt").read_bytes()
    # an interrupted round 2: its features are written, its text is not (only a temporary file)
    (path / "features" / "00002.pt").write_bytes(b"cut short")
    corpus_mod.text_path(path, 2).with_suffix(".gz.tmp").write_bytes(b"cut short")
    assert len(read_corpus(path)) == len(records)
    more = corpus_mod.write_corpus(t, path, CorpusConfig(rounds=3, batch=3, layers=(2, -1), top_k=4))
    assert [corpus_mod.text_path(path, rnd).read_bytes() for rnd in (0, 1)] == before
    assert (path / "features" / "00001.pt").read_bytes() == saved
    assert [r.tokens for r in more[:len(records)]] == [r.tokens for r in records]
    assert {r.round for r in more} == {0, 1, 2} and read_corpus(path) == more
    assert len(round_features(path, 2, [r for r in more if r.round == 2])) == sum(r.round == 2 for r in more)
    # each round's draws follow from its number: written in one go, the corpus is the one written in two sittings
    corpus_mod.write_corpus(t, tmp_path / "fresh", CorpusConfig(rounds=3, batch=3, layers=(2, -1), top_k=4))
    assert [corpus_mod.text_path(tmp_path / "fresh", rnd).read_bytes() for rnd in range(3)] == \
        [corpus_mod.text_path(path, rnd).read_bytes() for rnd in range(3)]

    def twice(w, shape, n, temperature, rnd):  # a round that writes the same record twice, and one of round 0's
        rec = Record([1, 50, 51, 52], [[1, 4]], "", -1, {"x": torch.zeros(1)})
        yield from ()  # a round is a generator of its stages' jobs: this one has none
        return [rec, rec, Record(records[0].tokens, records[0].spans, "", -1, {"x": torch.zeros(1)})]

    monkeypatch.setattr(corpus_mod, "_round", twice)
    again = corpus_mod.write_corpus(t, path, CorpusConfig(rounds=4, batch=3, layers=(2, -1), top_k=4))
    assert [r.tokens for r in again if r.round == 3] == [[1, 50, 51, 52]]


def test_training_streams_rounds_and_ships_the_best_checkpoint(tmp_path, monkeypatch):
    t = chat_target()
    monkeypatch.setattr(train_mod, "BUFFER_ROUNDS", 2)
    cfg = TrainConfig(rounds=8, gen_batch=2, top_k=8, epochs=3, batch=2, checkpoint_every=1, held_out=0.2,
                      vocab=0, depths=2, patience=2)
    train(t, tmp_path / "run", cfg, until="corpus", progress=False, log=lambda m: None)
    records = read_corpus(tmp_path / "run")
    train_idx, _ = train_mod._split(records, cfg)
    order = train_mod._epoch_order(records, train_idx, cfg.seed, 0)
    assert sorted(order) == sorted(train_idx)
    loads = []
    real_load = train_mod.round_features
    monkeypatch.setattr(train_mod, "round_features", lambda p, rnd, recs: loads.append(rnd) or real_load(p, rnd, recs))
    info = json.loads((tmp_path / "run" / "config.json").read_text())["corpus"]
    feats = train_mod._Features(tmp_path / "run", records, info, (-1,), 8, 32, 4)
    for i in order:  # an epoch loads each round once, holding at most BUFFER_ROUNDS of them
        assert feats[i]["tokens"].tolist() == records[i].tokens and len(feats.cache) <= 2
    assert sorted(loads) == sorted({records[i].round for i in train_idx})
    # the held-out score goes up, then down: training stops after `patience` checkpoints without a better one and
    # ships the best
    scores = iter([0.1, 0.5, 0.3, 0.2, 0.9, 0.9])
    real = train_mod.evaluate
    states = {}

    def scored(head, data, depths=1):
        out = real(head, data, depths)
        states[len(states) + 1] = head.head_state()
        out["chain_1"] = next(scores)
        return out

    monkeypatch.setattr(train_mod, "evaluate", scored)
    lines = []
    path = train(t, tmp_path / "run", cfg, progress=False, log=lines.append)
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "log.jsonl").open()]
    assert steps == [1, 2, 3, 4] and any("stopping at step 4" in x for x in lines)
    head = EagleHead.load(path, t)
    assert head.meta["best_step"] == 2
    # its file keeps the held-out curve: every checkpoint's validation, as the log has it
    assert [(c["step"], c["val_chain_1"]) for c in head.meta["curve"]] == [(1, 0.1), (2, 0.5), (3, 0.3), (4, 0.2)]
    best = states[2]
    got = head.head_state()
    assert all(torch.allclose(got[k].float(), best[k].half().float()) for k in best)


def test_heads_train_on_another_folders_corpus_and_on_the_first_max_tokens(tmp_path):
    t = chat_target()
    cfg = TrainConfig(rounds=4, gen_batch=2, top_k=8, epochs=1, batch=2, vocab=0)
    train(t, tmp_path / "corpus", cfg, until="corpus", progress=False, log=lambda m: None)
    text = sorted((tmp_path / "corpus" / "text").iterdir())
    kept = [p.read_bytes() for p in text]
    for rnd in range(4):  # the corpus as a checkout has it: text without features
        corpus_mod.features_path(tmp_path / "corpus", rnd).unlink()
    small = TrainConfig(**{**cfg.__dict__, "max_tokens": 300})
    have = lambda: {rnd for rnd in range(4) if corpus_mod.features_path(tmp_path / "corpus", rnd).is_file()}  # noqa
    train(t, tmp_path / "head", small, progress=False, log=lambda m: None, corpus_dir=tmp_path / "corpus",
          until="features")  # the CLI's first stage, in the writer's dtype
    assert not (tmp_path / "head" / "head.pt").exists()
    first = have()
    path = train(t, tmp_path / "head", small, progress=False, log=lambda m: None, corpus_dir=tmp_path / "corpus")
    assert not (tmp_path / "head" / "text").exists()
    assert sorted((tmp_path / "corpus" / "text").iterdir()) == text and [p.read_bytes() for p in text] == kept
    meta = EagleHead.load(path, t).meta
    records = read_corpus(tmp_path / "corpus")
    train_idx, _ = train_mod._split(records, cfg)
    sizes = [sum(b - a for a, b in records[i].spans) for i in train_idx[:meta["sequences"]]]
    assert sum(sizes) >= 300 > sum(sizes[:-1]) and meta["response_tokens"] == sum(sizes)
    # a small head computes the features of the rounds it reads only (its training and validation rounds)
    small_idx, val_idx = train_mod._training_split(records, small)
    reads = {records[i].round for i in small_idx + val_idx}
    assert reads < set(range(4)) and first == have() == reads
    with pytest.raises(Exception, match="4 complete corpus rounds, fewer than --rounds 5"):
        train(t, tmp_path / "other", TrainConfig(**{**cfg.__dict__, "rounds": 5}), progress=False,
              corpus_dir=tmp_path / "corpus")


def test_held_out_rounds_are_drawn_within_each_shape():
    def split(n_rounds, held_out):
        records = [Record([1, 2, 3], [[1, 3]], corpus_mod.CYCLE[r % len(corpus_mod.CYCLE)], r)
                   for r in range(n_rounds) for _ in range(3)]
        train_idx, val_idx = train_mod._split(records, TrainConfig(rounds=n_rounds, held_out=held_out))
        assert sorted(train_idx + val_idx) == list(range(len(records)))
        held = {records[i].round for i in val_idx}
        return records, held, val_idx

    records, held, val_idx = split(64, 0.1)
    for shape in set(corpus_mod.CYCLE):
        rounds = {r.round for r in records if r.shape == shape}
        assert len(rounds & held) == min(len(rounds) - 1, round(len(rounds) * 0.1)) >= 1  # every shape, none whole
    assert val_idx != sorted(val_idx)  # shuffled: the first VALIDATION records span the held-out rounds
    records, held, _ = split(10, 0.05)  # too small for a round per shape: one round of the commonest shape
    assert len(held) == 1 and records[3 * held.pop()].shape in ("chat", "document", "math")


def test_a_corpus_without_its_features_computes_them_again_by_teacher_forcing(tmp_path, target):
    """A fresh checkout has a corpus's text (committed) but not its features (a cache): training computes them again
    from the text by teacher forcing; on these tiny models the same bits as the forwards that wrote the text kept in
    bfloat16 (to rounding in float32; on the default model to bfloat16 rounding, docs/design.md)."""
    target.tokenizer = ChatBytes(target.vocab_size)
    path = tmp_path / "corpus"
    records = corpus_mod.write_corpus(target, path, CorpusConfig(rounds=2, batch=3, layers=(2, -1), top_k=4))
    written = [d for rnd in (0, 1) for d in round_features(path, rnd, [r for r in records if r.round == rnd])]
    for rnd in (0, 1):
        features_path(path, rnd).unlink()
    with pytest.raises(VerispecError, match="00000.pt is missing"):
        round_features(path, 0, records)
    n = target.num_layers
    corpus_mod.fill_features(target, path, records, (2, n), 4, progress=False)
    again = [d for rnd in (0, 1) for d in round_features(path, rnd, [r for r in records if r.round == rnd])]
    for r, a, b in zip(records, written, again, strict=True):
        assert b["tokens"].tolist() == r.tokens and torch.equal(a["mask"], b["mask"])
        assert torch.equal(a["p"] > 0, b["p"] > 0)  # labels at the same positions
        if target.dtype == torch.bfloat16:
            assert torch.equal(a["feat"], b["feat"]) and torch.equal(a["p"], b["p"]) and torch.equal(a["i"], b["i"])
        else:
            assert torch.allclose(a["feat"].float(), b["feat"].float(), atol=2e-3, rtol=2e-3)
            assert torch.allclose(a["p"].float(), b["p"].float(), atol=1e-3)
    saved = features_path(path, 0).read_bytes()
    corpus_mod.fill_features(target, path, records, (2, n), 4, progress=False)  # nothing missing: nothing redone
    assert features_path(path, 0).read_bytes() == saved


def test_training_can_start_from_an_earlier_head(tmp_path, monkeypatch):
    """--init: a head goes on training from an earlier one (its weights and draft vocabulary), e.g. an earlier
    session's head on a grown corpus; a head reading other layers, or a missing file, is refused in one line."""
    t = chat_target()
    cfg = TrainConfig(rounds=4, gen_batch=2, top_k=8, epochs=1, batch=2, vocab=40, checkpoint_every=1)
    first = EagleHead.load(train(t, tmp_path / "a", cfg, progress=False, log=lambda m: None, store_layers=(2, -1)),
                           t)
    seen = {}
    real = train_mod.head_loss

    def spy(head, *a, **k):  # the head's weights when its first step begins
        seen.setdefault("state", head.head_state())
        seen.setdefault("vocab", head.vocab.clone())
        return real(head, *a, **k)

    monkeypatch.setattr(train_mod, "head_loss", spy)
    again = TrainConfig(**{**cfg.__dict__, "init": str(tmp_path / "a" / "head.pt"), "vocab": 16})
    train(t, tmp_path / "b", again, progress=False, log=lambda m: None, corpus_dir=tmp_path / "a")
    assert torch.equal(seen["vocab"], first.vocab)  # the earlier head's vocabulary, not a new one of 16
    assert all(torch.equal(seen["state"][k], v) for k, v in first.head_state().items())
    with pytest.raises(VerispecError, match="reads target layers"):
        train(t, tmp_path / "c", TrainConfig(**{**again.__dict__, "feature_layers": "2,-1"}), progress=False,
              log=lambda m: None, corpus_dir=tmp_path / "a")
    # a deeper head grows from it: its first step starts from the earlier head's very logits, and it trains on
    grown = []

    def first_logits(head, *a, **k):
        if not grown:
            with torch.no_grad():
                batch = a[0] if isinstance(a[0], list) else [a[0]]
                grown.append((len(head.body.layers), next(train_mod.depth_outputs(head, batch[0], 1))[3]))
                ref = EagleHead(t, first.vocab, train_mod.TRAIN_HEAD_DTYPE, feature_layers=first.feature_layers)
                ref.load_state_dict(first.head_state(), strict=False)
                grown.append(next(train_mod.depth_outputs(ref, batch[0], 1))[3])
        return real(head, *a, **k)

    monkeypatch.setattr(train_mod, "head_loss", first_logits)
    deeper = TrainConfig(**{**again.__dict__, "decoder_layers": 2})
    two = EagleHead.load(train(t, tmp_path / "d", deeper, progress=False, log=lambda m: None,
                               corpus_dir=tmp_path / "a"), t)
    (layers, logits), alone = grown
    assert layers == 2 and torch.equal(logits, alone)
    assert len(two.body.layers) == 2 and two.body.layers[1].mlp.down_proj.weight.abs().sum() > 0
    with pytest.raises(VerispecError, match="more than the --decoder-layers 1"):
        train(t, tmp_path / "e", TrainConfig(**{**cfg.__dict__, "init": str(tmp_path / "d" / "head.pt")}),
              progress=False, log=lambda m: None, corpus_dir=tmp_path / "a")
    with pytest.raises(VerispecError, match="no such head file"):
        TrainConfig(init=str(tmp_path / "nowhere.pt")).validate()


def test_a_time_budget_stops_training_at_a_checkpoint_and_the_same_command_resumes(tmp_path):
    """--max-minutes: training stops at the first checkpoint past the budget and writes head.pt from the best
    checkpoint (e.g. inside a lent GPU's minutes); running again goes on with the same schedule to its end."""
    t = chat_target()
    cfg = TrainConfig(rounds=4, gen_batch=2, top_k=8, epochs=2, batch=2, vocab=0, checkpoint_every=2)
    lines = []
    path = train(t, tmp_path / "run", cfg, progress=False, log=lines.append, max_minutes=1e-9)
    early = EagleHead.load(path, t).meta
    assert any("--max-minutes 1e-09 has passed: stopping at step 2" in x for x in lines)
    assert early["steps"] == 2 and early["stopped_early"] and early["device"] == "cpu"
    lines.clear()
    path = train(t, tmp_path / "run", cfg, progress=False, log=lines.append)
    done = EagleHead.load(path, t).meta
    assert any("resuming training at step 2" in x for x in lines)
    assert done["steps"] > 2 and "stopped_early" not in done
    with pytest.raises(VerispecError, match="--max-minutes must be > 0"):
        train(t, tmp_path / "other", cfg, progress=False, log=lambda m: None, max_minutes=0)


def test_the_generate_writer_draws_each_row_at_its_own_temperature():
    """``_RowTemperature``: a row at T > 0 is its logits over T; a row at 0 keeps only its argmax (the first
    largest), so sampling it is greedy decoding."""
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, -1.0, 0.0, 4.0], [0.0, 1.0, 2.0, 3.0]])
    out = corpus_mod._RowTemperature(torch.tensor([0.0, 0.5, 2.0]))(None, scores.clone())
    assert torch.equal(torch.softmax(out[0], -1), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(out[1], scores[1] / 0.5) and torch.allclose(out[2], scores[2] / 2.0)


def test_a_gpu_target_writes_rounds_with_generate_and_its_greedy_text_is_the_batch_writers(tmp_path, monkeypatch):
    """Off the CPU (train-draft --device cuda) new rounds are written with ``generate`` (text only, many rounds
    together), their features computed by teacher forcing, and ``writers.jsonl`` names them. A greedy job's text is the
    CPU batch writer's; every row stops at its own job's limit or its first end-of-sequence token."""
    t = chat_target()
    g = corpus_mod._GenerateWriter(t, max_batch=2, budget=200)  # 5 prompts, small padded batches
    batch = _Writer(t, None, 8, max_batch=5)

    def job(temperature, limit):
        return (yield corpus_mod.Job(PROMPTS, limit, temperature))

    tasks = [job(0.0, 12), job(0.0, 5), job(0.9, 7)]
    got = dict(g.run(iter(tasks), at_once=3))
    (_, (want, _)), = batch.run(iter([job(0.0, 12)]))
    assert got[0][0] == want and got[0][1] == [None] * len(PROMPTS)
    assert all(a == b[:len(a)] and len(a) == min(5, len(b)) for a, b in zip(got[1][0], want))
    assert all(1 <= len(o) <= 7 and all(v not in t.eos_token_ids for v in o[:-1]) for o in got[2][0])

    # what a target on a GPU does (write_corpus's default there), here on the CPU
    monkeypatch.setattr(train_mod, "write_corpus", functools.partial(corpus_mod.write_corpus, generate=True))
    monkeypatch.setattr(corpus_mod, "GENERATE_ROUNDS_AT_ONCE", 2)
    cfg = TrainConfig(rounds=3, gen_batch=2, top_k=8, vocab=0)
    train(t, tmp_path / "run", cfg, until="corpus", progress=False, log=lambda m: None)
    records = read_corpus(tmp_path / "run")
    assert {r.round for r in records} == {0, 1, 2} and {r.shape for r in records} == {"chat", "document", "qa"}
    writers = [json.loads(x) for x in (tmp_path / "run" / "writers.jsonl").read_text().splitlines()]
    assert [w["round"] for w in writers] == [0, 1, 2] and {w["writer"] for w in writers} == {"generate"}
    for rnd in range(3):  # features by teacher forcing, where training reads them
        recs = [r for r in records if r.round == rnd]
        assert [d["tokens"].tolist() for d in round_features(tmp_path / "run", rnd, recs)] == [r.tokens for r in recs]


def test_writing_stops_beginning_rounds_at_the_deadline(tmp_path):
    """--max-minutes with --until corpus bounds the writing: no round begins after it, the rounds written are kept
    (without features); the same command goes on from there."""
    t = chat_target()
    lines = []
    cfg = TrainConfig(rounds=4, gen_batch=2, top_k=8, vocab=0)
    out = train(t, tmp_path / "run", cfg, until="corpus", progress=False, log=lines.append, max_minutes=1e-6)
    assert out == tmp_path / "run" and len({r.round for r in read_corpus(tmp_path / "run")}) < 4
    assert any("corpus rounds written" in x for x in lines)
    train(t, tmp_path / "run", cfg, until="corpus", progress=False, log=lambda m: None)
    assert len({r.round for r in read_corpus(tmp_path / "run")}) == 4


def test_devices_are_checked_in_one_line():
    from verispec.backends.loading import check_device

    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(VerispecError, match="unknown device 'gpu0'"):
        check_device("gpu0")
    with pytest.raises(VerispecError, match="verispec runs on cpu or cuda"):
        check_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(VerispecError, match="torch sees no CUDA GPU"):
            check_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (scripts/gpu_head.sh runs this on a lent "
                                                          "one before it trains there)")
def test_features_and_training_on_a_gpu_match_the_cpu(tmp_path):
    """The GPU path of train-draft --device: the corpus written on the CPU, its features computed again on the GPU
    (the stock forward in float32) equal the CPU's to float rounding, and a head trained there loads and drafts on
    the CPU."""
    from verispec.backends import CausalLM

    t = chat_target()
    cfg = TrainConfig(rounds=4, gen_batch=2, top_k=8, epochs=1, batch=2, vocab=40, checkpoint_every=2, depths=2)
    train(t, tmp_path / "run", cfg, until="corpus", progress=False, log=lambda m: None)
    records = read_corpus(tmp_path / "run")
    cpu = [d for rnd in range(4) for d in round_features(tmp_path / "run", rnd, [r for r in records if r.round == rnd])]
    for rnd in range(4):
        features_path(tmp_path / "run", rnd).unlink()
    gpu = CausalLM(t.hf.to("cuda"), t.tokenizer, name=t.name, lean=False)
    path = train(gpu, tmp_path / "run", cfg, progress=False, log=lambda m: None)
    again = [d for rnd in range(4) for d in round_features(tmp_path / "run", rnd, [r for r in records if r.round == rnd])]
    for a, b in zip(cpu, again, strict=True):
        assert b["feat"].device.type == "cpu" and torch.equal(a["tokens"], b["tokens"])
        assert torch.allclose(a["feat"].float(), b["feat"].float(), atol=2e-3, rtol=2e-3)
        assert torch.allclose(a["p"].float(), b["p"].float(), atol=1e-3)
    t.hf.to("cpu")
    head = EagleHead.load(path, t)
    assert head.meta["device"] == "cuda" and head.meta["steps"] > 0 and head.vocab.device.type == "cpu"


def test_eval_draft_holds_out_the_rounds_the_head_held_out_as_the_corpus_grows(tmp_path):
    """eval-draft --corpus measures a head on the rounds its own training held out: the split of the rounds it
    trained with (its file says), not of however many the corpus holds by then, which would hold out others
    (some of them trained on)."""
    from verispec.bench.agreement import _held_out, training_record

    t = chat_target()
    grown = TrainConfig(rounds=9, gen_batch=2, top_k=8, epochs=1, batch=2, vocab=0, held_out=0.2)
    train(t, tmp_path / "corpus", grown, until="corpus", progress=False, log=lambda m: None)
    small = TrainConfig(**{**grown.__dict__, "rounds": 6})
    head = EagleHead.load(train(t, tmp_path / "head", small, progress=False, log=lambda m: None,
                                corpus_dir=tmp_path / "corpus"), t)
    records = read_corpus(tmp_path / "corpus")

    def held(n):
        rr = [r for r in records if r.round < n]
        return {rr[i].round for i in train_mod._split(rr, TrainConfig(**{**grown.__dict__, "rounds": n}))[1]}

    assert held(6) != held(9)  # the grown corpus's own split holds out other rounds
    _, recs, val = _held_out(head, tmp_path / "corpus")
    assert {recs[i].round for i in val} == held(6) and max(r.round for r in recs) == 5
    assert training_record(head)["rounds"] == 6  # what eval-draft's report says the head trained with


def test_first_round_trains_and_holds_out_on_the_later_rounds_only(tmp_path):
    """--first-round: a head goes on training on the rounds added since it trained; its held-out rounds (which
    eval-draft --corpus measures it on) are among them too."""
    from verispec.bench.agreement import _held_out

    t = chat_target()
    cfg = TrainConfig(rounds=5, gen_batch=2, top_k=8, vocab=0, epochs=1, batch=2, checkpoint_every=2)
    train(t, tmp_path / "run", cfg, until="corpus", progress=False, log=lambda m: None)
    records = read_corpus(tmp_path / "run")
    later = TrainConfig(rounds=5, gen_batch=2, top_k=8, vocab=0, epochs=1, batch=2, checkpoint_every=2, first_round=3)
    path = train(t, tmp_path / "later", later, corpus_dir=tmp_path / "run", progress=False, log=lambda m: None)
    head = EagleHead.load(path, t)
    _, held, val = _held_out(head, tmp_path / "run")
    assert {r.round for r in held} == {3, 4} and val
    assert head.meta["sequences"] + len(val) == sum(r.round >= 3 for r in records)
    with pytest.raises(VerispecError, match="--first-round"):
        TrainConfig(rounds=5, first_round=4).validate()


def test_bfloat16_training_computes_in_bfloat16_and_keeps_float32_weights(tmp_path, monkeypatch):
    """--precision bfloat16: the head's training losses are computed under bfloat16 autocast, near the float32 ones on
    the same weights; its weights and the head file stay float32; an unknown precision is refused."""
    t = chat_target()
    cfg = TrainConfig(rounds=4, gen_batch=2, top_k=8, vocab=0, epochs=1, batch=2, checkpoint_every=2,
                      precision="bfloat16")
    seen = []
    original = train_mod.head_loss

    def spy(head, data, *args, **kwargs):
        loss, s = original(head, data, *args, **kwargs)
        if head.training:  # a training step (validation runs in eval mode, in float32)
            seen.append(torch.is_autocast_enabled("cpu"))
        return loss, s

    monkeypatch.setattr(train_mod, "head_loss", spy)
    path = train(t, tmp_path / "run", cfg, progress=False, log=lambda m: None)
    assert seen and all(seen)
    head = EagleHead.load(path, t)
    assert head.meta["config"]["precision"] == "bfloat16"
    assert all(p.dtype == torch.float32 for p in head.trainable())
    data = train_mod._Features(tmp_path / "run", read_corpus(tmp_path / "run"),
                               json.loads((tmp_path / "run" / "config.json").read_text())["corpus"], (-1,), 8,
                               t.config.hidden_size, t.num_layers)[0]
    head.train()
    with torch.no_grad():
        full = train_mod.head_loss(head, data, 2)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = train_mod.head_loss(head, data, 2)[0]
    assert torch.isclose(full, half, rtol=0.05) and not torch.equal(full, half)
    with pytest.raises(VerispecError, match="--precision must be float32 or bfloat16"):
        TrainConfig(precision="fp8").validate()
