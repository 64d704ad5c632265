"""The EAGLE-style draft head: it trains (loss falls), saves and loads, and drafting with it is exact."""

import pytest
import torch

from verispec import Tree, generate, get_verifier
from verispec.drafters import NoDrafter
from verispec.drafters.eagle import EagleDrafter
from verispec.eagle import EagleHead, TrainConfig, evaluate, features, head_loss, train

from conftest import ByteTokenizer, tiny_model


def corpus(target, n=6, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):  # the target's own greedy continuations of random starts
        start = torch.randint(3, target.vocab_size, (3,), generator=g).tolist()
        ids = target.hf.generate(torch.tensor([start]), max_new_tokens=length, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        out.append(ids[0].tolist())
    return out


def test_head_shares_the_targets_tables_and_trains():
    target = tiny_model("llama")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    head = EagleHead(target)
    names = {n for n, _ in head.named_parameters()}
    assert not any("lm_head" in n for n in names)
    assert head.lm.hf.get_output_embeddings() is target.hf.get_output_embeddings()
    data = [features(target, s, top_k=8) for s in corpus(target)]
    before = evaluate(head, data)
    opt = torch.optim.AdamW(head.trainable(), lr=3e-3)
    head.train()
    for _ in range(40):
        opt.zero_grad()
        for d in data:
            loss, _ = head_loss(head, d)
            (loss / len(data)).backward()
        opt.step()
    after = evaluate(head, data)
    assert after["ce"] < 0.7 * before["ce"] and after["feat"] < before["feat"]
    assert after["top1"] > before["top1"]


def test_eagle_greedy_equals_autoregressive_and_sampling_runs(tmp_path):
    target = tiny_model("llama")
    head = EagleHead(target)  # untrained: exactness must not depend on the head's quality
    path = tmp_path / "head.pt"
    head.save(path, {"target": target.name}, half=False)
    loaded = EagleHead.load(path, target)
    for name, tensor in head.head_state().items():
        assert torch.equal(tensor, loaded.head_state()[name])
    prompt = [5, 17, 33, 8, 61, 2 + 40]
    ar = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), max_new_tokens=30,
                  temperature=0.0)
    for tree, verifier in (("chain:4", "chain"), ("2x3", "greedy"), ("3,2,1", "greedy"), ("chain:1", "chain")):
        out = generate(target, EagleDrafter(loaded), get_verifier(verifier), prompt, tree=Tree.parse(tree),
                       max_new_tokens=30, temperature=0.0)
        assert out.token_ids == ar.token_ids, tree
    for verifier, tree in (("chain", "chain:5"), ("specinfer", "2x3"), ("reserve", "3,1"), ("swor", "2x2")):
        out = generate(target, EagleDrafter(loaded), get_verifier(verifier), prompt, tree=Tree.parse(tree),
                       max_new_tokens=20, temperature=0.8, seed=3)
        assert (out.num_tokens == 20 or out.stop_reason == "eos") and out.mean_accepted_length >= 1.0


def test_trained_head_drafts_better_than_untrained(tmp_path):
    target = tiny_model("llama")
    target.tokenizer = ByteTokenizer(target.vocab_size)
    cfg = TrainConfig(sequences=12, prompt_tokens=4, response_tokens=28, gen_batch=4, top_k=8, epochs=30, batch=4,
                      lr=3e-3, checkpoint_every=20, temperature=0.5)
    path = train(target, tmp_path / "run", cfg, progress=False, log=lambda m: None, max_steps=40)
    assert not path.exists() and (tmp_path / "run" / "checkpoint.pt").exists()
    path = train(target, tmp_path / "run", cfg, progress=False, log=lambda m: None)  # resumes at step 40
    assert path.exists()
    import json
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "log.jsonl").open()]
    assert steps == list(range(1, len(steps) + 1))
    trained = EagleHead.load(path, target)
    prompt = [1, 9, 44, 3, 71]
    lengths = {}
    for name, head in (("untrained", EagleHead(target)), ("trained", trained)):
        out = generate(target, EagleDrafter(head), get_verifier("chain"), prompt, tree=Tree.chain(4),
                       max_new_tokens=40, temperature=0.0)
        lengths[name] = out.mean_accepted_length
    assert lengths["trained"] > lengths["untrained"]
    with pytest.raises(Exception, match="another configuration"):
        train(target, tmp_path / "run", TrainConfig(sequences=12), progress=False)
    other = TrainConfig(**{**cfg.__dict__, "lr": 1e-3})  # same corpus, other training: refused at the checkpoint
    with pytest.raises(Exception, match="delete it"):
        train(target, tmp_path / "run", other, progress=False, log=lambda m: None)


def test_auto_draft_picks_the_shipped_head(tmp_path, monkeypatch):
    import verispec.eagle as eagle
    from verispec.cli import build_drafter
    from verispec.drafters import NgramDrafter
    from verispec.errors import VerispecError

    target = tiny_model("llama")
    monkeypatch.setattr(eagle, "HEADS_DIR", tmp_path)
    assert isinstance(build_drafter("auto", target), NgramDrafter)
    with pytest.raises(VerispecError, match="no draft head ships"):
        build_drafter("eagle", target)
    EagleHead(target).save(tmp_path / f"{target.name}.pt", {"target": target.name})
    assert isinstance(build_drafter("auto", target), EagleDrafter)
    assert isinstance(build_drafter(f"eagle:{tmp_path / (target.name + '.pt')}", target), EagleDrafter)
    other = tiny_model("llama", layers=2, vocab=50)
    with pytest.raises(VerispecError, match="does not fit"):
        EagleHead.load(tmp_path / f"{target.name}.pt", other)
