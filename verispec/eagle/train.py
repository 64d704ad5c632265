"""Training a draft head by distillation on text the target wrote itself (``verispec train-draft``).

For every sequence the target's hidden states (the head's ``feature_layers``) and its top-k next-token laws come
with the corpus (``verispec.eagle.corpus``: the forwards that wrote the text computed them). The head is then
trained to predict the target's law at each position the target wrote as the assistant, at several *depths*,
exactly as the decoding loop drafts (the "training-time test" of HASS and EAGLE-3):

* depth 1: the pair ``(g_j, x_{j+1})`` made from the target's features at j predicts ``x_{j+2}``;
* depth k >= 2: the pair ``(h^{k-1}_j, x_{j+k})`` -- the head's own output one depth up stands in for the features
  the loop does not have -- sits at position ``j + k - 1``, sees the committed pairs ``0..j`` and its own drafted
  ancestors, and predicts ``x_{j+k+1}``.

All depths of a sequence run as successive forwards of the head over one KV cache with explicit 4-D masks, so
gradients flow through the head's own outputs. The loss at depth k is the cross-entropy against the target's
law (conditioned on the draft vocabulary), weighted ``depth_weight ** (k - 1)``; heads that read the last layer
only also pull ``h^1_j`` towards the target's feature at ``j + 1`` (EAGLE-1's feature loss).

``depth_counts`` gives, per depth, top-1 agreement with the target and the *chain* acceptance at temperature 0
(agreement at depth k among the positions whose depths 1..k-1 all agreed): the acceptance a greedy chain sees.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ..errors import VerispecError
from .corpus import FORMAT as CORPUS_FORMAT
from .corpus import CorpusConfig, Record, fill_features, is_corpus, read_corpus, round_features, write_corpus
from .head import EagleHead


@dataclass
class TrainConfig:
    rounds: int = 64  # corpus rounds (each: gen_batch items of one task shape; see verispec.eagle.corpus)
    gen_batch: int = 64
    seed: int = 0
    top_k: int = 64  # target probabilities kept per position
    feature_layers: str = "-1"  # target hidden states the head reads: "-1" (EAGLE-1) or e.g. "3,15,-1" (EAGLE-3)
    decoder_layers: int = 1  # the head's own decoder layers (EAGLE: one)
    depths: int = 3  # training-time test: train depths 1..depths on the head's own outputs
    depth_weight: float = 0.8
    epochs: int = 2
    batch: int = 4  # sequences per optimiser step
    lr: float = 1e-3
    feature_weight: float = 1.0  # EAGLE-1 feature loss (last-layer heads only)
    noise: float = 0.05  # uniform noise on input features (EAGLE), as a fraction of their scale
    held_out: float = 0.05  # fraction of corpus rounds kept for validation
    max_tokens: int = 0  # train on the first training sequences holding N response tokens (0: all): data-size curves
    patience: int = 0  # stop when this many checkpoints in a row do no better on the held-out rounds (0: never)
    checkpoint_every: int = 50  # optimiser steps
    vocab: int = 16384  # draft vocabulary (the most frequent tokens of the corpus); 0: the target's whole vocabulary
    init: str = ""  # a head file to start from (its weights and draft vocabulary) instead of a fresh head
    precision: str = "float32"  # what the head's training forwards and backwards compute in (float32 or bfloat16)
    first_round: int = 0  # train and hold out on rounds first_round..rounds-1 only (rounds added since)

    def selects(self, records: list[Record]) -> list[Record]:
        """The corpus records this configuration trains and validates on (rounds ``first_round..rounds-1``)."""
        return [r for r in records if self.first_round <= r.round < self.rounds]

    def layers(self) -> tuple[int, ...]:
        try:
            out = tuple(int(v) for v in self.feature_layers.split(","))
        except ValueError:
            raise VerispecError(f"bad --feature-layers {self.feature_layers!r}; use e.g. -1 or 3,15,-1") from None
        return out

    def validate(self) -> None:
        if self.rounds < 2 or self.gen_batch < 1 or self.epochs < 1 or self.batch < 1 or self.depths < 1 \
                or not 0 < self.held_out < 1 or self.vocab < 0 or self.top_k < 1 or self.max_tokens < 0 \
                or self.patience < 0 or self.decoder_layers < 1 or not 0 <= self.first_round <= self.rounds - 2:
            raise VerispecError("need --rounds >= 2, --gen-batch, --epochs, --batch, --depths, --top-k, "
                                "--decoder-layers >= 1, "
                                "0 < --held-out < 1, --vocab, --max-tokens and --patience >= 0, and "
                                "0 <= --first-round <= --rounds - 2")
        if self.precision not in ("float32", "bfloat16"):
            raise VerispecError(f"--precision must be float32 or bfloat16, got {self.precision!r}")
        if self.init and not Path(self.init).is_file():
            raise VerispecError(f"--init {self.init}: no such head file")
        self.layers()


TRAIN_HELP = {
    "rounds": "corpus rounds; each writes gen-batch items of one task shape (a longer corpus extends a shorter one)",
    "gen_batch": "items per corpus round, generated as one batch",
    "seed": "seed of the corpus and of training",
    "top_k": "target probabilities kept per position (the distillation label)",
    "feature_layers": "target hidden states the head reads: -1 (the last, EAGLE-1) or several, e.g. 3,15,-1 (EAGLE-3)",
    "decoder_layers": "decoder layers of the head itself (EAGLE uses one; each more costs about as much again per "
                      "drafted level, minus the shared output layer)",
    "depths": "train depths 1..D, the head reading its own outputs from depth 2 on (training-time test); 1: off",
    "depth_weight": "loss weight of depth k is depth-weight^(k-1)",
    "epochs": "passes over the training sequences",
    "batch": "sequences per optimiser step",
    "lr": "peak learning rate (AdamW, warm-up then cosine decay)",
    "feature_weight": "weight of EAGLE-1's feature loss (heads reading the last layer only)",
    "noise": "uniform noise on the input features, as a fraction of their mean magnitude",
    "held_out": "fraction of corpus rounds kept for validation",
    "max_tokens": "train on the first training sequences that hold N response tokens (0: all), for data-size curves",
    "patience": "stop once this many checkpoints in a row do no better on the held-out rounds (0: run the whole "
                "schedule); head.pt is the best checkpoint either way",
    "checkpoint_every": "optimiser steps between checkpoints (and validations on the held-out rounds)",
    "vocab": "draft vocabulary: the head's output layer keeps this many tokens (the corpus's most frequent), cutting "
             "its cost; other tokens get draft probability 0, which every verifier handles exactly. 0: all",
    "precision": "what the head's training forwards and backwards compute in: float32, or bfloat16 (autocast: the "
                 "weights, the optimiser and validation stay float32; about 1.5x the step rate on a CPU with bfloat16 "
                 "arithmetic)",
    "first_round": "train and hold out on corpus rounds first-round..rounds-1 only, e.g. to go on training a head "
                   "(--init) on the rounds added to the corpus since it trained",
    "init": "start from this head file (its weights and its draft vocabulary; --vocab is then unused), e.g. to go on "
            "training an earlier session's head on a grown corpus with a new schedule (the checkpoint, with its "
            "optimiser state, stays in its run folder); with more --decoder-layers than it has, the new layers come "
            "after its own and start by passing their input through, so training starts from its predictions",
}


# ---------------------------------------------------------------- data

def draft_vocabulary(corpus: list[list[int]], size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``size`` token ids a restricted draft head keeps: ``always`` (end-of-sequence tokens) first, then by
    frequency in the training corpus, then unseen tokens by id (BPE ids roughly follow merge frequency)."""
    counts = torch.bincount(torch.tensor([t for seq in corpus for t in seq], dtype=torch.long), minlength=vocab_size)
    score = counts[:vocab_size].double()
    if always:
        score[torch.tensor(sorted(always), dtype=torch.long)] = float("inf")
    order = torch.sort(-score, stable=True).indices  # ties (unseen tokens) by id
    return order[:size].sort().values


# ---------------------------------------------------------------- the loss at every depth

def _mask_arg(head: EagleHead, visible: torch.Tensor):
    """A 4-D additive mask for the head's forward (``visible [q, kv]`` bool)."""
    m = torch.zeros(visible.shape, dtype=torch.float32)
    m.masked_fill_(~visible, torch.finfo(torch.float32).min)
    m = m[None, None]
    types = getattr(head.lm.hf.config, "layer_types", None) or []
    return {"full_attention": m, "sliding_attention": m} if "sliding_attention" in types else m


def depth_outputs(head: EagleHead, data: dict, depths: int, noise: float = 0.0, response_logits: bool = False):
    """Run the head at depths 1..``depths`` over one sequence; yields ``(k, rows j, hidden [n_k, H], logits)``
    (``packed_depths`` of a batch of one)."""
    for k, _, rows, hidden, logits in packed_depths(head, [data], depths, noise, response_logits):
        yield k, rows, hidden, logits


def packed_depths(head: EagleHead, batch: list[dict], depths: int, noise: float = 0.0, response_logits: bool = False):
    """Run the head at depths 1..``depths`` over a batch of sequences packed into one forward a depth (each row
    sees its own sequence's entries only); yields ``(k, seq, rows j, hidden [n_k, H], logits)``, ``seq`` the batch
    index of each row, rows in batch order and by ``j`` within a sequence.

    Depth 1 covers every pair ``j = 0..T-2``; deeper depths only the pairs whose prediction (``x_{j+k+1}``) at
    some depth >= 2 is a response token, so a long prompt costs one pass, not ``depths``. With
    ``response_logits``, each depth's logits are computed only at the rows whose prediction is a response token (what
    the loss reads; the output layer is most of the head's cost, and its gradient then needs no scatter into every
    row's logits), in row order. One forward a depth for the whole batch is what a GPU wants (a step's sequences one
    after another are bound by kernel launches there); a batch of one runs as before packing, causally."""
    from transformers import DynamicCache  # noqa: PLC0415 - a 0.7 s import, needed here only

    lens = [len(d["tokens"]) for d in batch]
    n = [t - 1 for t in lens]
    starts = [0, *itertools.accumulate(n)][:-1]  # each sequence's first row at depth 1
    xs = []
    for d, m in zip(batch, n):  # noise drawn sequence by sequence, at each one's own scale
        x = d["feat"].float()[:m]
        if noise:
            x = x + (torch.rand_like(x) - 0.5) * 2 * noise * x.abs().mean()
        xs.append(x)
    rows = torch.cat([torch.arange(m) for m in n])
    seq = torch.cat([torch.full((m,), b) for b, m in enumerate(n)])
    tokens = [d["tokens"] for d in batch]
    resp = [d["mask"] for d in batch]
    cache = DynamicCache()
    extra = {}
    if len(batch) > 1:  # a sequence's rows see its own earlier pairs only
        extra["attention_mask"] = _mask_arg(head, (seq[:, None] == seq[None, :]) & (rows[None, :] <= rows[:, None]))
    if response_logits:  # rows j predicting x_{j+2}, a response token
        extra["logits_to_keep"] = torch.cat([torch.nonzero(r[2:t]).flatten() + s
                                             for r, t, s in zip(resp, lens, starts)])
    inputs = head.target_inputs(torch.cat(xs), torch.cat([t[1:m + 1] for t, m in zip(tokens, n)]))
    out = head.lm.hf(inputs_embeds=inputs[None], position_ids=rows[None], cache=cache, use_cache=True,
                     output_hidden_states=True, **extra)
    hidden = out.hidden_states[-1][0]
    yield 1, seq, rows, hidden, out.logits[0]
    if depths < 2:
        return
    chosen = []  # per sequence: the pairs some deeper depth predicts a response token from
    for r, t, m in zip(resp, lens, n):
        j = torch.arange(m)
        wanted = torch.zeros(m, dtype=torch.bool)
        for k in range(2, depths + 1):
            ok = j + k + 1 <= t - 1
            wanted[ok] |= r[(j + k + 1)[ok]]
        chosen.append(j[wanted])
    held = sum(n)  # cached entries: depth 1, then one block per deeper depth
    block_at: dict[int, int] = {}  # depth m -> where its block starts in the cache
    block_own: dict[int, list[int]] = {}  # depth m -> where each sequence's rows start in its block
    prev = [(s, torch.arange(m)) for s, m in zip(starts, n)]  # per sequence: its rows in the last output, their j
    for k in range(2, depths + 1):
        cur = [c[c + k <= t - 1] for c, t in zip(chosen, lens)]
        size = sum(len(c) for c in cur)
        if not size:
            return
        parts, keep, at = [], [], 0
        visible = torch.zeros(size, held + size, dtype=torch.bool)
        own = [0] * len(batch)  # where each sequence's rows start in this depth's block
        for b, c in enumerate(cur):
            own[b] = at
            if not len(c):
                continue
            first, prev_j = prev[b]
            parts.append(head.draft_inputs(hidden[first + torch.searchsorted(prev_j, c)],
                                           tokens[b][c + k]))
            idx = torch.arange(at, at + len(c))
            visible[idx, starts[b]:starts[b] + n[b]] = torch.arange(n[b])[None, :] <= c[:, None]  # pairs 0..j
            for m in range(2, k):  # its own entries at depths 2..k-1 (depth k's is being added now)
                block = chosen[b][chosen[b] + m <= lens[b] - 1]
                visible[idx, block_at[m] + block_own[m][b] + torch.searchsorted(block, c)] = True
            visible[idx, held + idx] = True
            if response_logits:
                pred = c + k + 1
                keep.append(torch.nonzero((pred <= lens[b] - 1) & resp[b][pred.clamp(max=lens[b] - 1)]).flatten() + at)
            at += len(c)
        extra = {"logits_to_keep": torch.cat(keep)} if response_logits else {}
        out = head.lm.hf(inputs_embeds=torch.cat(parts)[None],
                         position_ids=torch.cat([c + k - 1 for c in cur])[None],
                         attention_mask=_mask_arg(head, visible), cache=cache, use_cache=True,
                         output_hidden_states=True, **extra)
        hidden = out.hidden_states[-1][0]
        block_at[k], block_own[k] = held, own
        held += size
        prev = [(o, c) for o, c in zip(own, cur)]
        yield k, torch.cat([torch.full((len(c),), b) for b, c in enumerate(cur)]), torch.cat(cur), hidden, out.logits[0]


def _labels(head: EagleHead, data: dict, target_rows: torch.Tensor):
    """The target's top-k law at ``target_rows`` mapped into the head's vocabulary, and its top-1 token there."""
    p, idx = data["p"][target_rows].float(), data["i"][target_rows].long()
    top1 = idx[:, 0]
    if head.vocab is not None:  # a restricted head is trained on the target's law conditioned on its vocabulary
        idx = head.position[idx]
        top1 = idx[:, 0]  # -1 (never matched) when the target's choice lies outside the draft vocabulary
        p = p * (idx >= 0)
        idx = idx.clamp(min=0)
    return p, idx, top1


def _by_sequence(values: torch.Tensor, seq: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]``: the mean of ``values`` over each sequence's rows (0 for a sequence with none)."""
    count = torch.bincount(seq, minlength=size).clamp(min=1)
    return values.new_zeros(size).index_add(0, seq, values) / count


def head_loss(head: EagleHead, data: dict | list[dict], depths: int = 1, noise: float = 0.0,
              feature_weight: float = 1.0, depth_weight: float = 0.8,
              counts: dict | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Training loss of one sequence (see the module docstring), or of a batch of them (a list: the mean of their
    losses, from one packed forward a depth, ``packed_depths``); returns (loss, {ce_k, top1_k, feat}), each
    statistic a mean over the batch's sequences (a sequence with nothing to predict at a depth counting 0 there).

    ``counts``, if given (a dict like ``new_counts(depths)``), is increased by these sequences' ``depth_counts``."""
    batch = data if isinstance(data, list) else [data]
    size = len(batch)
    lens = torch.tensor([len(d["tokens"]) for d in batch])
    offsets = torch.cumsum(lens, 0) - lens  # each sequence's first token in the flat tensors below
    flat = {"p": torch.cat([d["p"].float() for d in batch]), "i": torch.cat([d["i"] for d in batch])}
    resp = torch.cat([d["mask"] for d in batch])
    total, stats = 0.0, {}
    chain: dict[tuple[int, int], bool] = {}
    sparse = counts is None  # only the loss is wanted: logits at the response rows only
    for k, seq, rows, hidden, logits in packed_depths(head, batch, depths, noise, response_logits=sparse):
        last = lens[seq] - 1
        pred = rows + k + 1  # index of the predicted token in its sequence
        inside = pred <= last
        keep = inside & resp[offsets[seq] + pred.clamp(max=last)]
        if k == 1 and feature_weight and head.feature_weight_applies:
            f = torch.cat([d["feat"].float()[1:] for d in batch])
            feat = _by_sequence(nn.functional.smooth_l1_loss(hidden, f, reduction="none").mean(-1), seq, size)
            total = total + feature_weight * feat.sum() / size
            stats["feat"] = float(feat.sum().detach()) / size
        if counts is not None:  # greedy chain: depth k is reached where depths 1..k-1 all agreed
            _, _, top1_all = _labels(head, flat, offsets[seq] + torch.minimum(rows + k, last))
            hit = (logits.max(-1).indices == top1_all).tolist()
            for b, j, h, ok, r in zip(seq.tolist(), rows.tolist(), hit, inside.tolist(), keep.tolist()):
                if not ok:
                    continue
                prior = chain.get((b, j), True) if k > 1 else True
                if r:
                    counts["n"][k - 1] += 1
                    counts["agree"][k - 1] += h
                    counts["reached"][k - 1] += prior
                    counts["accepted"][k - 1] += prior and h
                chain[b, j] = prior and h
        if not keep.any():
            continue
        p, idx, top1 = _labels(head, flat, (offsets[seq] + rows + k)[keep])
        logq = torch.log_softmax((logits if sparse else logits[keep]).float(), dim=-1)
        ce = _by_sequence(-(p * logq.gather(1, idx)).sum(-1) / p.sum(-1).clamp(min=1e-9), seq[keep], size)
        total = total + depth_weight ** (k - 1) * ce.sum() / size
        stats[f"ce_{k}"] = float(ce.sum().detach()) / size
        hit = (logq.max(-1).indices == top1).float()  # max: argmax costs 2.6x here
        stats[f"top1_{k}"] = float(_by_sequence(hit, seq[keep], size).sum()) / size
    if not torch.is_tensor(total):
        total = torch.zeros((), requires_grad=True)
    return total, stats


def new_counts(depths: int) -> dict[str, list[int]]:
    """Per depth k: ``n`` response positions a depth-k draft predicts, ``agree`` (the head's top-1 is the
    target's), and for the greedy chain ``reached`` (depths 1..k-1 all agreed) and ``accepted`` (depth k too)."""
    return {key: [0] * depths for key in ("n", "agree", "reached", "accepted")}


@torch.no_grad()
def depth_counts(head: EagleHead, data: dict, depths: int) -> dict[str, list[int]]:
    """``new_counts`` filled from one sequence (counts add up across sequences)."""
    counts = new_counts(depths)
    head_loss(head, data, depths, counts=counts)
    return counts


def summarize_counts(counts: dict[str, list[int]]) -> dict[str, list[float]]:
    """Rates from ``depth_counts`` sums: per-depth agreement and greedy chain acceptance (NaN where nothing counted)."""
    rate = lambda a, b: [x / y if y else float("nan") for x, y in zip(a, b)]  # noqa: E731
    return {"agreement": rate(counts["agree"], counts["n"]), "chain_acceptance": rate(counts["accepted"],
                                                                                     counts["reached"]),
            "positions": counts["n"]}


@torch.no_grad()
def evaluate(head: EagleHead, data: list[dict], depths: int = 1) -> dict[str, float]:
    """Mean per-sequence losses (``ce_k``, ``feat``), pooled agreement (``top1_k``) and greedy chain acceptance
    (``chain_k``) on held-out sequences."""
    was = head.training
    head.eval()
    acc: dict[str, float] = {}
    counts = new_counts(depths)
    for d in data:
        _, s = head_loss(head, d, depths, counts=counts)
        for k, v in s.items():
            if k.startswith(("ce", "feat")):
                acc[k] = acc.get(k, 0.0) + v / len(data)
    rates = summarize_counts(counts)
    for k, (a, c) in enumerate(zip(rates["agreement"], rates["chain_acceptance"]), start=1):
        acc[f"top1_{k}"], acc[f"chain_{k}"] = a, c
    head.train(was)
    return acc


def held_out_curve(run: Path) -> list[dict]:
    """The held-out validation at each checkpoint of a training run (``run/log.jsonl``'s checkpoint rows, the last
    of each step where a resumed run logged it again): the step and the ``val_`` statistics, kept in the head's file
    so that its curve outlives the run folder."""
    rows: dict[int, dict] = {}
    path = run / "log.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "val_chain_tokens" in rec:
                rows[rec["step"]] = {"step": rec["step"], **{k: v for k, v in rec.items() if k.startswith("val_")}}
    return [rows[k] for k in sorted(rows)]


# ---------------------------------------------------------------- the pipeline

VALIDATION = 200  # held-out sequences a checkpoint is judged on
# a restricted head's output layer (the target's rows, frozen) in training: in bfloat16 its products are 2-3x faster
# here and training 1.25x, but the head learned less (scripts/experiments/train_head_dtype.py; design.md)
TRAIN_HEAD_DTYPE = torch.float32
BUFFER_ROUNDS = 6  # corpus rounds whose features are in memory at once while training


def chain_tokens(val: dict[str, float], depths: int) -> float:
    """Expected tokens a greedy chain of ``depths`` accepts per step (the sum over k of the product of the chain
    acceptances of depths 1..k): what a checkpoint is picked on."""
    total, reach = 0.0, 1.0
    for k in range(1, depths + 1):
        c = val.get(f"chain_{k}", float("nan"))
        reach *= 0.0 if c != c else c
        total += reach
    return total


def _split(records: list[Record], config: TrainConfig) -> tuple[list[int], list[int]]:
    """Indices of (training, validation) records. Whole rounds are held out, so a document's tasks stay together, and
    they are drawn within each task shape (``held_out`` of its rounds), so that validation covers the shapes and no
    shape is held out whole; a corpus too small for that holds out one round of its most frequent shape. The
    validation records come shuffled (a checkpoint is judged on the first ``VALIDATION`` of them)."""
    by_shape: dict[str, list[int]] = {}
    for r in records:
        if r.round not in by_shape.setdefault(r.shape, []):
            by_shape[r.shape].append(r.round)
    rnd = random.Random(config.seed)
    held: set[int] = set()
    for shape in sorted(by_shape):
        rounds = sorted(by_shape[shape])
        held |= set(rnd.sample(rounds, min(len(rounds) - 1, round(len(rounds) * config.held_out))))
    if not held and records:
        most = max(sorted(by_shape), key=lambda sh: len(by_shape[sh]))
        held = {rnd.choice(sorted(by_shape[most]))}
    train = [i for i, r in enumerate(records) if r.round not in held]
    val = [i for i, r in enumerate(records) if r.round in held]
    rnd.shuffle(val)
    return train, val


def _training_split(records: list[Record], config: TrainConfig) -> tuple[list[int], list[int]]:
    """``_split``'s (training, validation) indices with the training ones cut to the first that hold
    ``config.max_tokens`` response tokens (when set)."""
    train_idx, val_idx = _split(records, config)
    if config.max_tokens:
        n, total_tokens = 0, 0
        while n < len(train_idx) and total_tokens < config.max_tokens:
            total_tokens += _response_tokens(records, train_idx[n:n + 1])
            n += 1
        train_idx = train_idx[:n]
    return train_idx, val_idx


def _response_tokens(records: list[Record], idx) -> int:
    """Tokens the target wrote as the assistant in the records ``idx``."""
    return sum(b - a for i in idx for a, b in records[i].spans)


def _layer_ids(n_layers: int, layers) -> list[int]:
    """``hidden_states`` indices with -1 written as ``n_layers`` (the last), in the order given."""
    return [n_layers if i == -1 else i for i in layers]


def _corpus_info(target, config: TrainConfig, store: tuple[int, ...] | None) -> dict:
    layers = store if store is not None else config.layers()
    if not set(_layer_ids(target.num_layers, config.layers())) <= set(_layer_ids(target.num_layers, layers)):
        raise VerispecError(f"--store-layers {list(layers)} must include the feature layers {list(config.layers())}")
    return {"format": CORPUS_FORMAT, "gen_batch": config.gen_batch, "seed": config.seed,
            "layers": sorted(set(_layer_ids(target.num_layers, layers))),
            "top_k": config.top_k, "written_by": target.forward_id}


class _Features:
    """The corpus's features by record, loaded a round at a time and kept for the last ``BUFFER_ROUNDS`` rounds
    asked, with the columns of the head's layers only and ``top_k`` labels."""

    def __init__(self, folder: Path, records: list[Record], info: dict, layers: tuple[int, ...], top_k: int,
                 hidden: int, n_layers: int, device: torch.device | str = "cpu"):
        self.path, self.records, self.top_k, self.device = folder, records, top_k, torch.device(device)
        self.by_round: dict[int, list[int]] = {}
        self.place: dict[int, int] = {}  # record -> its place in its round
        for i, r in enumerate(records):
            self.place[i] = len(self.by_round.setdefault(r.round, []))
            self.by_round[r.round].append(i)
        stored = info["layers"]
        want = _layer_ids(n_layers, layers)
        self.cols = None if want == stored else torch.cat(
            [torch.arange(stored.index(i) * hidden, (stored.index(i) + 1) * hidden, device="cpu") for i in want])
        self.cache: dict[int, list[dict]] = {}

    def __getitem__(self, i: int) -> dict:
        rnd = self.records[i].round
        if rnd not in self.cache:
            if len(self.cache) >= BUFFER_ROUNDS:
                self.cache.pop(next(iter(self.cache)))
            recs = [self.records[j] for j in self.by_round[rnd]]
            data = round_features(self.path, rnd, recs)
            for d in data:
                if self.cols is not None:
                    d["feat"] = d["feat"][:, self.cols].contiguous()
                d["p"], d["i"] = d["p"][:, :self.top_k], d["i"][:, :self.top_k]
                if self.device.type != "cpu":
                    d.update({k: v.to(self.device) for k, v in d.items()})
            self.cache[rnd] = data
        return self.cache[rnd][self.place[i]]


def _epoch_order(records: list[Record], train_idx: list[int], seed: int, epoch: int) -> list[int]:
    """Training records in the order an epoch reads them: rounds shuffled, then the records of each
    ``BUFFER_ROUNDS`` consecutive rounds shuffled together (so that the features in memory stay bounded)."""
    rnd = random.Random(seed * 1000 + epoch)
    by_round: dict[int, list[int]] = {}
    for i in train_idx:
        by_round.setdefault(records[i].round, []).append(i)
    rounds = sorted(by_round)
    rnd.shuffle(rounds)
    order = []
    for b in range(0, len(rounds), BUFFER_ROUNDS):
        group = [i for r in rounds[b:b + BUFFER_ROUNDS] for i in by_round[r]]
        rnd.shuffle(group)
        order += group
    return order


def train(target, out_dir: str | Path, config: TrainConfig, *, resume: bool = True, progress: bool = True, log=print,
          max_steps: int | None = None, until: str | None = None, store_layers: tuple[int, ...] | None = None,
          corpus_dir: str | Path | None = None, max_minutes: float | None = None) -> Path:
    """The whole pipeline into ``out_dir``: the corpus (``text/``, with its features in ``features/``), training
    with checkpoints (``checkpoint.pt``) and a log (``log.jsonl``), then ``head.pt`` (the checkpoint that did best on
    the held-out rounds). Each stage resumes.

    ``until="corpus"`` stops after the corpus and every round's features, ``until="features"`` after the corpus and
    the features of the rounds this training reads (its training and held-out rounds: the writer's dtype computes
    them, the CLI's first stage). ``store_layers`` keeps features of more layers than the head reads (a
    superset of ``feature_layers``), so that heads reading other subsets train on the same corpus. ``corpus_dir``
    trains on the corpus of another run folder (read only; it must hold ``config.rounds`` complete rounds), so that
    several heads (other options, other data sizes) train on one corpus.

    The head trains where the target is (``target.device``: a GPU with ``train-draft --device cuda``, which also
    writes new rounds there, text only with ``generate``, and computes their features by teacher forcing).
    ``max_minutes`` stops training at the first checkpoint past that time and writes ``head.pt`` from the best
    checkpoint so far; with ``until="corpus"`` (or ``"features"``) it begins no corpus round after that time instead.
    The same command resumes either later."""
    config.validate()
    if until not in (None, "corpus", "features"):
        raise VerispecError(f"until must be 'corpus', 'features' or None, got {until!r}")
    if max_minutes is not None and not max_minutes > 0:
        raise VerispecError(f"--max-minutes must be > 0, got {max_minutes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(corpus_dir) if corpus_dir is not None else out
    info = _corpus_info(target, config, store_layers)
    if corpus_dir is not None and not ((source / "config.json").is_file() and is_corpus(source)):
        raise VerispecError(f"{source} holds no corpus of 'verispec train-draft' (config.json and text/)")
    if (source / "config.json").exists() and resume and is_corpus(source):  # one corpus serves many trainings
        had = json.loads((source / "config.json").read_text()).get("corpus")
        if had is None:
            raise VerispecError(f"{source} holds a corpus of an older format (text without features); use another "
                                "folder")
        diff = sorted(k for k in ("format", "gen_batch", "seed") if had.get(k) != info[k])
        if diff:
            raise VerispecError(f"{source} holds a corpus made with another configuration ({', '.join(diff)}); "
                                "use another folder or the same options")
        if not set(_layer_ids(target.num_layers, config.layers())) <= set(had["layers"]) or config.top_k > had["top_k"] \
                or (store_layers is not None and info["layers"] != had["layers"]):
            raise VerispecError(f"{source} keeps features of layers {had['layers']} with top-{had['top_k']} labels; "
                                f"this run asks for layers {info['layers']} and top-{config.top_k} (use another "
                                "folder)")
        info = had
    (out / "config.json").write_text(json.dumps({**asdict(config), "corpus": info,
                                                 **({"corpus_dir": str(source)} if corpus_dir is not None else {})},
                                                indent=1))
    t_start = time.time()

    # 1. corpus, with its features
    records = read_corpus(source) if resume or corpus_dir is not None else []
    done = len({r.round for r in records})
    if done < config.rounds and corpus_dir is not None:
        raise VerispecError(f"{source} holds {done} complete corpus rounds, fewer than --rounds {config.rounds}; "
                            f"extend it with 'verispec train-draft --until corpus --out {source} --rounds "
                            f"{config.rounds}' (its options) or ask for fewer")
    if done < config.rounds:
        bar = tqdm(total=config.rounds, initial=done, desc="self-written corpus", unit="round", disable=not progress)
        written = [sum(b - a for r in records for a, b in r.spans)]

        def tick(i, new):
            written[0] += sum(b - a for r in new for a, b in r.spans)
            bar.set_postfix_str(f"{new[0].shape if new else '-'}: {len(new)} sequences, {written[0]:,} response tokens")
            bar.update(1)

        deadline = t_start + 60 * max_minutes if max_minutes and until in ("corpus", "features") else None
        records = write_corpus(target, source, CorpusConfig(config.rounds, config.gen_batch, config.seed,
                                                                 layers=tuple(info["layers"]), top_k=info["top_k"]),
                               on_round=tick, deadline=deadline)
        bar.close()
        have = len({r.round for r in records})
        if have < config.rounds:  # the deadline came first: no features
            log(f"--max-minutes {max_minutes:g} has passed: {have} of {config.rounds} "
                "corpus rounds written (the same command writes the rest)")
            return source
    records = config.selects(records)
    log(f"corpus: {len(records)} sequences, {sum(len(r.tokens) for r in records):,} tokens, "
        f"{_response_tokens(records, range(len(records))):,} written by the target")
    if until == "corpus":  # every round's features (a checkout's corpus comes without them)
        fill_features(target, source, records, tuple(info["layers"]), info["top_k"], progress)
        return source
    # those of the rounds this training reads, so that a data-size curve's small heads wait for no other round's
    # (whole rounds: a features file holds its round's every record)
    train_idx, val_idx = _training_split(records, config)
    reads = {records[i].round for i in train_idx + val_idx[:VALIDATION]}
    fill_features(target, source, [r for r in records if r.round in reads], tuple(info["layers"]), info["top_k"],
                  progress)
    if until == "features":
        return source

    with torch.device(target.device):  # every tensor of training made where the head is
        return _fit(target, out, config, records, (train_idx, val_idx), source, info, resume=resume,
                    progress=progress, log=log, max_steps=max_steps, max_minutes=max_minutes, t_start=t_start)


def _fit(target, out: Path, config: TrainConfig, records: list[Record], split: tuple[list[int], list[int]],
         source: Path, info: dict, *, resume: bool, progress: bool, log, max_steps: int | None,
         max_minutes: float | None, t_start: float) -> Path:
    """Stage 2 of ``train``: the head trained on the corpus's features, with checkpoints, then ``head.pt``. The
    target's own weights stay frozen: only the head's are trained."""
    response = lambda idx: _response_tokens(records, idx)  # noqa: E731
    train_idx, val_idx = split
    layers = config.layers()
    feats = _Features(source, records, info, layers, config.top_k, target.config.hidden_size, target.num_layers,
                      target.device)
    val = [feats[i] for i in val_idx[:VALIDATION]]
    for p in target.hf.parameters():
        p.requires_grad_(False)
    torch.manual_seed(config.seed)
    vocab, start = None, None
    if config.init:
        start = EagleHead.load(config.init, target)
        if tuple(start.feature_layers) != tuple(layers):
            raise VerispecError(f"{config.init} reads target layers {list(start.feature_layers)}, not the "
                                f"--feature-layers {list(layers)} of this run")
        vocab = start.vocab
        if len(start.body.layers) > config.decoder_layers:
            raise VerispecError(f"{config.init} has {len(start.body.layers)} decoder layers, more than the "
                                f"--decoder-layers {config.decoder_layers} of this run")
    elif 0 < config.vocab < target.vocab_size:
        vocab = draft_vocabulary([records[i].tokens for i in train_idx], config.vocab, target.vocab_size,
                                 always=target.eos_token_ids)
    head = EagleHead(target, vocab, head_dtype=TRAIN_HEAD_DTYPE, feature_layers=layers,
                     decoder_layers=config.decoder_layers).to(target.device)
    if start is not None:
        head.load_state_dict(start.head_state(), strict=False)
        head.pass_through(len(start.body.layers))  # a deeper head grows from it, predicting what it did
    opt = torch.optim.AdamW(head.trainable(), lr=config.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_idx) / config.batch)
    total = steps_per_epoch * config.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    step, best, stale = 0, {"score": -1.0, "step": 0, "state": None}, 0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists() and resume:
        blob = torch.load(ckpt, map_location="cpu", weights_only=False)
        if blob.get("config") != asdict(config):
            raise VerispecError(f"{ckpt} was trained with other options; delete it to train again with these")
        head.load_state_dict(blob["head"], strict=False)
        opt.load_state_dict(blob["opt"])
        sched.load_state_dict(blob["sched"])
        step, best, stale = blob["step"], blob["best"], blob["stale"]
        log(f"resuming training at step {step} of {total}")
    log(f"training on {len(train_idx)} sequences ({response(train_idx):,} response tokens), validating on "
        f"{len(val)} of {len(val_idx)} held-out ones, {total} steps")
    log_f = (out / "log.jsonl").open("a")
    bar = tqdm(total=total, initial=step, desc="training", unit="step", disable=not progress)
    head.train()
    t0 = time.time()
    stopped, why = False, ""
    while step < total and (max_steps is None or step < max_steps):
        epoch, k = divmod(step, steps_per_epoch)
        order = _epoch_order(records, train_idx, config.seed, epoch)
        while k < steps_per_epoch and step < total and (max_steps is None or step < max_steps):
            idx = order[k * config.batch:(k + 1) * config.batch]
            opt.zero_grad()
            with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=config.precision == "bfloat16"):
                loss, stats = head_loss(head, [feats[i] for i in idx], config.depths, config.noise,
                                        config.feature_weight, config.depth_weight)
            loss.backward()
            nn.utils.clip_grad_norm_(head.trainable(), 1.0)
            opt.step()
            sched.step()
            step, k = step + 1, k + 1
            rec = {"step": step, "epoch": epoch, "lr": sched.get_last_lr()[0], **stats, "elapsed_s": time.time() - t0}
            if step % config.checkpoint_every == 0 or step == total:
                v = evaluate(head, val, config.depths)
                score = chain_tokens(v, config.depths)
                rec.update({f"val_{key}": x for key, x in v.items()}, val_chain_tokens=score)
                if score > best["score"]:
                    best, stale = {"score": score, "step": step, "state": head.head_state()}, 0
                else:
                    stale += 1
                stopped = bool(config.patience) and stale >= config.patience
                if max_minutes is not None and time.time() - t_start > 60 * max_minutes and step < total and not stopped:
                    stopped, why = True, f"--max-minutes {max_minutes:g} has passed"
                torch.save({"head": head.head_state(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": step, "config": asdict(config), "best": best, "stale": stale}, ckpt)
                head.train()
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            bar.set_postfix_str(" ".join(f"{k} {stats[k]:.2f}" for k in ("ce_1", "top1_1", "top1_2") if k in stats))
            bar.update(1)
            if stopped:
                break
        if stopped:
            log(f"{why or f'validation has not improved for {config.patience} checkpoints'}: stopping at step {step}")
            break
    bar.close()
    log_f.close()
    final = out / "head.pt"
    if step >= total or stopped:
        if best["state"] is not None:
            head.load_state_dict(best["state"], strict=False)
        head.eval()
        meta = {"target": target.name, "config": asdict(config), "corpus": info, "sequences": len(train_idx),
                "corpus_tokens": sum(len(records[i].tokens) for i in train_idx), "response_tokens": response(train_idx),
                "validation": evaluate(head, val, max(config.depths, 4)), "steps": step, "best_step": best["step"],
                "session_s": time.time() - t_start, "device": target.device.type, "curve": held_out_curve(out),
                **({"stopped_early": why} if why else {})}
        head.save(final, meta)
        log(f"wrote {final} (step {best['step']}): validation {meta['validation']}")
    return final

