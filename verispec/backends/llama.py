"""llama.cpp as a target engine (through ``llama-cpp-python``'s low-level API): the CPU engine people actually run.

The GGUF model as llama.cpp computes it is the target: a quantised model with llama.cpp's own kernels has a law
of its own, and verispec's exactness is relative to it (the Hugging Face backend's de-quantised float32 model is a
different target; their texts are not comparable token for token).

How a token tree runs in one ``llama_decode`` batch: the committed text lives in sequence 0 of a unified KV cache.
Every drafted node is given the sequence ids of the root-to-leaf paths through it -- the first path is sequence 0
itself, a node's first child inherits its ids, each further child gets a fresh id whose cells are copied (tagged, not
moved) from the path so far -- so each token attends exactly to the committed text and its own ancestors. Per-node
logits come from ``llama_get_logits_ith``. Commit keeps the kept path's cells in sequence 0 (tagging them there if
they lie on another path), takes sequence 0's other new cells out of it and removes every other path sequence: no
accepted token is decoded twice, and plain decoding or an accepted chain needs no cache operation at all. Rejected
nodes' cells are not freed but moved to a sequence nothing attends to:
with llama-cpp-python 0.3.36, a token written into a freed cell that lies before cells of its own sequence reads
the wrong context (measured: the next logits differ from a fresh decode), so the cache never gets holes; when it
fills up, the committed text is decoded once more into an empty cache.

Flash attention is on. Exact speculative decoding needs a token's logits to be the same whether it is decoded
alone or in a tree batch; with flash attention llama.cpp gives exactly that (measured: 0.0 difference), without it
the logits of one context differed by up to 1.08 between a batched and a one-token decode of SmolLM2 here, enough
to flip near-ties. The llama.cpp peers in the benchmark run with flash attention too.

``Target`` is the interface (``verispec.backends``); this class also serves as a draft model's engine
(``ModelDrafter``), since drafting levels one at a time is the same operation.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

import torch

from ..errors import VerispecError
from .hf import ForwardOutput

MAX_PATHS = 64  # sequence ids available to one tree (llama.cpp's n_seq_max)
TRASH = MAX_PATHS + 1  # cells of rejected nodes: kept (tagged here, never attended) rather than freed, see commit
_LOG_SINK = None


def available() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("llama_cpp") is not None


def _lib():
    global _LOG_SINK
    if not available():
        raise VerispecError("the llama backend needs llama-cpp-python: pip install 'verispec[llama]' (it compiles "
                            "llama.cpp from source, about 15 minutes on 2 cores)")
    import llama_cpp  # noqa: PLC0415

    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda *a: None)  # kept alive: llama.cpp calls it later
        llama_cpp.llama_log_set(_LOG_SINK, None)
        llama_cpp.llama_backend_init()
    return llama_cpp


@dataclass
class LlamaState:
    """Sequence 0 holds ``committed`` cells; ``pending`` tree nodes carry their positions and sequence ids."""

    committed: int = 0
    tokens: list[int] = field(default_factory=list)  # the committed text (to rebuild the cache when it is full)
    trash: int = 0  # cells held by rejected nodes
    pending_tokens: list[int] = field(default_factory=list)
    pending_positions: list[int] = field(default_factory=list)
    pending_seqs: list[list[int]] = field(default_factory=list)
    next_seq: int = 1
    children: dict[int, int] = field(default_factory=dict)  # pending entry -> how many children it has so far

    @property
    def pending(self) -> int:
        return len(self.pending_positions)


class LlamaCppTarget:
    """A GGUF model run by llama.cpp, with the ``Target`` interface."""

    def __init__(self, path: str, tokenizer=None, name: str = "llama", threads: int | None = None,
                 n_ctx: int = 8192, n_batch: int = 2048):
        L = _lib()
        if not os.path.isfile(path):
            raise VerispecError(f"GGUF file not found: {path}")
        self._L = L
        self.name = name
        self.path = path
        self.tokenizer = tokenizer
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise VerispecError(f"llama.cpp cannot load {path}")
        cp = L.llama_context_default_params()
        threads = threads or torch.get_num_threads()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, min(n_batch, 512)
        cp.n_seq_max, cp.kv_unified = MAX_PATHS + 2, True
        cp.flash_attn_type = 1  # on: with it, logits do not depend on how tokens are batched (measured 0.0)
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise VerispecError(f"llama.cpp cannot make a context for {path}")
        self.mem = L.llama_get_memory(self.ctx)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.vocab_size = int(L.llama_vocab_n_tokens(self.vocab))
        self.max_context = int(L.llama_n_ctx(self.ctx))
        self.n_batch = n_batch
        self.threads = threads
        eos = {int(L.llama_vocab_eos(self.vocab)), int(L.llama_vocab_eot(self.vocab))}
        self.eos_token_ids = frozenset(t for t in eos if t >= 0)
        self._batch = L.llama_batch_init(n_batch, 0, MAX_PATHS + 2)
        self._current: LlamaState | None = None

    def __del__(self):  # pragma: no cover - interpreter shutdown order varies
        try:
            self._L.llama_batch_free(self._batch)
            self._L.llama_free(self.ctx)
            self._L.llama_model_free(self.model)
        except Exception:  # noqa: BLE001
            pass

    # ---------- text ----------
    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        from .hf import CausalLM  # noqa: PLC0415

        return CausalLM.encode_prompt(self, prompt, chat)  # the same rules, with this model's tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ---------- cache ----------
    def new_state(self) -> LlamaState:
        self._L.llama_memory_clear(self.mem, True)  # one sequence at a time: a new state starts an empty cache
        self._current = LlamaState()
        return self._current

    def _check(self, state: LlamaState) -> None:
        if state is not self._current:
            raise VerispecError("a llama.cpp target holds one sequence at a time; this state is no longer current")

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[list[int]], logits: list[bool]) -> None:
        b = self._batch
        for start in range(0, len(tokens), self.n_batch):
            chunk = range(start, min(start + self.n_batch, len(tokens)))
            for row, i in enumerate(chunk):
                b.token[row] = int(tokens[i])
                b.pos[row] = int(positions[i])
                b.n_seq_id[row] = len(seqs[i])
                for k, s in enumerate(seqs[i]):
                    b.seq_id[row][k] = s
                b.logits[row] = bool(logits[i])
            b.n_tokens = len(chunk)
            if self._L.llama_decode(self.ctx, b) != 0:
                raise VerispecError("llama.cpp could not decode the batch (context full?)")

    def _logits(self, rows: list[int]) -> torch.Tensor:
        """The logits of the last batch's output ``rows`` (-1: the last one), copied out of llama.cpp's buffer (the
        next decode overwrites it) by one memmove per row."""
        out = torch.empty(len(rows), self.vocab_size)
        size = self.vocab_size * 4
        for k, i in enumerate(rows):
            ctypes.memmove(out.data_ptr() + k * size, self._L.llama_get_logits_ith(self.ctx, i), size)
        return out

    def forward(self, state: LlamaState, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                inputs_embeds=None, last_logits_only: bool = False, features: tuple[int, ...] = (-1,)) -> ForwardOutput:
        """Run tree tokens on top of ``state``; ``attend [n, pending + n]`` says which pending entries and new tokens
        each one sees (its ancestors and itself). Features are not available from this engine (``hidden`` is empty)."""
        self._check(state)
        if inputs_embeds is not None:
            raise VerispecError("the llama backend takes token ids, not embeddings")
        n = int(tokens.shape[0])
        if attend.shape != (n, state.pending + n):
            raise ValueError(f"attend must have shape {(n, state.pending + n)}, got {tuple(attend.shape)}")
        base = state.pending
        parent = []  # nearest ancestor (an index among pending + new entries), or None
        for i in range(n):
            seen = [j for j in range(base + i) if bool(attend[i, j])]
            parent.append(max(seen) if seen else None)
        kids: dict[int, list[int]] = {}
        for i, par in enumerate(parent):
            if par is not None and par >= base:
                kids.setdefault(par - base, []).append(i)

        def leaves(i: int) -> list[int]:
            return [leaf for c in kids[i] for leaf in leaves(c)] if i in kids else [i]

        # every new leaf gets its own sequence (the first one under an old parent may share the parent's); a node
        # carries the sequences of the leaves below it, so it attends to exactly its ancestors in one batch
        leaf_seqs: dict[int, list[int]] = {}
        for i in range(n):
            if parent[i] is not None and parent[i] >= base:
                continue  # not the root of a new subtree
            for k, leaf in enumerate(leaves(i)):
                leaf_seqs[leaf] = self._seqs_for(state, parent[i], fresh=k > 0)
        seqs = [[]] * n
        for i in reversed(range(n)):
            seqs[i] = leaf_seqs[i] if i not in kids else sorted({s for c in kids[i] for s in seqs[c]})
        if state.committed + state.trash + state.pending + n + self.n_batch > self.max_context:
            self._compact(state)  # rebuild the cache: only the committed text and pending entries (a rare event)
        for i in range(n):
            state.pending_seqs.append(seqs[i])
            state.pending_positions.append(int(positions[i]))
            state.pending_tokens.append(int(tokens[i]))
        rows = [True] * n if not last_logits_only else [i == n - 1 for i in range(n)]
        self._decode(tokens.tolist(), positions.tolist(), seqs, rows)
        logits = self._logits(list(range(n)) if not last_logits_only else [-1])
        return ForwardOutput(logits=logits, hidden=torch.zeros(n, 0))

    def _seqs_for(self, state: LlamaState, parent: int | None, fresh: bool = False) -> list[int]:
        """Sequence ids for a path leaving the already-decoded entry ``parent`` (None: from the committed text): its
        first path inherits the parent's ids, any other gets a fresh id holding a copy of the path so far."""
        key = -1 if parent is None else parent
        count = state.children.get(key, 0)
        state.children[key] = count + 1
        if count == 0 and not fresh:  # the first path from the committed text is sequence 0 itself
            return [0] if parent is None else list(state.pending_seqs[parent])
        if state.next_seq > MAX_PATHS:
            raise VerispecError(f"a tree with more than {MAX_PATHS} root-to-leaf paths does not fit the llama backend")
        s = state.next_seq
        state.next_seq += 1
        source = 0 if parent is None else state.pending_seqs[parent][0]
        upto = state.committed if parent is None else state.pending_positions[parent] + 1
        self._L.llama_memory_seq_cp(self.mem, source, s, -1, upto)  # the committed text and the path so far
        return [s]

    def commit(self, state: LlamaState, keep: list[int]) -> None:
        """Keep the pending entries ``keep`` (a chain from a tree root, in order) in sequence 0; drop the rest."""
        self._check(state)
        keep = list(keep)
        if any(not 0 <= k < state.pending for k in keep):
            raise ValueError(f"commit indices {keep} out of range for {state.pending} pending entries")
        c = state.committed
        if keep and [state.pending_positions[k] for k in keep] != list(range(c, c + len(keep))):
            raise ValueError("the llama backend commits a chain of pending entries right after the committed text")
        in_zero = sum(1 for seqs in state.pending_seqs if seqs[0] == 0)  # the first path: sequence 0's own cells
        kept_seq = state.pending_seqs[keep[-1]][0] if keep else None
        kept_in_zero = len(keep) if kept_seq == 0 else 0  # a kept path in sequence 0 is its first cells
        if in_zero > kept_in_zero:  # the rest of sequence 0's cells leave it (tagged, not freed)
            self._L.llama_memory_seq_cp(self.mem, 0, TRASH, c + kept_in_zero, -1)
            self._L.llama_memory_seq_rm(self.mem, 0, c + kept_in_zero, -1)
        if keep and kept_seq != 0:
            self._L.llama_memory_seq_cp(self.mem, kept_seq, 0, c, c + len(keep))
        for s in range(1, state.next_seq):  # every tree cell keeps a tag, so no cell is freed (see the docstring)
            self._L.llama_memory_seq_cp(self.mem, s, TRASH, c, -1)
            self._L.llama_memory_seq_rm(self.mem, s, -1, -1)
        state.trash += state.pending - len(keep)
        state.tokens += [state.pending_tokens[k] for k in keep]
        state.committed += len(keep)
        state.pending_tokens, state.pending_positions, state.pending_seqs = [], [], []
        state.children, state.next_seq = {}, 1

    def _compact(self, state: LlamaState) -> None:
        """Decode the committed text again into an emptied cache (drops the rejected nodes' cells)."""
        if state.pending:
            raise VerispecError("the llama backend's cache is full in the middle of a tree; use a smaller tree")
        self._L.llama_memory_clear(self.mem, True)
        self._decode(state.tokens, list(range(len(state.tokens))), [[0]] * len(state.tokens),
                     [False] * len(state.tokens))
        state.trash = 0

    def rollback(self, state: LlamaState, n: int) -> None:
        self._check(state)
        if not 0 <= n <= state.committed:
            raise ValueError(f"cannot roll back {n} of {state.committed} committed entries")
        self.commit(state, [])
        keep = state.committed - n
        self._L.llama_memory_seq_cp(self.mem, 0, TRASH, keep, -1)
        self._L.llama_memory_seq_rm(self.mem, 0, keep, -1)
        state.trash += n
        state.committed, state.tokens = keep, state.tokens[:keep]

    def prefill(self, state: LlamaState, tokens: list[int]) -> torch.Tensor | None:
        out = self.prefill_output(state, tokens)
        return None if out is None else out.logits[-1]

    def prefill_output(self, state: LlamaState, tokens: list[int], inputs_embeds=None,
                       features: tuple[int, ...] = (-1,)) -> ForwardOutput | None:
        self._check(state)
        if state.pending:
            raise ValueError("prefill with uncommitted entries; commit or drop them first")
        if not len(tokens):
            return None
        n = len(tokens)
        if state.committed + state.trash + n > self.max_context:
            self._compact(state)
        pos = list(range(state.committed, state.committed + n))
        self._decode(list(tokens), pos, [[0]] * n, [i == n - 1 for i in range(n)])
        state.committed += n
        state.tokens += list(tokens)
        return ForwardOutput(logits=self._logits([-1]), hidden=torch.zeros(n, 0))


def load_llama(spec: str, threads: int | None = None) -> LlamaCppTarget:
    """A llama.cpp target from a built-in alias or a .gguf file, with the model's Hugging Face tokenizer."""
    from .loading import BUILTIN_MODELS, tokenizer_for  # noqa: PLC0415

    if spec in BUILTIN_MODELS:
        folder, name = BUILTIN_MODELS[spec]()
        path = os.path.join(folder, name)
    elif spec.endswith(".gguf"):
        path = spec
    else:
        raise VerispecError(f"the llama backend runs GGUF files (a built-in alias or a .gguf path), not {spec!r}")
    if not os.path.isfile(path):
        raise VerispecError(f"GGUF file not found: {path}")
    return LlamaCppTarget(path, tokenizer_for(spec), name=spec, threads=threads)
