"""An EAGLE-style draft head (Li et al. 2024): one decoder layer of the target's own architecture that maps
``[target feature at position t; embedding of token t+1]`` to the feature at t+1, read out by the target's
output head. The target's embeddings and output head are shared, not copied, so the head adds only
``fc`` (2H -> H), one decoder layer and a norm.

"Feature" is the target's last hidden state (``hidden_states[-1]``: after the final norm, so that
``logits = lm_head(feature)``); the head's own last hidden state lives in the same space, which lets the
drafter feed a drafted node's predicted feature back in at the next depth.

Training (``train``) distils the target: for every position of sequences the target sampled itself, the
head sees the true feature f_t and token x_{t+1}, and is trained to predict the target's next-token law
at t+1 (cross-entropy against the target's top-k probabilities) and the feature f_{t+1} (smooth L1).
Training data never comes from the evaluation sets: ``self_corpus`` lets the target write a user turn
from an empty one, then answer it.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import VerispecError
from .models import CausalLM

FORMAT = 1
HEADS_DIR = Path(__file__).resolve().parent / "heads"  # draft heads shipped with the package, one per target alias


def shipped_head(target_name: str) -> Path:
    """The draft head shipped for a built-in target (``verispec/heads/<alias>.pt``)."""
    path = HEADS_DIR / f"{target_name}.pt"
    if not path.is_file():
        have = sorted(p.stem for p in HEADS_DIR.glob("*.pt"))
        raise VerispecError(f"no draft head ships for target {target_name!r} (shipped: {', '.join(have) or 'none'}); "
                            "train one with 'verispec train-draft' and pass --draft eagle:PATH")
    return path


class _SubsetHead(nn.Module):
    """The target's output head restricted to the rows ``vocab``: a copy of those rows (not a parameter), in
    bfloat16 for drafting and float32 for training.

    bfloat16 halves the bytes a drafted level reads (on a CPU this matrix-vector product is bound by memory
    bandwidth: 16384 x 576 rows took about 3.4 ms per drafted level in float32 and 1.2 ms in bfloat16 here); the draft's law
    only has to be a law, so its rounding costs a little acceptance and no exactness."""

    def __init__(self, full: nn.Module, vocab: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        weight = getattr(full, "weight", None)
        if not isinstance(weight, torch.Tensor) or getattr(full, "bias", None) is not None:
            raise VerispecError("a restricted-vocabulary head needs the target's output head to be a plain bias-free "
                                "linear layer")
        self.register_buffer("weight", weight.detach()[vocab].to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class EagleHead(nn.Module):
    """``fc`` + a one-layer causal LM of the target's architecture sharing its embeddings and output head.

    ``vocab`` (token ids), if given, restricts the head's output to those tokens: the draft's logits cost
    ``len(vocab) / V`` of the full output head, and every other token gets probability 0 (``full_logits``).
    Verification stays exact: the verifiers are exact for any draft law, including one with holes.
    """

    def __init__(self, target: CausalLM, vocab: torch.Tensor | None = None, head_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        cfg = copy.deepcopy(target.hf.config.get_text_config(decoder=True))
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[-1:]
        n_vocab = target.vocab_size
        cfg.vocab_size, cfg.pad_token_id, cfg.tie_word_embeddings = 1, None, False  # no big tables allocated here
        hf = AutoModelForCausalLM.from_config(cfg).float()
        hidden = int(cfg.hidden_size)
        self.fc = nn.Linear(2 * hidden, hidden)
        self.body = hf.base_model  # trainable: its decoder layer and final norm
        # share the target's tables (not parameters of this module: they are never saved or trained here)
        hf.set_input_embeddings(target.hf.get_input_embeddings())
        self.vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.long)
        self.position = None
        if self.vocab is None:
            hf.set_output_embeddings(target.hf.get_output_embeddings())
        else:
            if self.vocab.ndim != 1 or not len(self.vocab) or len(set(self.vocab.tolist())) != len(self.vocab) \
                    or int(self.vocab.min()) < 0 or int(self.vocab.max()) >= n_vocab:
                raise VerispecError(f"a draft vocabulary must be distinct token ids in [0, {n_vocab})")
            hf.set_output_embeddings(_SubsetHead(target.hf.get_output_embeddings(), self.vocab, head_dtype))
            self.position = torch.full((n_vocab,), -1, dtype=torch.long)  # token id -> row of the restricted head
            self.position[self.vocab] = torch.arange(len(self.vocab))
            n_vocab = len(self.vocab)
        hf.config.vocab_size = n_vocab
        self.__dict__["lm"] = CausalLM(hf.eval(), target.tokenizer, name=f"eagle-head[{target.name}]")
        self.__dict__["target"] = target
        self.hidden = hidden

    def own_parameters(self):
        """(name, parameter) of the head itself: everything but the target's shared embedding."""
        return ((n, p) for n, p in self.named_parameters() if not n.startswith("body.embed_tokens"))

    def trainable(self) -> list[nn.Parameter]:
        return [p for _, p in self.own_parameters()]

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``fc([feature; embedding])`` for pairs (f_t, x_{t+1}); any leading shape."""
        emb = self.target.hf.get_input_embeddings()(tokens).to(features.dtype)
        return self.fc(torch.cat([features, emb], dim=-1))

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits over the target's whole vocabulary (-inf outside a restricted vocabulary)."""
        if self.vocab is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.target.vocab_size), float("-inf"))
        out[..., self.vocab] = logits
        return out

    def extra_numel(self) -> int:
        """Numbers this head adds to the target in memory: its own parameters, plus the rows a restricted
        output head copies."""
        n = sum(p.numel() for _, p in self.own_parameters())
        return n + (0 if self.vocab is None else self.lm.hf.get_output_embeddings().weight.numel())

    def head_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.own_parameters()}

    def shape(self) -> dict:
        return {"vocab_size": self.target.vocab_size, "hidden_size": self.hidden,
                "target_layers": self.target.num_layers,
                "draft_vocab": self.target.vocab_size if self.vocab is None else len(self.vocab)}

    def save(self, path: str | Path, meta: dict | None = None, half: bool = True) -> None:
        state = {n: (t.half() if half else t) for n, t in self.head_state().items()}
        vocab = None if self.vocab is None else self.vocab.int()
        torch.save({"format": FORMAT, "state": state, "vocab": vocab, "meta": {**(meta or {}), **self.shape()}}, path)

    @classmethod
    def load(cls, path: str | Path, target: CausalLM) -> "EagleHead":
        path = Path(path)
        if not path.is_file():
            raise VerispecError(f"draft head not found: {path}")
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if blob.get("format") != FORMAT:
            raise VerispecError(f"{path} is not a verispec draft head (format {blob.get('format')})")
        vocab = blob.get("vocab")
        if vocab is not None and (int(vocab.max()) >= target.vocab_size or int(vocab.min()) < 0):
            raise VerispecError(f"{path} does not fit target {target.name!r} (its draft vocabulary has ids beyond "
                                f"the target's {target.vocab_size})")
        head = cls(target, None if vocab is None else vocab.long())
        state = {n: t.float() for n, t in blob["state"].items()}
        missing = set(head.head_state()) - set(state)
        wrong = [k for k, v in head.shape().items() if k in blob["meta"] and blob["meta"][k] != v]
        if missing or state["fc.weight"].shape != head.fc.weight.shape or wrong:
            raise VerispecError(f"{path} does not fit target {target.name!r} (trained for {blob['meta'].get('target')!r})")
        head.load_state_dict(state, strict=False)
        head.meta = blob["meta"]
        return head.eval()


FIXED_PROMPT = "Explain why the sky is blue in a short paragraph."  # a shipped head records its acceptance here
FIXED_TOKENS = 64


def fixed_prompt_acceptance(target: CausalLM, head: EagleHead) -> float:
    """Mean accepted length per step, greedy, chain of 5, on ``FIXED_PROMPT`` (deterministic)."""
    from .decode import generate  # noqa: PLC0415
    from .drafters.eagle import EagleDrafter  # noqa: PLC0415
    from .tree import Tree  # noqa: PLC0415
    from .verifiers import get_verifier  # noqa: PLC0415

    out = generate(target, EagleDrafter(head), get_verifier("chain"), FIXED_PROMPT, tree=Tree.chain(5),
                   max_new_tokens=FIXED_TOKENS, temperature=0.0)
    return out.mean_accepted_length


# ---------------------------------------------------------------- training data

def _user_prefix(tokenizer) -> str | None:
    """The chat-template text up to where a user's message starts (None without a chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    mark = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return text[: text.index(mark)] if mark in text else None


@torch.inference_mode()
def _sample_batch(target: CausalLM, prompts: list[list[int]], max_new: int, temperature: float) -> list[list[int]]:
    pad = target.hf.generation_config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = target.hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, eos_token_id=sorted(target.eos_token_ids) or None, pad_token_id=pad)
    res = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in target.eos_token_ids), len(row))
        res.append(row[:cut])
    return res


def self_corpus(target: CausalLM, n: int, *, prompt_tokens: int = 48, response_tokens: int = 160,
                temperature: float = 0.8, batch: int = 8, seed: int = 0, done: list[list[int]] | None = None,
                on_batch=None) -> list[list[int]]:
    """``n`` token sequences the target writes itself: a user turn written from an empty one, then its answer
    (through the chat template); without a chat template, free text after BOS. ``done`` resumes a corpus;
    ``on_batch(new_sequences)`` is called after each batch (for checkpointing and progress)."""
    tok = target.tokenizer
    if tok is None:
        raise VerispecError("self-generated training data needs the target's tokenizer")
    out = list(done or [])
    prefix = _user_prefix(tok)
    while len(out) < n:
        torch.manual_seed(seed * 1_000_003 + len(out))
        k = min(batch, n - len(out))
        if prefix is None:
            bos = [tok.bos_token_id] if tok.bos_token_id is not None else [0]
            seqs = [bos + s for s in _sample_batch(target, [bos] * k, prompt_tokens + response_tokens, temperature)]
        else:
            start = tok(prefix, add_special_tokens=False)["input_ids"]
            users = _sample_batch(target, [start] * k, prompt_tokens, 1.0)
            texts = [tok.decode(u, skip_special_tokens=True).strip() or "Hello" for u in users]
            chats = [target.encode_prompt(t) for t in texts]
            answers = _sample_batch(target, chats, response_tokens, temperature)
            seqs = [c + a for c, a in zip(chats, answers)]
        out.extend(seqs)
        if on_batch is not None:
            on_batch(seqs)
    return out[:n]


def draft_vocabulary(corpus: list[list[int]], size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``size`` token ids a restricted draft head keeps: ``always`` (end-of-sequence tokens) first, then by
    frequency in the training corpus, then unseen tokens by id (BPE ids roughly follow merge frequency)."""
    counts = torch.bincount(torch.tensor([t for seq in corpus for t in seq], dtype=torch.long), minlength=vocab_size)
    score = counts[:vocab_size].double()
    score[torch.tensor(sorted(always), dtype=torch.long)] = float("inf")
    order = torch.sort(-score, stable=True).indices  # ties (unseen tokens) by id
    return order[:size].sort().values


@torch.inference_mode()
def features(target: CausalLM, seq: list[int], top_k: int) -> dict[str, torch.Tensor]:
    """The target's features ``[T, H]`` (fp16) and top-k next-token laws (probabilities, indices) of a sequence."""
    out = target.hf(input_ids=torch.tensor([seq]), output_hidden_states=True)
    probs = torch.softmax(out.logits[0].float(), dim=-1)
    p, i = probs.topk(top_k, dim=-1)
    return {"feat": out.hidden_states[-1][0].half(), "p": p.half(), "i": i.int(), "tokens": torch.tensor(seq)}


# ---------------------------------------------------------------- training

@dataclass
class TrainConfig:
    sequences: int = 256
    prompt_tokens: int = 48
    response_tokens: int = 160
    temperature: float = 0.8
    gen_batch: int = 8
    top_k: int = 64
    epochs: int = 4
    batch: int = 4  # sequences per optimiser step
    lr: float = 1e-3
    feature_weight: float = 1.0
    noise: float = 0.05  # uniform noise on input features (EAGLE), as a fraction of their scale
    held_out: float = 0.1  # fraction of sequences kept for validation
    seed: int = 0
    checkpoint_every: int = 50  # optimiser steps
    vocab: int = 16384  # draft vocabulary (the most frequent tokens of the corpus); 0: the target's whole vocabulary


# a corpus of n sequences is the first n of any longer one with these options (each batch is seeded by its start)
CORPUS_KEYS = ("prompt_tokens", "response_tokens", "temperature", "gen_batch", "seed")


def head_loss(head: EagleHead, data: dict[str, torch.Tensor], noise: float = 0.0,
              feature_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one sequence: cross-entropy of the head's law at t+1 against the target's top-k law, plus
    ``feature_weight`` x smooth L1 between predicted and true features; returns (loss, {ce, feat, top1})."""
    f = data["feat"].float()
    tokens = data["tokens"]
    n = f.shape[0] - 1
    x = f[:n]
    if noise:
        x = x + (torch.rand_like(x) - 0.5) * 2 * noise * x.abs().mean()
    out = head.lm.hf(inputs_embeds=head.inputs(x, tokens[1:n + 1])[None], position_ids=torch.arange(n)[None],
                     output_hidden_states=True)
    pred = out.hidden_states[-1][0]
    logq = torch.log_softmax(out.logits[0].float(), dim=-1)
    p, idx = data["p"][1:].float(), data["i"][1:].long()
    top1 = (logq.argmax(-1) == (idx[:, 0] if head.vocab is None else head.position[idx[:, 0]])).float()
    if head.vocab is not None:  # a restricted head is trained on the target's law conditioned on its vocabulary
        idx = head.position[idx]
        p = p * (idx >= 0)
        idx = idx.clamp(min=0)
    ce = -(p * logq.gather(1, idx)).sum(-1) / p.sum(-1).clamp(min=1e-9)
    feat = nn.functional.smooth_l1_loss(pred, f[1:], reduction="none").mean(-1)
    loss = ce.mean() + feature_weight * feat.mean()
    return loss, {"ce": float(ce.mean().detach()), "feat": float(feat.mean().detach()), "top1": float(top1.mean())}


def train(target: CausalLM, out_dir: str | Path, config: TrainConfig, *, resume: bool = True,
          progress: bool = True, log=print, max_steps: int | None = None) -> Path:
    """The whole pipeline into ``out_dir``: self-generated corpus (``corpus.jsonl``), target features, training
    with checkpoints (``checkpoint.pt``) and a log (``log.jsonl``), then ``head.pt``. Each stage resumes."""
    from tqdm import tqdm  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    if cfg_path.exists() and resume:  # the corpus can be reused by a run with other training options
        old = json.loads(cfg_path.read_text())
        diff = sorted(k for k in CORPUS_KEYS if old.get(k) != getattr(config, k))
        if diff:
            raise VerispecError(f"{out} holds a corpus made with another configuration ({', '.join(diff)}); "
                                "use another --out or the same options")
    cfg_path.write_text(json.dumps(asdict(config), indent=1))

    # 1. corpus
    corpus_path = out / "corpus.jsonl"
    done = [json.loads(line) for line in corpus_path.open()] if corpus_path.exists() and resume else []
    if len(done) < config.sequences:
        bar = tqdm(total=config.sequences, initial=len(done), desc="self-generated data", unit="seq",
                   disable=not progress)
        with corpus_path.open("a" if done else "w") as f:
            def keep(seqs):
                for s in seqs:
                    f.write(json.dumps(s) + "\n")
                f.flush()
                bar.update(len(seqs))

            corpus = self_corpus(target, config.sequences, prompt_tokens=config.prompt_tokens,
                                 response_tokens=config.response_tokens, temperature=config.temperature,
                                 batch=config.gen_batch, seed=config.seed, done=done, on_batch=keep)
        bar.close()
    else:
        corpus = done[: config.sequences]

    # 2. features (about 0.4 s per sequence on 2 CPU cores; kept in features.pt so that a resumed run reuses them)
    feat_path = out / "features.pt"
    data, usable = [], [s for s in corpus if len(s) > 2]
    if feat_path.exists() and resume:
        blob = torch.load(feat_path, map_location="cpu", weights_only=True)
        cached = blob["data"][: len(usable)]
        if blob["top_k"] == config.top_k and [d["tokens"].tolist() for d in cached] == usable[: len(cached)]:
            data = cached
    if len(data) < len(usable):
        data += [features(target, s, config.top_k) for s in tqdm(usable[len(data):], desc="target features",
                                                                 disable=not progress)]
        torch.save({"top_k": config.top_k, "data": data}, feat_path)
    rnd = random.Random(config.seed)
    order = list(range(len(data)))
    rnd.shuffle(order)
    n_val = max(1, int(len(data) * config.held_out))
    val, trn = [data[i] for i in order[:n_val]], [data[i] for i in order[n_val:]]

    # 3. training (the target's own weights stay frozen: only the head's are trained)
    for p in target.hf.parameters():
        p.requires_grad_(False)
    torch.manual_seed(config.seed)
    vocab = None
    if 0 < config.vocab < target.vocab_size:
        vocab = draft_vocabulary(corpus, config.vocab, target.vocab_size, always=target.eos_token_ids)
    head = EagleHead(target, vocab, head_dtype=torch.float32)
    opt = torch.optim.AdamW(head.trainable(), lr=config.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(trn) / config.batch)
    total = steps_per_epoch * config.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    step = 0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists() and resume:
        blob = torch.load(ckpt, map_location="cpu", weights_only=False)
        if blob.get("config") != asdict(config):
            raise VerispecError(f"{ckpt} was trained with other options; delete it to train again with these")
        head.load_state_dict(blob["head"], strict=False)
        opt.load_state_dict(blob["opt"])
        sched.load_state_dict(blob["sched"])
        step = blob["step"]
        log(f"resuming training at step {step} of {total}")
    log_f = (out / "log.jsonl").open("a")
    bar = tqdm(total=total, initial=step, desc="training", unit="step", disable=not progress)
    head.train()
    t0 = time.time()
    while step < total and (max_steps is None or step < max_steps):
        epoch, k = divmod(step, steps_per_epoch)
        perm = list(range(len(trn)))
        random.Random(config.seed * 1000 + epoch).shuffle(perm)
        idx = perm[k * config.batch:(k + 1) * config.batch]
        opt.zero_grad()
        stats = {"ce": 0.0, "feat": 0.0, "top1": 0.0}
        for i in idx:
            loss, s = head_loss(head, trn[i], config.noise, config.feature_weight)
            (loss / len(idx)).backward()
            for key in stats:
                stats[key] += s[key] / len(idx)
        nn.utils.clip_grad_norm_(head.trainable(), 1.0)
        opt.step()
        sched.step()
        step += 1
        rec = {"step": step, "epoch": epoch, "lr": sched.get_last_lr()[0], **stats, "elapsed_s": time.time() - t0}
        if step % config.checkpoint_every == 0 or step == total:
            rec.update({f"val_{k}": v for k, v in evaluate(head, val).items()})
            torch.save({"head": head.head_state(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                        "config": asdict(config)}, ckpt)
            head.train()
        log_f.write(json.dumps(rec) + "\n")
        log_f.flush()
        bar.set_postfix_str(f"ce {stats['ce']:.3f} top1 {stats['top1']:.2f}")
        bar.update(1)
    bar.close()
    log_f.close()
    head.eval()
    final = out / "head.pt"
    if step >= total:
        meta = {"target": target.name, "config": asdict(config), "sequences": len(data), "validation": evaluate(head, val),
                "steps": step}
        head.save(final, meta)
        log(f"wrote {final}: validation {meta['validation']}")
    return final


@torch.no_grad()
def evaluate(head: EagleHead, data: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Mean cross-entropy, feature loss and top-1 agreement with the target on held-out sequences."""
    head.eval()
    acc = {"ce": 0.0, "feat": 0.0, "top1": 0.0}
    for d in data:
        _, s = head_loss(head, d)
        for k in acc:
            acc[k] += s[k] / len(data)
    return acc
