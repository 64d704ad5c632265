"""The EAGLE-style draft head (Li et al. 2024; EAGLE-3's fused features, Li et al. 2025): one decoder layer of the
target's own architecture (or several: ``decoder_layers``), sharing the target's embeddings and output head.

At a committed position t the head reads the pair ``(g_t, x_{t+1})``: ``g_t`` is made from the target's hidden
states at t and ``x_{t+1}`` is the next token. Its input is ``fc([g_t; embedding(x_{t+1})])``; its own last hidden
state ``h_t`` is read out by the (shared) output head as the draft law of ``x_{t+2}``. A drafted node one level
deeper reads the pair ``(h_t, x_{t+2})``: the head's own output stands in for the target features it does not have.

* ``feature_layers = (-1,)`` (EAGLE-1): ``g_t`` is the target's last hidden state (after its final norm), and
  training also pulls ``h_t`` towards the target's next feature, so that both live in one space.
* several layers (EAGLE-3), e.g. a low, a middle and the last one: each is scaled to unit RMS, concatenated and
  mapped to the hidden size by ``fuse``. Nothing ties ``h_t`` to a target layer; training on the head's own
  outputs (``verispec.eagle.train``, the "training-time test") teaches it to read them.

``feature_layers`` index the target's ``hidden_states`` tuple: 0 is the embedding output, i the output of decoder
layer i, and -1 (or the layer count) the final normed state.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch
from torch import nn

from ..backends import CausalLM, kernels, native
from ..backends.base import ForwardOutput
from ..errors import VerispecError

FORMAT = 2  # format 1 (last-layer features only) still loads
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"  # heads shipped with the package, one per target alias


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
    ``dtype`` (float32 for training). For drafting, by default: a float32 target's rows stay float32 on the native
    kernel where it builds, read from its GGUF blocks where the target's head was de-quantised from them (the default
    model's Q8_0: no rounding, a quarter of the bytes), else from float16 panels; elsewhere bfloat16 where oneDNN
    multiplies it on prepacked weights (without bfloat16 arithmetic a bfloat16 product ran 9.7 ms for 8 rows on an
    AVX2 EPYC, a third of a whole step), else float32. Drafting one level reads this matrix once, so its bytes are
    its cost (design.md, "The draft head reads float16 copies of its weights"). The draft's law only has to be a
    law, so rounding costs acceptance, never exactness."""

    def __init__(self, full: nn.Module, vocab: torch.Tensor, dtype: torch.dtype | None = None):
        super().__init__()
        weight = getattr(full, "weight", None)
        if not isinstance(weight, torch.Tensor) or getattr(full, "bias", None) is not None:
            raise VerispecError("a restricted-vocabulary head needs the target's output head to be a plain bias-free "
                                "linear layer")
        if dtype is None:
            if weight.dtype == torch.float32 and native.linear() is not None:
                dtype = torch.float32
            else:
                dtype = torch.bfloat16 if kernels.packing_available() else torch.float32
        self.register_buffer("weight", weight.detach()[vocab].to(dtype), persistent=False)
        self.bias = None
        self._verispec_half = True  # read by ``kernels.native_rows``: GGUF blocks, else float16 panels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.bfloat16 and not torch.is_grad_enabled() and kernels.packing_available():
            return kernels.packed_rows(x.to(self.weight.dtype).reshape(-1, x.shape[-1]), self) \
                .view(*x.shape[:-1], -1).to(x.dtype)
        if self.weight.dtype == x.dtype == torch.float32 and not torch.is_grad_enabled() and x.numel() \
                and native.linear() is not None:
            return kernels.native_rows(x.reshape(-1, x.shape[-1]), self).view(*x.shape[:-1], -1)
        return nn.functional.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class _InDtype(nn.Module):
    """A module of another dtype than its caller's (a bfloat16 target's output head under a float32 head): the
    input cast to ``dtype``, the output back."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.__dict__["inner"] = inner  # the target's, not this module's: never saved or trained here
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype)).to(x.dtype)


def unit_rms(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """Scale each of the ``chunks`` equal slices of the last axis to unit root-mean-square."""
    parts = x.reshape(*x.shape[:-1], chunks, x.shape[-1] // chunks)
    parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-6)
    return parts.reshape(x.shape)


class EagleHead(nn.Module):
    """``fuse`` (several feature layers only) + ``fc`` + a causal LM of the target's architecture with
    ``decoder_layers`` layers (EAGLE's is one; more cost that much more per drafted level).

    ``vocab`` (token ids), if given, restricts the head's output to those tokens: the draft's logits cost
    ``len(vocab) / V`` of the full output head, and every other token gets probability 0 (``full_logits``).
    Verification stays exact: the verifiers are exact for any draft law, including one with holes.
    """

    def __init__(self, target, vocab: torch.Tensor | None = None, head_dtype: torch.dtype | None = None,
                 feature_layers: tuple[int, ...] = (-1,), decoder_layers: int = 1):
        super().__init__()
        from transformers import AutoModelForCausalLM  # noqa: PLC0415 - a 0.7 s import, needed here only

        layers = tuple(int(i) for i in feature_layers)
        n_layers = target.num_layers
        if not layers or len(set(layers)) != len(layers) or any(not -1 <= i <= n_layers for i in layers):
            raise VerispecError(f"feature layers must be distinct indices in [0, {n_layers}] (or -1 for the last), "
                                f"got {list(feature_layers)}")
        if isinstance(decoder_layers, bool) or not isinstance(decoder_layers, int) or not 1 <= decoder_layers <= n_layers:
            raise VerispecError(f"a draft head has 1 to {n_layers} decoder layers (the target's count), "
                                f"got {decoder_layers!r}")
        self.feature_layers = layers
        cfg = copy.deepcopy(target.hf.config.get_text_config(decoder=True))
        cfg.num_hidden_layers = decoder_layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[-decoder_layers:]
        n_vocab = target.vocab_size
        cfg.vocab_size, cfg.pad_token_id, cfg.tie_word_embeddings = 1, None, False  # no big tables allocated here
        hf = AutoModelForCausalLM.from_config(cfg).float()
        hidden = int(cfg.hidden_size)
        self.fuse = nn.Linear(len(layers) * hidden, hidden, bias=False) if len(layers) > 1 else None
        self.fc = nn.Linear(2 * hidden, hidden)
        self.body = hf.base_model  # trainable: its decoder layers and final norm
        # share the target's tables (not parameters of this module: they are never saved or trained here)
        hf.set_input_embeddings(target.hf.get_input_embeddings())
        # buffers, so that the head moves to a GPU with them (train-draft --device); never saved with the state
        self.register_buffer("vocab", None if vocab is None else torch.as_tensor(vocab, dtype=torch.long),
                             persistent=False)
        self.register_buffer("position", None, persistent=False)
        if self.vocab is None:
            full = target.hf.get_output_embeddings()
            hf.set_output_embeddings(full if target.dtype == torch.float32 else _InDtype(full, target.dtype))
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
        self.meta: dict = {}
        self.blocks: str | None = None  # "q8_0" once its layers draft from Q8_0 blocks (``draft_from_blocks``)

    @property
    def feature_weight_applies(self) -> bool:
        """Whether the head's output can be compared with a target feature (last-layer features only)."""
        return self.feature_layers in ((-1,), (self.target.num_layers,))

    def own_parameters(self):
        """(name, parameter) of the head itself: everything but the target's shared embedding."""
        return ((n, p) for n, p in self.named_parameters() if not n.startswith("body.embed_tokens"))

    def pass_through(self, first: int) -> None:
        """Make decoder layers ``first``.. add nothing to their input (their attention's and MLP's output projections
        zero): a head grown from a ``first``-layer one computes what that one does, to the bit, and its new layers
        learn from there."""
        with torch.no_grad():
            for layer in self.body.layers[first:]:
                for out in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    out.weight.zero_()
                    if out.bias is not None:
                        out.bias.zero_()

    def trainable(self) -> list[nn.Parameter]:
        return [p for _, p in self.own_parameters()]

    def _embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.target.hf.get_input_embeddings()(tokens).to(dtype)

    def target_inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Inputs for committed pairs (target features at t ``[..., k H]``, token t+1); any leading shape."""
        features = features.to(self.fc.weight.dtype)  # a bfloat16 target's features, a float32 head
        g = features if self.fuse is None else self.fuse(unit_rms(features, len(self.feature_layers)))
        return self.fc(torch.cat([g, self._embed(tokens, features.dtype)], dim=-1))

    def draft_inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Inputs for drafted pairs (the head's own output at the parent ``[..., H]``, the drafted token)."""
        return self.fc(torch.cat([hidden, self._embed(tokens, hidden.dtype)], dim=-1))

    def depth(self, states: list, tokens: list[torch.Tensor], positions: list[torch.Tensor], attend: list[torch.Tensor],
              given: torch.Tensor, features: bool, last_only: bool) -> list[ForwardOutput] | None:
        """A depth of drafting in one native call where it runs (``LeanLlama.draft_depth``), for one sequence or a
        batch: the head's input from ``given`` (every sequence's rows, in order) -- the target's features at committed
        pairs (``features``: ``target_inputs``) or the head's own outputs at drafted nodes' parents (``draft_inputs``)
        -- and ``tokens``, then ``lm.forward``'s work on each sequence's rows: appended to ``states[i]`` as pending
        entries at ``positions[i]``, each seeing ``attend[i] [n, pending + n]``; logits of each sequence's last row
        (``last_only``: a prefill's) or of all its rows. The same outputs as ``lm.forward`` / ``lm.forward_batch`` on
        ``target_inputs`` / ``draft_inputs`` to float rounding (bit for bit for one sequence where the kernel plan runs
        the native kernel for its rows: ``tests/test_eagle.py``), with one call where that path makes some 15 and
        their Python, the weights read once for the batch (results.md, "What a depth of the draft head costs"). None
        where it does not run (a bfloat16 target, no native kernels, a head not on the kernel plan, a sequence with
        more rows than the float32 attention kernel takes): the caller then runs the forward."""
        lean = self.lm._lean
        if lean is None or self.fc.weight.dtype != torch.float32 or "_verispec_plan" not in self.fc.__dict__:
            return None
        chunks = len(self.feature_layers) if features and self.fuse is not None else 1
        none = torch.empty(0)
        fuse = kernels.native_args(self.fuse)[:2] if chunks > 1 else (none, 0)
        fc = kernels.native_args(self.fc)
        sizes = [int(t.shape[0]) for t in tokens]
        ends = list(itertools.accumulate(sizes))
        visible = [torch.cat([torch.ones(n, st.committed, dtype=torch.bool), a], dim=1)
                   for st, n, a in zip(states, sizes, attend)]
        picked = torch.tensor([e - 1 for e in ends] if last_only else range(ends[-1]))
        table = self.target.hf.get_input_embeddings().weight
        inputs = (given.float(), chunks, *fuse, table, tokens[0] if len(tokens) == 1 else torch.cat(tokens), *fc)
        out = lean.draft_depth([st.cache for st in states], positions, visible, inputs, picked)
        if out is None:
            return None
        logits, hidden = out
        for st, p in zip(states, positions):
            st.pending_positions.extend(p.tolist())
        rows = [1] * len(sizes) if last_only else sizes
        return [ForwardOutput(logits=lg, hidden=h)
                for lg, h in zip(logits.split(rows), hidden.split(sizes))]

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
                "target_layers": self.target.num_layers, "feature_layers": list(self.feature_layers),
                "draft_vocab": self.target.vocab_size if self.vocab is None else len(self.vocab),
                "decoder_layers": len(self.body.layers)}

    def save(self, path: str | Path, meta: dict | None = None, half: bool = True) -> None:
        state = {n: (t.half() if half else t).cpu() for n, t in self.head_state().items()}
        vocab = None if self.vocab is None else self.vocab.int().cpu()
        torch.save({"format": FORMAT, "state": state, "vocab": vocab, "meta": {**(meta or {}), **self.shape()}}, path)

    @classmethod
    def load(cls, path: str | Path, target) -> "EagleHead":
        path = Path(path)
        if not path.is_file():
            raise VerispecError(f"draft head not found: {path}")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
            raise VerispecError(f"{path} is not a verispec draft head ({type(exc).__name__})") from None
        if not isinstance(blob, dict) or blob.get("format") not in (1, FORMAT):
            raise VerispecError(f"{path} is not a verispec draft head")
        vocab, meta = blob.get("vocab"), blob.get("meta", {})
        if vocab is not None and (int(vocab.max()) >= target.vocab_size or int(vocab.min()) < 0):
            raise VerispecError(f"{path} does not fit target {target.name!r} (its draft vocabulary has ids beyond "
                                f"the target's {target.vocab_size})")
        layers = tuple(meta.get("feature_layers", (-1,)))
        if any(not -1 <= i <= target.num_layers for i in layers):
            raise VerispecError(f"{path} does not fit target {target.name!r} (it reads layers {list(layers)})")
        count = meta.get("decoder_layers", 1)  # heads saved before the option have one
        if not isinstance(count, int) or not 1 <= count <= target.num_layers:
            raise VerispecError(f"{path} does not fit target {target.name!r} (it has {count!r} decoder layers)")
        head = cls(target, None if vocab is None else vocab.long(), feature_layers=layers, decoder_layers=count)
        state = {n: t.float() for n, t in blob["state"].items()}
        missing = set(head.head_state()) - set(state)
        wrong = [k for k, v in head.shape().items() if k in meta and meta[k] != v]
        if missing or state["fc.weight"].shape != head.fc.weight.shape or wrong:
            raise VerispecError(f"{path} does not fit target {target.name!r} (trained for {meta.get('target')!r})")
        head.load_state_dict(state, strict=False)
        head.meta = meta
        if target.dtype != torch.float32:
            head._compute_in(target.dtype)
        else:  # the target's kernel plan for the head's own layers (drafting only: never with autograd on), reading
            # float16 panels: the file's weights are float16 values, so the results are those of float32 panels
            kernels.use_fast_linear(head, half=True)
        return head.eval()

    def draft_from_blocks(self) -> bool:
        """Round the head's own linear layers (``fuse``, ``fc``, its decoder layers) to Q8_0 blocks
        (``kernels.q8_0_values``), which the native kernel reads as blocks: 1.125 bytes a weight instead of float16
        panels' 2, for drafting only (a head trains and saves in float32). A depth's first call after a target forward
        reads the head's weights from memory, not from the caches the target's weights went through, so its bytes are
        much of its cost (results.md, "What a depth of the draft head costs"); its agreement with the target was
        unchanged (0.536 against 0.535 top-1 at depth 1 on 1,674 held-out positions). The output layer is the
        target's own Q8_0 rows already. Only for a float32 head where the native kernel builds; returns whether it
        rounded."""
        if self.blocks is not None:
            return True
        layers = [m for part in (self.fuse, self.fc, self.body) if part is not None for m in part.modules()
                  if type(m) is nn.Linear]
        if native.linear() is None or any(m.weight.dtype != torch.float32 or m.weight.shape[1] % 32 for m in layers):
            return False
        with torch.no_grad():
            for m in layers:
                m.weight.copy_(kernels.q8_0_values(m.weight))  # packed again on next use (its version moved)
        self.blocks = "q8_0"
        return True

    def _compute_in(self, dtype: torch.dtype) -> None:
        """Draft in ``dtype`` (a bfloat16 target's): the head's layers cast and, in bfloat16, on ``kernels``'
        prepacked weights. For drafting only: a head is trained and saved in float32. Only in the target's own dtype:
        the body's embedding is the target's table, which a cast to another dtype would change under the target."""
        if dtype != self.target.dtype:
            raise ValueError(f"a head drafts in its target's dtype ({self.target.dtype}), not {dtype}")
        for part in (self.fuse, self.fc, self.body):
            if part is not None:
                part.to(dtype)  # the body's embedding is the target's own table, already in dtype
        hf = self.lm.hf.eval()
        self.__dict__["lm"] = CausalLM(hf, self.target.tokenizer, name=self.lm.name)
        kernels.use_fast_linear(self)
