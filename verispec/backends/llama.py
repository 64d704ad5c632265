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
import importlib.util
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from .. import cache
from ..errors import VerispecError
from .base import ForwardOutput, decode, encode_prompt
from .cpu import cpu_flags
from .loading import gguf_file, tokenizer_for

MAX_PATHS = 64  # sequence ids available to one tree (llama.cpp's n_seq_max)
TRASH = MAX_PATHS + 1  # cells of rejected nodes: kept (tagged here, never attended) rather than freed, see commit
_LOG_SINK = None


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _lib():
    global _LOG_SINK
    if not available():
        raise VerispecError(f"the llama backend needs llama-cpp-python: {INSTALL_HINT}; about 15 minutes on "
                            "2 cores")
    import llama_cpp  # noqa: PLC0415 - the optional [llama] extra

    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda *a: None)  # kept alive: llama.cpp calls it later
        llama_cpp.llama_log_set(_LOG_SINK, None)
        llama_cpp.llama_backend_init()
    return llama_cpp


INSTALL_HINT = "bash scripts/install_llama.sh (it builds llama.cpp for the instructions this CPU runs and self-tests it)"
# A short batch decode in a child process: prompt batches are where a llama.cpp build with instructions the CPU
# refuses dies ("Illegal instruction" with AMX on some virtual Xeons, while a 2-token prompt works), so this decodes
# 96 tokens in one batch, then a 4-token batch on two sequences, as a tree step does.
_PROBE = r"""
import sys, llama_cpp
sink = llama_cpp.llama_log_callback(lambda *a: None)  # kept alive: llama.cpp calls it later
llama_cpp.llama_log_set(sink, None)
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
cp = llama_cpp.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified, cp.flash_attn_type = 512, 128, 128, 2, True, 1
cp.n_threads = cp.n_threads_batch = 1
ctx = llama_cpp.llama_init_from_model(model, cp)
if not model or not ctx:
    sys.exit(3)
batch = llama_cpp.llama_batch_init(128, 0, 2)
for rows, seqs in ((list(range(96)), [[0]] * 96), ([96, 97, 96, 97], [[0], [0], [1], [1]])):
    for r, pos in enumerate(rows):
        batch.token[r], batch.pos[r], batch.logits[r] = 10 + pos % 50, pos, True
        batch.n_seq_id[r] = 1
        batch.seq_id[r][0] = seqs[r][0]
    batch.n_tokens = len(rows)
    if len(seqs) == 4:
        llama_cpp.llama_memory_seq_cp(llama_cpp.llama_get_memory(ctx), 0, 1, -1, -1)
    if llama_cpp.llama_decode(ctx, batch) != 0:
        sys.exit(4)
"""


def _engine_key(path: str) -> str:
    """What the check's verdict depends on: the compiled library, this CPU and the model file."""
    import llama_cpp  # noqa: PLC0415 - the optional [llama] extra

    lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    libs = sorted(os.path.join(lib, f) for f in os.listdir(lib)) if os.path.isdir(lib) else [llama_cpp.__file__]
    parts = [f"{f}:{os.stat(f).st_size}:{os.stat(f).st_mtime_ns}" for f in libs]
    parts.append(" ".join(sorted(cpu_flags())))
    st = os.stat(path)
    parts.append(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}")
    return cache.key(*parts)


def check_engine(path: str, use_cache: bool = True, timeout: float = 120.0) -> None:
    """Refuse, with one sentence naming the fix, a llama.cpp build that dies on this CPU, before it can die in the
    middle of a run: a short batch decode of ``path`` in a child process, once per (library, CPU, model) -- the
    verdict is kept in the on-disk cache (``llama-check/``)."""
    entry = _engine_key(path)
    if use_cache and cache.read("llama-check", entry):
        return
    try:
        run = subprocess.run([sys.executable, "-c", _PROBE, path], capture_output=True, text=True, timeout=timeout)
        code = run.returncode
    except subprocess.TimeoutExpired:
        raise VerispecError(f"llama.cpp did not finish a 96-token decode of {os.path.basename(path)} within "
                            f"{timeout:.0f} s; reinstall the extra with {INSTALL_HINT}") from None
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        what = "an illegal instruction" if -code == signal.SIGILL else name
        raise VerispecError(f"this build of llama.cpp dies with {what} ({name}) on this CPU in a batch decode; "
                            f"reinstall the extra with {INSTALL_HINT}")
    if code != 0:
        tail = (run.stderr.strip().splitlines() or [f"exit status {code}"])[-1]
        raise VerispecError(f"llama.cpp failed a short batch decode of {os.path.basename(path)} ({tail}); "
                            f"reinstall the extra with {INSTALL_HINT}")
    cache.write("llama-check", entry, {"model": os.path.abspath(path), "ok": True})


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

    backend = "llama"

    def __init__(self, path: str, tokenizer=None, name: str = "llama", threads: int | None = None,
                 n_ctx: int = 8192, n_batch: int = 2048):
        L = _lib()
        if not os.path.isfile(path):
            raise VerispecError(f"GGUF file not found: {path}")
        check_engine(path)
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
    def encode_prompt(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat, self.name)

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    @property
    def forward_id(self) -> str:
        return f"llama|{self.path}|{self.threads}"

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

    def state_pool(self, slots: int, capacity: int) -> None:
        return None  # one sequence at a time (see forward_batch)

    def forward_batch(self, states: list[LlamaState], tokens: list[torch.Tensor], positions: list[torch.Tensor],
                      attends: list[torch.Tensor], features: tuple[int, ...] = (-1,),
                      logits_from: list[int] | None = None) -> list[ForwardOutput]:
        """One sequence only: this backend keeps one sequence's cache at a time (``new_state`` clears it)."""
        if len(states) != 1:
            raise VerispecError(f"the llama backend decodes one sequence at a time, not a batch of {len(states)}; "
                                "batch on the Hugging Face backend (--backend hf)")
        n = int(tokens[0].shape[0])
        first = 0 if logits_from is None else min(max(logits_from[0], 0), n - 1)
        out = self.forward(states[0], tokens[0], positions[0], attends[0], last_logits_only=first == n - 1,
                           features=features)
        return [ForwardOutput(logits=out.logits[first - n:], hidden=out.hidden)]

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
    path = gguf_file(spec)
    if path is None:
        raise VerispecError(f"the llama backend runs GGUF files (a built-in alias or a .gguf path), not {spec!r}")
    return LlamaCppTarget(path, tokenizer_for(spec), name=spec, threads=threads)
