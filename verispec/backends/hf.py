"""Hugging Face causal-LM adapter: prefill, one forward over a token tree, KV-cache commit.

The adapter works on unmodified ``transformers`` models: a tree forward passes a 4-D attention mask
and explicit position ids, and the KV cache is a plain ``DynamicCache`` whose entries are compacted
after verification (keep the committed prefix and the accepted root-to-leaf path, drop the rest; ``kv``).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from ..errors import VerispecError
from . import kernels, native
from . import lean as lean_forward
from .base import ForwardOutput, decode, encode_prompt
from .kv import KVState, new_cache


class CausalLM:
    """A causal LM with its tokenizer, driven through explicit KV states.

    ``lean``: run the forward with ``LeanLlama`` (``backends/lean.py``) when the model is one it supports; it reads
    the model's modules and changes nothing in them. ``VERISPEC_STOCK_FORWARD=1`` keeps the ``transformers`` forward
    everywhere."""

    backend = "hf"

    def __init__(self, hf_model, tokenizer=None, name: str = "model", lean: bool = True):
        self.hf = hf_model.eval()
        self.tokenizer = tokenizer
        self.name = name
        cfg = hf_model.config.get_text_config(decoder=True)
        self.config = cfg
        head = hf_model.get_output_embeddings()
        weight = getattr(head, "weight", None)  # a quantised head has a method here, not a tensor
        self.vocab_size = int((weight if isinstance(weight, torch.Tensor) else hf_model.get_input_embeddings().weight).shape[0])
        self.num_layers = int(cfg.num_hidden_layers)
        layer_types = list(getattr(cfg, "layer_types", None) or [])
        self._sliding_window = getattr(cfg, "sliding_window", None) if "sliding_attention" in layer_types else None
        self.max_context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = self._eos_ids()
        # the dtype the layers compute in (a draft head may share a table of another dtype with its target)
        self._dtype = next((p.dtype for n, p in hf_model.named_parameters() if "embed_tokens" not in n),
                           next(hf_model.parameters()).dtype)
        use_lean = lean and os.environ.get("VERISPEC_STOCK_FORWARD") != "1" and lean_forward.supports(hf_model)
        self._lean = lean_forward.LeanLlama(hf_model) if use_lean else None

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        gen = getattr(self.hf, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(s) for s in source)
        return frozenset(ids)

    # ---------- text ----------
    def encode_prompt(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        """Token ids for a user prompt, through the chat template when the tokenizer has one."""
        return encode_prompt(self.tokenizer, prompt, chat, self.name)

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    @property
    def forward_id(self) -> str:
        """What a forward computes with: the model, its dtype, its kernel plan, the native kernels it runs (by
        their build names, raised when a kernel changes), the forward implementation and torch's threads."""
        plan = next((getattr(m, "_verispec_plan", None) for m in self.hf.modules() if type(m) is nn.Linear), None)
        dtype = "" if self._dtype == torch.float32 else f"|{str(self._dtype).removeprefix('torch.')}"
        place = "" if self.device.type == "cpu" else f"|{self.device.type}"
        linear = f"|{native.linear_name()}" if plan and kernels.NATIVE in plan and native.linear() is not None else ""
        lean = ""
        if self._lean is not None:
            lean = f"|lean{self._lean.REVISION}" + (f"+{native.NAME}" if self._lean.native is not None else "") + \
                (f"+{native.ATTENTION_F32_NAME}" if self._lean.fused is not None else "") + \
                (f"+{native.ROPE_NAME}" if self._lean.rotary is not None else "")
        return f"hf|{self.name}|{torch.get_num_threads()}|{plan}|{torch.__version__}" + linear + lean + dtype + place

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model's layers compute in."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (the CPU, unless ``load`` was given another device)."""
        return next(self.hf.parameters()).device

    # ---------- KV cache ----------
    def new_state(self) -> KVState:
        return KVState(cache=self._lean.new_cache() if self._lean is not None else new_cache())

    def state_pool(self, slots: int, capacity: int):
        """States for a batch of up to ``slots`` sequences of at most ``capacity`` cache entries each, in one buffer
        per layer (``lean.SlotPool``: the batch's attention is one call per layer); None where this model runs the
        ``transformers`` forward (its batches copy the caches side by side instead)."""
        if self._lean is None:
            return None
        lean = self._lean
        return StatePool(lean_forward.SlotPool(lean.n_layers, slots, lean.kv_heads, capacity, lean.head_dim,
                                               dtype=lean.cache_dtype))

    @torch.inference_mode()
    def forward(
        self, state: KVState, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None, last_logits_only: bool = False,
        features: tuple[int, ...] = (-1,),
    ) -> ForwardOutput:
        """Run ``tokens [n]`` at ``positions [n]`` on top of ``state``.

        ``attend [n, pending + n]`` (bool) says which pending entries (earlier uncommitted tree nodes, then
        these n tokens) each token sees; committed entries are always visible. Appends n pending entries.
        ``inputs_embeds [n, H]``, if given, replaces the embedding of ``tokens`` (draft heads feed features).
        ``last_logits_only`` computes the output head for the last token only (a prefill needs no more).
        ``features`` picks the hidden states returned, concatenated: indices into Hugging Face's
        ``hidden_states`` (0: embeddings, i: after layer i, -1: the last, after the final norm).
        """
        n = int(tokens.shape[0])
        if attend.shape != (n, state.pending + n):
            raise ValueError(f"attend must have shape {(n, state.pending + n)}, got {tuple(attend.shape)}")
        visible = torch.cat([torch.ones(n, state.committed, dtype=torch.bool), attend.bool()], dim=1)
        if self._lean is not None:
            logits, hidden = self._lean.forward(state.cache, tokens, positions, visible, inputs_embeds,
                                                last_logits_only, features)
            state.pending_positions.extend(int(p) for p in positions)
            return ForwardOutput(logits=logits.float(), hidden=hidden)
        mask = self._float_mask(visible)
        if self._sliding_window is not None:
            kpos = torch.cat([torch.arange(state.committed), torch.tensor(state.pending_positions, dtype=torch.long), positions])
            near = (positions[:, None] - kpos[None, :]) < self._sliding_window
            mask = {"full_attention": mask, "sliding_attention": self._float_mask(visible & near)}
        inputs = {"input_ids": tokens.view(1, n)} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        out = self.hf(
            **inputs,
            position_ids=positions.view(1, n),
            attention_mask=mask,
            cache=state.cache,
            use_cache=True,
            output_hidden_states=True,
            **({"logits_to_keep": 1} if last_logits_only else {}),
        )
        state.pending_positions.extend(int(p) for p in positions)
        hs = out.hidden_states
        hidden = hs[features[0]][0] if len(features) == 1 else torch.cat([hs[i][0] for i in features], dim=-1)
        return ForwardOutput(logits=out.logits[0].float(), hidden=hidden)

    @torch.inference_mode()
    def forward_batch(self, states: list[KVState], tokens: list[torch.Tensor], positions: list[torch.Tensor],
                      attends: list[torch.Tensor], features: tuple[int, ...] = (-1,),
                      inputs_embeds: list[torch.Tensor] | None = None,
                      logits_from: list[int] | None = None) -> list[ForwardOutput]:
        """``forward`` for several sequences in one pass of the model, each on its own state (its tokens see its
        own cache and its own ``attend`` only); one ``ForwardOutput`` per sequence. The lean forward runs every
        linear layer once over all rows and attention per sequence; the ``transformers`` forward runs the rows as
        one packed sequence over a copy of all the caches side by side, masked so that no row sees another
        sequence's entries. ``logits_from[i]``: sequence i's logits start at that row of its new tokens (at least
        the last comes; None: every row), so that rows nobody reads (a prompt's) can skip the output layer."""
        sizes = [int(t.shape[0]) for t in tokens]
        first = [0] * len(sizes) if logits_from is None else [min(max(f, 0), n - 1) for f, n in zip(logits_from, sizes)]
        if len(states) == 1 and self._lean is None:  # one sequence: the plain forward
            embeds = None if inputs_embeds is None else inputs_embeds[0]
            out = self.forward(states[0], tokens[0], positions[0], attends[0], embeds, first[0] == sizes[0] - 1,
                               features)
            return [ForwardOutput(logits=out.logits[first[0] - sizes[0]:], hidden=out.hidden)]
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a state appears twice in one batch")
        visible = []
        for state, tok, att in zip(states, tokens, attends):
            n = int(tok.shape[0])
            if att.shape != (n, state.pending + n):
                raise ValueError(f"attend must have shape {(n, state.pending + n)}, got {tuple(att.shape)}")
            visible.append(torch.cat([torch.ones(n, state.committed, dtype=torch.bool), att.bool()], dim=1))
        if self._lean is not None:
            outs = self._lean.forward_batch([s.cache for s in states], tokens, positions, visible, inputs_embeds, first,
                                            features)
            for state, pos in zip(states, positions):
                state.pending_positions.extend(int(p) for p in pos)
            return [ForwardOutput(logits=lg.float(), hidden=hd) for lg, hd in outs]
        return self._packed_forward(states, tokens, positions, visible, features, inputs_embeds, first)

    def _packed_forward(self, states, tokens, positions, visible, features, inputs_embeds, first) -> list[ForwardOutput]:
        """The ``transformers`` forward of a batch: the sequences' caches copied side by side into one cache, the
        new rows after them, a mask that keeps each row to its own sequence; the new entries go back to each state."""
        lengths = [s.committed + s.pending for s in states]
        sizes = [int(t.shape[0]) for t in tokens]
        cached, rows = sum(lengths), sum(sizes)
        packed = new_cache()
        if cached:
            for i in range(self.num_layers):
                held = [s.cache.layers[i] for s, n in zip(states, lengths) if n]  # a state with nothing yet has none
                packed.update(torch.cat([h.keys for h in held], dim=-2), torch.cat([h.values for h in held], dim=-2), i)
        mask = torch.zeros(rows, cached + rows, dtype=torch.bool)
        off = row = 0
        for vis, length, n in zip(visible, lengths, sizes):
            mask[row:row + n, off:off + length] = vis[:, :length]
            mask[row:row + n, cached + row:cached + row + n] = vis[:, length:]
            off, row = off + length, row + n
        pos = torch.cat(positions)
        float_mask = self._float_mask(mask)
        if self._sliding_window is not None:
            kpos = torch.cat([torch.cat([torch.arange(s.committed), torch.tensor(s.pending_positions, dtype=torch.long)])
                              for s in states] + [pos])
            near = (pos[:, None] - kpos[None, :]) < self._sliding_window
            float_mask = {"full_attention": float_mask, "sliding_attention": self._float_mask(mask & near)}
        inputs = {"input_ids": torch.cat(tokens)[None]} if inputs_embeds is None else \
            {"inputs_embeds": torch.cat(inputs_embeds)[None]}
        out = self.hf(**inputs, position_ids=pos[None], attention_mask=float_mask, cache=packed, use_cache=True,
                      output_hidden_states=True)
        hs = out.hidden_states
        hidden = hs[features[0]][0] if len(features) == 1 else torch.cat([hs[i][0] for i in features], dim=-1)
        results, row = [], 0
        for state, p, n, f in zip(states, positions, sizes, first):
            for i, layer in enumerate(packed.layers):
                state.cache.update(layer.keys[..., cached + row:cached + row + n, :],
                                   layer.values[..., cached + row:cached + row + n, :], i)
            state.pending_positions.extend(int(x) for x in p)
            logits = out.logits[0, row + f:row + n]
            results.append(ForwardOutput(logits=logits.float(), hidden=hidden[row:row + n]))
            row += n
        return results

    def _float_mask(self, visible: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(visible.shape, dtype=self._dtype)
        m.masked_fill_(~visible, torch.finfo(self._dtype).min)
        return m[None, None]

    def commit(self, state: KVState, keep: list[int]) -> None:
        """Keep the pending entries ``keep`` (indices among pending entries, in order) and drop the rest."""
        c, p = state.committed, state.pending
        keep = list(keep)
        if any(not 0 <= k < p for k in keep):
            raise ValueError(f"commit indices {keep} out of range for {p} pending entries")
        if keep == list(range(len(keep))):  # a prefix of the pending entries: drop the tail, copy nothing
            _keep_prefix(state, c + len(keep))
        else:  # the committed text and the path's leading prefix stay where they are; the rest moves up
            same = next(i for i, k in enumerate(keep) if k != i)
            _keep_after(state, c + same, torch.tensor([c + k for k in keep[same:]], dtype=torch.long))
        state.committed = c + len(keep)
        state.pending_positions = []

    def rollback(self, state: KVState, n: int) -> None:
        """Drop the last ``n`` committed entries (and any pending ones)."""
        if not 0 <= n <= state.committed:
            raise ValueError(f"cannot roll back {n} of {state.committed} committed entries")
        keep = state.committed - n
        _keep_prefix(state, keep)
        state.committed = keep
        state.pending_positions = []

    def prefill(self, state: KVState, tokens: list[int]) -> torch.Tensor | None:
        """Commit ``tokens`` after the committed prefix (causally); return the logits of the last one."""
        out = self.prefill_output(state, tokens)
        return None if out is None else out.logits[-1]

    def prefill_output(self, state: KVState, tokens: list[int], inputs_embeds: torch.Tensor | None = None,
                       features: tuple[int, ...] = (-1,)) -> ForwardOutput | None:
        """``prefill`` returning the whole output: the last token's logits and every token's hidden state."""
        if state.pending:
            raise ValueError("prefill with uncommitted entries; commit or drop them first")
        if not len(tokens):
            return None
        n = len(tokens)
        pos = torch.arange(state.committed, state.committed + n)
        out = self.forward(state, torch.as_tensor(tokens), pos, torch.ones(n, n, dtype=torch.bool).tril(), inputs_embeds,
                           last_logits_only=True, features=features)
        self.commit(state, list(range(n)))
        return out

    # ---------- self-drafting ----------
    def layer_subset(self, layers: list[int]) -> "CausalLM":
        """A model that runs only ``layers`` of this one, sharing all weights (embeddings, layers, head).

        Nothing is copied: a shallow copy of the two outer modules gets a new layer list and config.
        """
        base = self.hf.base_model
        all_layers = getattr(base, "layers", None)
        if not isinstance(all_layers, nn.ModuleList):
            raise VerispecError(f"layer skipping needs decoder layers at `.layers`; {type(base).__name__} has none")
        layers = list(layers)
        if not layers or any(not 0 <= i < len(all_layers) for i in layers) or layers != sorted(set(layers)):
            raise VerispecError(f"layers must be distinct increasing indices in [0, {len(all_layers)}), got {layers}")
        cfg = copy.deepcopy(self.hf.config)
        text_cfg = cfg.get_text_config(decoder=True)
        text_cfg.num_hidden_layers = len(layers)
        if getattr(text_cfg, "layer_types", None):
            text_cfg.layer_types = [text_cfg.layer_types[i] for i in layers]
        new_base = _shallow_module_copy(base)
        new_base._modules["layers"] = nn.ModuleList([all_layers[i] for i in layers])
        new_base.config = text_cfg
        top = _shallow_module_copy(self.hf)
        top._modules[self.hf.base_model_prefix] = new_base
        top.config = cfg
        return CausalLM(top, self.tokenizer, name=f"{self.name}[layers {_ranges(layers)}]")


class StatePool:
    """``KVState``s whose caches are slots of one ``lean.SlotPool``: ``acquire`` one per sequence, ``release`` it when
    the sequence ends (its slot serves the next one)."""

    def __init__(self, pool):
        self.pool = pool

    def acquire(self) -> KVState:
        return KVState(cache=self.pool.cache())

    def release(self, state: KVState) -> None:
        self.pool.release(state.cache)


def quantized_copy(model: "CausalLM") -> "CausalLM":
    """An int8 copy of ``model``: its ``nn.Linear`` layers (decoder and output head) dynamically quantised
    with ``torch.ao.quantization.quantize_dynamic`` (CPU), from float32 whatever ``model`` computes in. A cheap
    draft that shares the target's vocabulary."""
    hf = kernels.plain_copy(model.hf).float()
    hf = torch.ao.quantization.quantize_dynamic(hf, {nn.Linear}, dtype=torch.qint8)
    out = CausalLM(hf, model.tokenizer, name=f"{model.name}[int8]")
    out.vocab_size, out._dtype = model.vocab_size, torch.float32
    return out


def _keep_prefix(state: KVState, n: int) -> None:
    for layer in state.cache.layers:
        layer.keep(n)


def _keep_after(state: KVState, first: int, moved: torch.Tensor) -> None:
    """Keep the first ``first`` cache entries and then the entries ``moved`` (positions along the sequence axis) in
    every cache layer."""
    for layer in state.cache.layers:
        layer.keep_after(first, moved)


def _shallow_module_copy(module: nn.Module) -> nn.Module:
    new = copy.copy(module)
    new.__dict__ = module.__dict__.copy()
    new._modules = module._modules.copy()  # so replacing a child here never touches the original
    return new


def _ranges(idx: list[int]) -> str:
    if idx == list(range(idx[0], idx[-1] + 1)):
        return f"{idx[0]}-{idx[-1]}"
    return ",".join(map(str, idx))
