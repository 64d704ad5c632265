"""A lean forward for Llama-architecture models (Llama, Qwen2): Hugging Face's arithmetic without its per-call Python.

On this 2-core CPU a one-token forward of SmolLM2-135M through ``transformers`` spends about a quarter of its time
outside the matrix products: module dispatch, mask and rotary-table construction per call, and attention over
key/value heads copied to the query heads' count. ``LeanLlama`` runs the same model (float32 or bfloat16) with a
flat loop over the decoder layers:

* rotary tables computed once (the same float32 products and cosines as ``transformers``, then indexed), and in
  float32 applied in one native call per layer's queries or keys where it builds (``native.rope``: the same
  roundings as the torch expression's seven small operations, bit for bit; a one-row step of the default model at
  400 entries 13.8 -> 12.8 ms on an AVX-512 EPYC: `scripts/experiments/rope_kernel.py`);
* grouped-query attention without copying keys and values (``enable_gqa``), masked by the tree's boolean mask;
* the key/value buffers of ``new_cache``'s layers (``KVBuffer``), without the ``DynamicCache`` around them;
* the linear layers through ``kernels``' plan for the row count (as ``verispec.backends.load`` sets it), straight
  to ``kernels.rows_forward`` without the module call and its checks (measured: 2-3 ms of a 40 ms forward); the
  model's parameters stay where they are. A bfloat16 model's layers run on ``kernels``' prepacked weights instead.
  Where the plan runs the native kernel (float32), a layer's seven linear layers are four of its calls: q, k and v
  stacked as one weight, o, gate and up as one, down (``_native_calls``; the same results bit for bit, in fewer calls
  and without the Python between a module and the kernel; the stacked panels are a copy, in place of the layers' own);
  where the plan runs more than 16 rows on the stock kernel (``kernels.prompt_plan``: where MKL is measured faster for
  a prompt's many rows), a prompt's rows go to it in blocks of ``PROMPT_BLOCK`` and every other row stays on the
  native kernel, whose rows do not depend on their company (``_prompt_runs``);
* in bfloat16, transformers' own arithmetic where it differs: norms with float32 statistics, rotary tables computed
  in float32 and then cast. Attention runs in float32 (the keys, values and queries are bfloat16 values, so the
  upcast is exact): torch's fused CPU attention is several times slower in bfloat16 here. Where the native kernels
  build (``native.attention``) they read a bfloat16 cache directly; elsewhere the cache is float32;
* in float32, where the native kernel builds (``native.attention_f32``, AVX2), the attention of every sequence of
  at most ``POOLED_ROWS`` rows in one call that reads each sequence's keys and values once for all its rows and each
  row only up to its last visible key, with a row's result independent of its batch; the same call writes the
  step's new keys and values into the buffers first and computes the batch's real rows only, in the layout the
  linear layers give and take (``append_attend``: no padded queries, transposes or key writes in Python); elsewhere,
  and for prompt chunks, torch's fused kernel;
* in float32, where the float32 attention kernel serves every sequence of the forward (a pooled batch of short
  sequences, or one on its own cache), all decoder layers in one native call (``native.layer``: the loop's kernels,
  norm and SiLU(gate) * up, and the residual sums in place, bit for bit, without its Python); where it builds, its
  RMS norm and SiLU(gate) * up serve the loop as well (fixed arithmetic, a row's own: within float rounding of
  torch's);
* the attention of a pooled batch whose trees have several rows, where no native kernel runs, as two batched
  products (``_grouped_attention``) instead of torch's fused kernel, which costs about the rows times one row's there.

It reads the model's own modules, so it serves only models whose modules it understands (``supports``); any other
model keeps the ``transformers`` forward. Results differ from that forward by float rounding at most (measured on
SmolLM2-135M: equal logits for a prefill and a 13-node tree, within 2e-5 after a commit; ``tests/test_lean.py``
checks tiny models).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import VerispecError
from . import kernels, native
from .kv import BLOCK, KVBuffer, whole_blocks

MODEL_TYPES = ("llama", "qwen2")  # the same decoder; Qwen2 adds biases to q, k and v
DTYPES = (torch.float32, torch.bfloat16)  # one dtype for every layer; norms and rotary tables as transformers does


def supports(hf_model) -> bool:
    """Whether ``LeanLlama`` computes what ``hf_model``'s own forward does: a float32 or bfloat16 Llama or Qwen2 decoder
    (RMSNorm, SiLU gated MLP, rotary positions without scaling, no sliding window) with plain linear layers."""
    cfg = getattr(hf_model, "config", None)
    base = getattr(hf_model, "model", None)
    if cfg is None or getattr(cfg, "model_type", None) not in MODEL_TYPES or base is None:
        return False
    rotary = getattr(base, "rotary_emb", None)
    if getattr(rotary, "rope_type", None) != "default" or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "layer_types", None) and \
            any(t != "full_attention" for t in cfg.layer_types):
        return False
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    dtype = getattr(getattr(emb, "weight", None), "dtype", None)
    if dtype not in DTYPES:
        return False
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            if type(lin) is not nn.Linear or lin.weight.dtype != dtype:
                return False
    return True


class LeanCache:
    """One ``KVBuffer`` of keys and values ``[kv heads, length, head dim]`` per layer; in a ``SlotPool``, its buffers
    are one slot of the pool's."""

    def __init__(self, n_layers: int, pool: "SlotPool | None" = None, slot: int | None = None):
        self.pool, self.slot = pool, slot
        if pool is None:
            self.layers = [KVBuffer() for _ in range(n_layers)]
        else:
            self.layers = [KVBuffer.in_place(k[slot], v[slot]) for k, v in zip(pool.keys, pool.values)]


class SlotPool:
    """The caches of up to ``slots`` sequences in one buffer per layer (``[slots, kv heads, capacity, head dim]``),
    sized once from the batch and the longest sequence it will hold: a batch's attention then runs as one call per
    layer over every slot (``LeanLlama.forward_batch``), and its memory is bounded from the start."""

    def __init__(self, n_layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        capacity = whole_blocks(capacity)  # room for the invariant attention's padded spans
        self.n_layers, self.capacity = n_layers, capacity
        self.keys = [torch.zeros(slots, kv_heads, capacity, head_dim, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(slots, kv_heads, capacity, head_dim, dtype=dtype) for _ in range(n_layers)]
        self._free = list(range(slots))

    def cache(self) -> LeanCache:
        if not self._free:
            raise RuntimeError("every slot of the pool is in use")
        return LeanCache(self.n_layers, self, self._free.pop(0))  # the lowest free slot: active slots stay low

    def release(self, cache: LeanCache) -> None:
        if cache.pool is self and cache.slot not in self._free:
            self._free.append(cache.slot)
            self._free.sort()


def _linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``module(x)`` for rows ``x [n, K]`` (inside the lean forward: inference mode, on the CPU): a float32 linear
    layer with a plan goes to ``kernels.rows_forward``, anything else (no plan, a bfloat16 layer on its prepacked
    weight, a draft head's restricted output head) to the module's own ``forward``."""
    plan = getattr(module, "_verispec_plan", None)
    return kernels.rows_forward(x, module, plan) if plan is not None else module.forward(x)


def _grouped(groups, bounds: list[int]) -> tuple:
    """``layers_kernel``'s per-group arguments from groups ``(key buffers by layer, value buffers by layer, slot, pos,
    row, visible, limits, span)``: the buffers layer by layer, group by group within a layer, then the row ``bounds``
    and each attention argument as a list over the groups."""
    layers = len(groups[0][0])
    kbufs = [g[0][i] for i in range(layers) for g in groups]
    vbufs = [g[1][i] for i in range(layers) for g in groups]
    return (kbufs, vbufs, bounds, *([g[j] for g in groups] for j in range(2, 8)))


def _norms(parts: list[tuple[nn.Module, ...]]) -> list[torch.Tensor]:
    """Per decoder layer (``LeanLlama._parts``), its input and post-attention norms' weights, as ``layers_kernel``
    takes them."""
    return [p[k]._parameters["weight"] for p in parts for k in (0, 5)]


def _consecutive_causal(positions: torch.Tensor, visible: torch.Tensor) -> bool:
    """Whether a sequence's new rows sit at consecutive positions and each sees the rows before it and itself only
    (``visible [n, cached + n]`` or ``[n, n]``, every cached entry visible): a prompt, or a chunk of one."""
    n = int(positions.shape[0])
    return torch.equal(positions, positions[0] + torch.arange(n, dtype=positions.dtype)) and \
        LeanLlama._plain_causal(visible[:, -n:]) and bool(visible[:, :-n].all())


class LeanLlama:
    """The forward of a Llama-architecture ``transformers`` model (see ``supports``) over explicit KV buffers."""

    REVISION = 10  # raised when its arithmetic or its costs change: measured step costs are cached under it

    TABLE = 8192  # rotary rows computed up front; positions beyond are computed per call

    def __init__(self, hf_model):
        self.hf = hf_model
        cfg = hf_model.config
        self.base = hf_model.model
        self.heads, self.kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.n_layers = len(self.base.layers)
        self.dtype = self.base.get_input_embeddings().weight.dtype
        # bfloat16 rounds every layer's output coarsely, so a last-bit difference in attention can move a logit by a
        # bfloat16 step: its attention is made the same for a row whatever rows and sequences come with it
        self.invariant = self.dtype != torch.float32
        # bfloat16 attention over a bfloat16 cache in native kernels where they build (``native.attention``)
        self.native = native.attention() if self.invariant and self.head_dim == 64 else None
        self.cache_dtype = torch.bfloat16 if self.native is not None else torch.float32
        # float32 attention of short sequences in one native kernel where it builds (``native.attention_f32``)
        self.fused = native.attention_f32() if self.dtype == torch.float32 and self.head_dim == 64 else None
        # float32 rotary positions in one native call where it builds (``native.rope``: torch's roundings)
        self.rotary = native.rope() if self.dtype == torch.float32 else None
        self._calls, self._stamp = None, None  # ``_native_calls``
        # float32 decoder layers in one native call where it builds (``native.layer``: the loop below, bit for bit)
        self.layers_kernel = native.layer() if self.dtype == torch.float32 and self.head_dim == 64 else None
        # its float32 RMS norm, in the loop too (``_rms``): one arithmetic for a row whichever way it goes
        self.norm_kernel = self.layers_kernel if cfg.hidden_size % 8 == 0 else None
        self._layer_args = None  # ``_native_calls``: the panels, biases and widths ``layers_kernel`` takes
        self.cos, self.sin = self._rotary(torch.arange(min(self.TABLE, int(cfg.max_position_embeddings or self.TABLE))))

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[n, head dim]`` as ``transformers``' rotary embedding computes them (in float32, then in the
        model's dtype)."""
        r = self.base.rotary_emb
        freqs = (r.inv_freq[:, None].float() @ positions[None, :].float()).T
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * r.attention_scaling).to(self.dtype), (emb.sin() * r.attention_scaling).to(self.dtype)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[R, head dim]`` of the rows at ``positions`` (contiguous: one row per token, the same for every
        head), from the table computed up front where it reaches."""
        if int(positions.max()) < self.cos.shape[0]:
            return self.cos[positions].contiguous(), self.sin[positions].contiguous()
        cos, sin = self._rotary(positions)
        return cos.contiguous(), sin.contiguous()

    def new_cache(self) -> LeanCache:
        return LeanCache(self.n_layers)

    def _rms(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if x.dtype == torch.float32 and self.norm_kernel is not None:  # the one the decoder layers' call runs
            return self.norm_kernel.rms_norm(x, norm._parameters["weight"], self.eps)
        if x.dtype == torch.float32:  # one call, transformers' arithmetic: equal bit for bit (measured), no faster
            return F.rms_norm(x, (x.shape[-1],), norm.weight, self.eps)
        f = x.float()  # as transformers' RMSNorm: the statistics in float32, the product in the model's dtype
        return norm.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up: the float32 arithmetic of the decoder layers' call where it builds, so that a row has one
        arithmetic whichever way it goes; else torch's."""
        if gate.dtype == torch.float32 and self.norm_kernel is not None:
            return self.norm_kernel.silu_mul(gate, up)
        return F.silu(gate) * up

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [R, heads, head dim]`` at the rows' rotary ``cos`` and ``sin`` ``[R, head dim]``; a fresh float32 ``x``
        (a layer's output) is rotated in place where the native kernel builds, with the same roundings."""
        if self.rotary is not None and x.dtype == torch.float32 and x.is_contiguous():
            self.rotary.rope_(x, cos, sin)
            return x
        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]

    def forward(self, cache: LeanCache, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, last_logits_only: bool = False,
                features: tuple[int, ...] = (-1,)) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens [n]`` at ``positions [n]``; ``visible [n, cached + n]`` (bool) is each token's view of
        the cache and of the new tokens. Returns (logits ``[n or 1, V]``, the ``features`` hidden states
        ``[n, k H]``, indices as in ``transformers``' ``hidden_states``). A batch of one (``forward_batch``)."""
        (out,) = self.forward_batch([cache], [tokens], [positions], [visible],
                                    None if inputs_embeds is None else [inputs_embeds],
                                    [len(positions) - 1] if last_logits_only else None, features)
        return out

    POOLED_ROWS = 16  # a sequence with more rows (a prompt chunk) attends on its own: padding every slot to it costs

    def _pool_plan(self, caches: list[LeanCache], sizes: list[int], visible: list[torch.Tensor]) -> dict | None:
        """Where the rows of a batch's short sequences go in its pool, and the mask of one attention call over the
        used slots; None unless at least two sequences of at most ``POOLED_ROWS`` rows are slots of one pool."""
        pool = caches[0].pool
        if len(caches) < 2 or pool is None or any(c.pool is not pool for c in caches):
            return None
        short = [b for b, n in enumerate(sizes) if n <= self.POOLED_ROWS]
        if len(short) < 2:
            return None
        lengths = [caches[b].layers[0]._len for b in short]
        ends = [n + sizes[b] for n, b in zip(lengths, short)]
        if max(ends) > pool.capacity:
            raise VerispecError(f"a sequence needs {max(ends)} cache entries, more than the {pool.capacity} its batch "
                                "was sized for")
        used, n_max, span = max(caches[b].slot for b in short) + 1, max(sizes[b] for b in short), max(ends)
        if self.invariant:
            span = whole_blocks(span)
            if self.native is None:  # one row doubled where torch's products run (``_attention``)
                n_max = max(n_max, 2)
        mask = torch.zeros(used, 1, n_max, span, dtype=torch.bool)
        mask[:, :, :, 0] = True  # padding rows and idle slots see one entry (finite, and thrown away)
        starts = [0, *itertools.accumulate(sizes)]
        slot, pos, row, rows = [], [], [], []
        for b, length in zip(short, lengths):
            c, n = caches[b], sizes[b]
            mask[c.slot, 0, :n, :] = False
            mask[c.slot, 0, :n, :length + n] = visible[b]
            slot += [c.slot] * n
            pos += range(length, length + n)
            row += range(n)
            rows += range(starts[b], starts[b] + n)
        return {"pool": pool, "short": short, "lengths": lengths, "used": used, "n_max": n_max, "span": span,
                "mask": mask, "slot": torch.tensor(slot), "pos": torch.tensor(pos), "row": torch.tensor(row),
                "rows": torch.tensor(rows), "alone": [b for b in range(len(sizes)) if b not in set(short)],
                "direct": n_max == 1 and slot == list(range(used))}  # one row per slot, slots in batch order

    def _attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: tuple[int, int],
                   cache: LeanCache, visible: torch.Tensor, limits: torch.Tensor | None = None,
                   causal: bool = False, fill: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Layer ``i``'s attention for one sequence's rows ``span`` of the batch, on its own cache; ``causal``: the
        rows are the whole sequence and ``visible`` is the causal mask (``_plain_causal``); ``fill``: where the
        float32 kernel runs, its rows' slot (0), positions and mask rows (``_fill``)."""
        s, e = span
        layer = cache.layers[i]
        if fill is not None:  # the float32 kernel (``fused``): it writes the new entries into the buffer itself
            need = layer.room(k[s:e].transpose(0, 1), self.head_dim)
            o = self.fused.append_attend(q[s:e], k[s:e], v[s:e], layer._kbuf[None], layer._vbuf[None], *fill,
                                         visible[None], limits, need, self.head_dim ** -0.5)
            layer._set_length(need)
            return o.view(e - s, self.heads * self.head_dim)
        keys, values = layer.append(k[s:e].transpose(0, 1), v[s:e].transpose(0, 1))
        qb = q[s:e].transpose(0, 1).contiguous()  # a strided query: a slow kernel
        if not self.invariant:
            mask = None if causal else visible
            o = F.scaled_dot_product_attention(qb[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
                                               enable_gqa=True)
            return o[0].transpose(0, 1).reshape(e - s, self.heads * self.head_dim)
        # ``visible`` comes padded from ``_invariant_mask``: the buffer's spare entries (finite) stand in as keys
        width = visible.shape[1]
        if e - s == 1 and self.native is None:  # two query rows at least: one row goes to a matrix-vector kernel
            qb = qb.expand(-1, 2, -1)  # that sums in its own order (the native kernels treat every row alike)
        keys, values = layer._kbuf[None, :, :width], layer._vbuf[None, :, :width]
        o = self._grouped_attention(qb[None], keys, values, visible[None, None], limits)
        return o[0, :, :e - s].transpose(0, 1).reshape(e - s, self.heads * self.head_dim)

    def _parts(self) -> list[tuple[nn.Module, ...]]:
        """Per decoder layer, the modules the forward reads, read from the modules' own tables (``nn.Module``'s
        attribute lookup costs about a microsecond, and a forward makes some 300): the input norm, q, k, v and o, the
        norm after attention, gate, up and down."""
        out = []
        for layer in self.base.layers._modules.values():
            mods = layer._modules
            a, m = mods["self_attn"]._modules, mods["mlp"]._modules
            out.append((mods["input_layernorm"], a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"],
                        mods["post_attention_layernorm"], m["gate_proj"], m["up_proj"], m["down_proj"]))
        return out

    def _native_calls(self, parts: list[tuple[nn.Module, ...]], rows: int) -> list[list[list[tuple]]] | None:
        """Per decoder layer (``parts``), its linear layers as the native kernel's calls (``kernels.native_calls``) in
        four groups: q, k and v as one weight, o, gate and up as one, down; bit for bit what each layer's own call
        gives, in fewer calls, each without the module's Python. Made on first use and again whenever a layer, weight,
        bias, plan or kind of panels changes (``kernels.native_stamp``); None where the plan does not run the native
        kernel for ``rows`` rows or the layers do not all run it (a bfloat16 model, no native kernel,
        ``VERISPEC_STOCK_LINEAR``): the layers then run one by one (``_linear``)."""
        plan = parts[0][1].__dict__.get("_verispec_plan") if parts and self.dtype == torch.float32 else None
        if plan is None:  # no plan (any longer): no stacked panels kept either
            self._calls = self._stamp = self._layer_args = None
            return None
        if kernels.plan_entry(plan, rows) != kernels.NATIVE:
            return None
        linears = [m for p in parts for m in p if m is not p[0] and m is not p[5]]
        stamp = kernels.native_stamp(linears)
        if stamp != self._stamp:
            flat = kernels.native_calls([g for p in parts for g in (p[1:4], p[4:5], p[6:8], p[8:9])])
            self._calls = None if flat is None else [flat[i:i + 4] for i in range(0, len(flat), 4)]
            self._stamp = stamp
            # ``layers_kernel`` takes one call a group (a group of GGUF blocks of several formats makes more)
            none = torch.empty(0)
            self._layer_args = None if flat is None or any(len(g) != 1 for g in flat) else (
                [g[0][0] for g in flat], [none if g[0][2] is None else g[0][2] for g in flat],
                [w for g in flat for w in g[0][3]])
        return self._calls

    PROMPT_BLOCK = 128  # a prompt's rows meet the linear layers in blocks this long, cut at multiples of its positions

    def _prompt_runs(self, parts: list, sizes: list[int], spans: list[tuple[int, int]], positions: list[torch.Tensor],
                     visible: list[torch.Tensor]) -> list[tuple[int, int, bool]] | None:
        """The forward's rows as runs ``(start, end, prompt)`` for the linear layers, where a float32 plan runs more
        than ``kernels.MAX_ROWS`` rows on another kernel than the native one (``kernels.prompt_entry``: measured
        faster for a prompt's many rows); None elsewhere (every row as the plan runs the forward's row count).

        A sequence of more than ``POOLED_ROWS`` rows at consecutive positions under the causal mask (a prompt, or a
        chunk of one) is cut where its positions reach a multiple of ``PROMPT_BLOCK``, and each cut of more than
        ``MAX_ROWS`` rows is a prompt run, multiplied on its own; every other row (draft trees, a short cut) runs
        in the native kernel, whose rows never depend on their company, whatever the forward's row count. So a
        step's rows get the logits they get alone beside a joining prompt, and a prompt's rows meet the same linear
        products whether it is prefilled whole or in chunks of a multiple of ``PROMPT_BLOCK`` beside other sequences
        (the engine's ``prefill_chunk``)."""
        plan = parts[0][1].__dict__.get("_verispec_plan") if parts and self.dtype == torch.float32 else None
        if plan is None or native.linear() is None or \
                kernels.plan_entry(plan, kernels.MAX_ROWS + 1) == kernels.NATIVE:
            return None
        runs: list[tuple[int, int, bool]] = []
        for (s, e), n, pos, vis in zip(spans, sizes, positions, visible):
            chunked = n > self.POOLED_ROWS and _consecutive_causal(pos, vis)
            cuts = [(s, e)]
            if chunked:
                first = int(pos[0])
                edges = [s, *(s + p - first for p in range(first - first % self.PROMPT_BLOCK + self.PROMPT_BLOCK,
                                                             first + n, self.PROMPT_BLOCK)), e]
                cuts = list(zip(edges, edges[1:]))
            for a, b in cuts:
                prompt = chunked and b - a > kernels.MAX_ROWS
                if runs and not prompt and not runs[-1][2] and runs[-1][1] == a:
                    runs[-1] = (runs[-1][0], b, False)  # short rows run together
                else:
                    runs.append((a, b, prompt))
        return runs

    @staticmethod
    def _short_rows(runs: list[tuple[int, int, bool]]) -> int:
        """The row count whose plan entry runs the short rows of ``runs`` (at most ``MAX_ROWS``: the native kernel's,
        whatever their number; at least one)."""
        return max(1, min(sum(e - s for s, e, prompt in runs if not prompt), kernels.MAX_ROWS))

    @staticmethod
    def _lin(calls: list[list[tuple]], modules: tuple[nn.Module, ...], x: torch.Tensor,
             runs: list[tuple[int, int, bool]] | None) -> list[torch.Tensor]:
        """One group of a layer's linear layers (``modules``, the native ``calls`` of them) on rows ``x``: each prompt
        run of ``runs`` on its own through the plan's kernel for more rows, the other rows in the native calls."""
        if runs is None or not any(prompt for _, _, prompt in runs):
            return kernels.run_native(calls, x)
        if len(runs) == 1:
            return [kernels.rows_forward(x, m, m._verispec_plan) for m in modules]
        outs = [x.new_empty(x.shape[0], m.weight.shape[0]) for m in modules]
        for s, e, prompt in runs:
            ys = [kernels.rows_forward(x[s:e], m, m._verispec_plan) for m in modules] if prompt else \
                kernels.run_native(calls, x[s:e])
            for o, y in zip(outs, ys):
                o[s:e] = y
        return outs

    def _output(self, chosen: torch.Tensor, picked: list[range], runs: list[tuple[int, int, bool]] | None
                ) -> torch.Tensor:
        """The output layer on the ``chosen`` rows (the ``picked`` rows of the forward, in order): as the plan runs
        their count, or with prompt runs (``_prompt_runs``) the rows of each prompt run on its own through the
        plan's kernel for more rows and the others in the native kernel, whatever their number."""
        head = self.hf.get_output_embeddings()
        if runs is None or not any(prompt for _, _, prompt in runs) or getattr(head, "_verispec_plan", None) is None:
            return _linear(chosen, head)
        rows = [r for p in picked for r in p]
        kind = [next(i for i, (s, e, _) in enumerate(runs) if s <= r < e) for r in rows]
        pieces, start = [], 0
        for j in range(1, len(rows) + 1):
            if j == len(rows) or kind[j] != kind[start]:
                pieces.append((start, j, runs[kind[start]][2] and j - start > kernels.MAX_ROWS))
                start = j
        short = [i for a, b, prompt in pieces if not prompt for i in range(a, b)]
        out = chosen.new_empty(len(rows), head.weight.shape[0])
        if short:
            dense = head._verispec_plan[:-1] + (kernels.NATIVE,)  # the native kernel for the short rows, however many
            idx = torch.tensor(short)
            out[idx] = kernels.rows_forward(chosen[idx], head, dense)
        for a, b, prompt in pieces:
            if prompt:
                out[a:b] = kernels.rows_forward(chosen[a:b], head, head._verispec_plan)
        return out

    def _run_layers(self, x: torch.Tensor, parts: list, caches: list[LeanCache], pooled: dict | None, alone,
                    fill: dict, masks: dict, limits: dict, cos: torch.Tensor, sin: torch.Tensor,
                    keep: list[int]) -> list[torch.Tensor] | None:
        """Every decoder layer in one call of ``layers_kernel`` (after ``_native_calls`` made its arguments), where the
        float32 kernel attends for every sequence: a pooled batch of short sequences, or one sequence on its own
        cache. Returns x after each layer in ``keep``, then after the last; None elsewhere (the Python loop runs)."""
        if self.layers_kernel is None or self.norm_kernel is None or self._layer_args is None:
            return None
        if pooled is not None and not alone:
            groups = ((pooled["pool"].keys, pooled["pool"].values, *pooled["fill"], pooled["visible"],
                       pooled["limits"], pooled["span"]),)
            after = None
        elif pooled is None and len(caches) == 1 and fill[0] is not None:
            group, after = self._own_attend(caches[0], x.shape[0], fill[0], masks[0], limits[0])
            groups = (group,)
        else:
            return None
        outs = self.layers_kernel.layers(x, _norms(parts), self.eps, *self._layer_args, self.heads, self.kv_heads, cos,
                                         sin, *_grouped(groups, [0, x.shape[0]]), self.head_dim ** -0.5, keep)
        if after is not None:
            for layer in caches[0].layers:
                layer._set_length(after)
        return outs

    def _own_attend(self, cache: LeanCache, rows: int, fill: tuple, mask: torch.Tensor, limits: torch.Tensor
                    ) -> tuple[tuple, int]:
        """``layers_kernel``'s attention group for one sequence's ``rows`` new rows on its own cache (``fill``, ``mask``
        and ``limits`` as ``_fill``, ``_invariant_mask`` and ``_limits`` make them): its layers' key and value buffers,
        with room made for the new entries, and ``append_attend``'s arguments; and the cache's length after them (set
        once the call has written them)."""
        layers = cache.layers
        probe = torch.empty(self.kv_heads, rows, self.head_dim, dtype=self.cache_dtype)  # the new keys' shape
        need = [layer.room(probe, self.head_dim) for layer in layers][0]
        return ([layer._kbuf for layer in layers], [layer._vbuf for layer in layers], *fill, mask[None], limits,
                need), need

    def draft_depth(self, caches: list[LeanCache], positions: list[torch.Tensor], visible: list[torch.Tensor],
                    inputs: tuple, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A draft head's depth in one native call (``native.layer``'s ``draft_depth``) for one sequence or several,
        each on its own cache: ``inputs`` the head's input's arguments for all their rows, in order
        (``EagleHead.depth``: the features or parent outputs, the fuse's slices and call, the embedding table, the
        tokens and the fc's call), then this model's decoder layers (sequence i's new rows at ``positions[i]`` on
        ``caches[i]``, each seeing ``visible[i] [n, cached + n]``; the linear layers read their weights once for every
        row), its final norm and its output layer on the rows ``picked``. Returns (those rows' logits, every row's final-normed hidden state),
        as ``forward`` / ``forward_batch`` with the head's input as ``inputs_embeds`` give them to float rounding; None
        where that call does not run here (no native kernels, a bfloat16 model, a sequence with more rows than the
        float32 attention kernel takes, layers or an output head whose linear layers are not all on the native
        kernel): the caller then runs the forward."""
        sizes = [int(p.shape[0]) for p in positions]
        head = self.hf.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if self.layers_kernel is None or self.fused is None or max(sizes) > self.POOLED_ROWS \
                or self.dtype != torch.float32 or not isinstance(weight, torch.Tensor) \
                or weight.dtype != torch.float32 or getattr(head, "bias", None) is not None:
            return None
        parts = self._parts()
        if self._native_calls(parts, sum(sizes)) is None or self._layer_args is None:
            return None
        pos = positions[0] if len(positions) == 1 else torch.cat(positions)
        cos, sin = self._tables(pos)
        groups, after = [], []
        for cache, n, seen in zip(caches, sizes, visible):
            mask = seen.contiguous()
            group, length = self._own_attend(cache, n, self._fill(cache, n), mask, self._limits(mask[None, None]))
            groups.append(group)
            after.append(length)
        panels, width, _ = kernels.native_args(head)
        logits, hidden = self.layers_kernel.draft_depth(
            *inputs, _norms(parts), self.eps, *self._layer_args, self.heads, self.kv_heads, cos, sin,
            *_grouped(groups, [0, *itertools.accumulate(sizes)]), self.head_dim ** -0.5,
            self.base.norm._parameters["weight"], panels, width, picked)
        for cache, length in zip(caches, after):
            for layer in cache.layers:
                layer._set_length(length)
        return logits, hidden

    @staticmethod
    def _plain_causal(visible: torch.Tensor) -> bool:
        """Whether a sequence's rows are all of it (``visible`` square: nothing cached) under the causal mask: a
        prompt's prefill. torch's fused attention then skips the masked half of its blocks with ``is_causal``
        instead of reading a mask (equal bit for bit, measured: a 789-token prompt's layer 8.7 against 14 ms)."""
        n = visible.shape[0]
        return n > 1 and visible.shape[1] == n and torch.equal(visible, torch.ones(n, n, dtype=torch.bool).tril_())

    def _invariant_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """A sequence's mask for the invariant attention, once per forward: its keys padded with masked entries to
        whole blocks, and one query row doubled where torch's products run (``_attention``)."""
        mask = F.pad(visible, (0, whole_blocks(visible.shape[1]) - visible.shape[1]))
        return mask.expand(2, -1) if mask.shape[0] == 1 and self.native is None else mask

    def _pooled_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: dict) -> torch.Tensor:
        """Layer ``i``'s attention for every sequence of a pooled batch in one call, the rows of the output in batch
        order ``[R, heads x head dim]``: the float32 kernel's ``append_attend``, which writes the new keys and values
        into their slots itself; elsewhere the new keys and values written here, the queries into a padded ``[slots,
        heads, rows, head dim]``, one masked attention over the used slots."""
        keys, values = plan["pool"].keys[i], plan["pool"].values[i]
        if self.fused is not None:  # one call: the new entries written into their slots, every row's attention
            o = self.fused.append_attend(q, k, v, keys, values, *plan["fill"], plan["visible"], plan["limits"],
                                         plan["span"], self.head_dim ** -0.5)
            return o.view(q.shape[0], self.heads * self.head_dim)
        slot, pos, row = plan["slot"], plan["pos"], plan["row"]
        keys[slot, :, pos] = k
        values[slot, :, pos] = v
        if plan["direct"]:  # the padded queries are the rows themselves: no copy in, none out
            qp = q[:, :, None]
        else:
            qp = q.new_zeros(plan["used"], self.heads, plan["n_max"], self.head_dim)
            qp[slot, :, row] = q
        used, span = plan["used"], plan["span"]
        k, v, mask = keys[:used, :, :span], values[:used, :, :span], plan["mask"]
        if plan["n_max"] == 1 and not self.invariant:
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, enable_gqa=True)
        else:
            o = self._grouped_attention(qp, k, v, mask, plan["limits"])
        picked = o[:, :, 0] if plan["direct"] else o[slot, :, row]
        return picked.reshape(q.shape[0], self.heads * self.head_dim)

    @staticmethod
    def _fill(cache: LeanCache, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot, positions and mask rows (int32 ``[n]``) of a sequence's ``n`` new rows in its own cache (slot 0 of its
        buffers), for the float32 kernel's ``append_attend``: the same for every layer, made once per forward."""
        length = cache.layers[0]._len
        return (torch.zeros(n, dtype=torch.int32), torch.arange(length, length + n, dtype=torch.int32),
                torch.arange(n, dtype=torch.int32))

    @staticmethod
    def _limits(mask: torch.Tensor) -> torch.Tensor:
        """``[slots, rows]`` int32: one more than the last key each row of ``mask [slots, 1, rows, span]`` sees (the
        native kernels stop there), computed once per forward."""
        return (mask[:, 0] * torch.arange(1, mask.shape[-1] + 1, dtype=torch.int32)).amax(-1).to(torch.int32)

    def _grouped_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           limits: torch.Tensor | None = None) -> torch.Tensor:
        """``scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)`` as two batched products with the query
        heads of each key/value head stacked as rows: for several slots of several rows each, torch's fused CPU
        kernel costs about the rows times a slot's one-row cost, these products barely more than one row (measured
        here: 8 slots of 2 rows over 300 entries, 0.27 against 0.51 ms a layer; equal to float rounding)."""
        slots, heads, n, hd = q.shape
        kv, span = k.shape[1], k.shape[2]
        group = heads // kv  # query heads h * group .. h * group + group - 1 read key/value head h
        if self.native is not None:  # the bfloat16 cache read by native kernels, invariant by construction
            # each row's keys end at its last visible one (a prompt chunk's rows see a growing prefix)
            limits = self._limits(mask) if limits is None else limits
            scores = self.native.scores(q.reshape(slots, kv, group * n, hd).contiguous(), k, limits, hd ** -0.5)
            scores = scores.view(slots, kv, group, n, span).masked_fill_(~mask[:, :, None], float("-inf"))
            weights = torch.softmax(scores, dim=-1).view(slots, kv, group * n, span)
            return self.native.weighted(weights, v, limits).view(slots, heads, n, hd)
        scores = torch.matmul(q.reshape(slots, kv, group * n, hd), k.transpose(-1, -2)).mul_(hd ** -0.5)
        scores = scores.view(slots, kv, group, n, span).masked_fill_(~mask[:, :, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1).view(slots, kv, group * n, span)
        if not self.invariant:
            return torch.matmul(weights, v).view(slots, heads, n, hd)
        # over a span of whole BLOCKs of keys, one product per block, then the blocks summed in order: a product over
        # the whole span sums in an order that depends on its length (which the batch's longest sequence sets), and
        # a masked block adds zeros. A loop over strided views: one batched product over all blocks copies V first
        # (64 slots over 1600 entries: 17 against 40 ms a layer; about even at 8 slots)
        out = torch.matmul(weights[..., :BLOCK], v[:, :, :BLOCK])
        for s in range(BLOCK, span, BLOCK):
            out.add_(torch.matmul(weights[..., s:s + BLOCK], v[:, :, s:s + BLOCK]))
        return out.view(slots, heads, n, hd)

    @torch.inference_mode()
    def forward_batch(self, caches: list[LeanCache], tokens: list[torch.Tensor], positions: list[torch.Tensor],
                      visible: list[torch.Tensor], inputs_embeds: list[torch.Tensor] | None = None,
                      logits_from: list[int] | None = None,
                      features: tuple[int, ...] = (-1,)) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``forward`` for several sequences at once, each on its own cache: the rows of all of them go through every
        linear layer together (the weights are read once for the whole batch), and each sequence's rows attend to
        its own cache and new tokens only. Returns (logits, hidden) per sequence: the logits of its new rows from
        ``logits_from[i]`` on (at least the last; None: every row), the others skipping the output layer."""
        sizes = [int(p.shape[0]) for p in positions]
        ends = list(itertools.accumulate(sizes))
        spans = [(e - n, e) for n, e in zip(sizes, ends)]
        rows = ends[-1]
        if inputs_embeds is None:
            x = self.base.embed_tokens(tokens[0] if len(tokens) == 1 else torch.cat(tokens))
        else:
            x = inputs_embeds[0] if len(inputs_embeds) == 1 else torch.cat(inputs_embeds)
        pos = positions[0] if len(positions) == 1 else torch.cat(positions)
        cos, sin = self._tables(pos)
        heads, kv, hd = self.heads, self.kv_heads, self.head_dim
        want = {self.n_layers if i == -1 else i for i in features}
        kept = {0: x} if 0 in want else {}
        pooled = self._pool_plan(caches, sizes, visible)
        alone = range(len(caches)) if pooled is None else pooled["alone"]
        masks = {b: self._invariant_mask(visible[b]) if self.invariant else visible[b] for b in alone}
        # the native kernels' row ends; the float32 one runs for a sequence of at most ``POOLED_ROWS`` rows
        kernel = {b: self.native is not None or (self.fused is not None and sizes[b] <= self.POOLED_ROWS)
                  for b in alone}
        limits = {b: self._limits(masks[b][None, None]) if kernel[b] else None for b in alone}
        masks = {b: m.contiguous() if kernel[b] else m for b, m in masks.items()}
        causal = {b: not kernel[b] and not self.invariant and self._plain_causal(visible[b]) for b in alone}
        fill = {b: self._fill(caches[b], sizes[b]) if kernel[b] and self.fused is not None else None for b in alone}
        if pooled is not None:
            native_any = self.native is not None or self.fused is not None
            pooled["limits"] = self._limits(pooled["mask"]) if native_any else None
            if self.fused is not None:
                pooled["visible"] = pooled["mask"][:, 0].contiguous()
                pooled["fill"] = tuple(pooled[name].to(torch.int32) for name in ("slot", "pos", "row"))
        parts = self._parts()
        runs = self._prompt_runs(parts, sizes, spans, positions, visible)
        calls = self._native_calls(parts, rows if runs is None else self._short_rows(runs))
        keep = sorted(i for i in want if 0 < i < self.n_layers)
        ran = None if calls is None else self._run_layers(x, parts, caches, pooled, alone, fill, masks, limits, cos,
                                                          sin, keep)
        if ran is not None:
            kept.update(zip(keep, ran))
            x = ran[-1]
        for i, (norm_in, q_proj, k_proj, v_proj, o_proj, norm_post, gate_proj, up_proj, down_proj) in \
                enumerate(parts if ran is None else ()):
            h = self._rms(x, norm_in)
            if calls is None:
                q, k, v = _linear(h, q_proj), _linear(h, k_proj), _linear(h, v_proj)
            else:  # the rotary kernel rotates a contiguous query or key in place
                q, k, v = self._lin(calls[i][0], (q_proj, k_proj, v_proj), h, runs)
                q, k = q.contiguous(), k.contiguous()
            q = self._rope(q.view(rows, heads, hd), cos, sin)
            k = self._rope(k.view(rows, kv, hd), cos, sin)
            v = v.view(rows, kv, hd)
            if self.dtype != torch.float32:  # attention in float32 (exact upcasts; the module docstring)
                q = q.float()
                if self.native is None:  # the cache too, where no native kernel reads bfloat16
                    k, v = k.float(), v.float()
            outs = [self._attention(i, q, k, v, spans[b], caches[b], masks[b], limits[b], causal[b], fill[b])
                    for b in alone]
            if pooled is None:
                attended = outs[0] if len(outs) == 1 else torch.cat(outs)
            elif not alone:  # every sequence pooled: its rows are the batch's, in order
                attended = self._pooled_attention(i, q, k, v, pooled)
            else:
                idx = pooled["rows"]
                attended = q.new_empty(rows, heads * hd)
                attended[idx] = self._pooled_attention(i, q[idx], k[idx], v[idx], pooled)
                for b, o in zip(alone, outs):
                    attended[spans[b][0]:spans[b][1]] = o
            if calls is None:
                x = x + _linear(attended.to(self.dtype), o_proj)
                h = self._rms(x, norm_post)
                x = x + _linear(self._act(_linear(h, gate_proj), _linear(h, up_proj)), down_proj)
            else:
                x = x + self._lin(calls[i][1], (o_proj,), attended, runs)[0]
                h = self._rms(x, norm_post)
                gate, up = self._lin(calls[i][2], (gate_proj, up_proj), h, runs)
                x = x + self._lin(calls[i][3], (down_proj,), self._act(gate, up), runs)[0]
            if i + 1 in want and i + 1 < self.n_layers:
                kept[i + 1] = x
        if pooled is not None:
            for b, length in zip(pooled["short"], pooled["lengths"]):
                for layer in caches[b].layers:
                    layer._set_length(length + sizes[b])
        out = self._rms(x, self.base.norm)
        kept[self.n_layers] = out
        hidden = torch.cat([kept[self.n_layers if i == -1 else i] for i in features], dim=-1)
        picked = [range(s, e) for s, e in spans] if logits_from is None else \
            [range(min(s + f, e - 1), e) for (s, e), f in zip(spans, logits_from)]
        if len(picked) == 1:
            chosen = out[picked[0].start:picked[0].stop]
        else:
            chosen = out[torch.tensor([r for p in picked for r in p])]
        logits = self._output(chosen, picked, runs)
        bounds = list(itertools.accumulate(len(p) for p in picked))
        return [(logits[b - len(p):b], hidden[s:e]) for p, b, (s, e) in zip(picked, bounds, spans)]
