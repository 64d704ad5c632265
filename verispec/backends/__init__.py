"""Target engines behind one small interface (``Target``): what the decoding loop needs from a model.

``hf`` is the Hugging Face adapter (unmodified ``transformers`` models driven by 4-D masks and explicit positions),
``loading`` finds and loads models (built-in aliases, GGUF files, folders, hub ids), ``kernels`` holds the optional
CPU linear-layer plan.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from ..errors import VerispecError
from .hf import CausalLM, ForwardOutput, KVState, quantized_copy
from .loading import BUILTIN_MODELS, DEFAULT_TARGET
from .loading import load as _load_hf

BACKENDS = ("hf", "llama")


def default_threads() -> int:
    """CPU threads for torch by default: the cores this process may run on, or fewer if ``OMP_NUM_THREADS`` says
    so (torch slows down many times over when its threads outnumber free cores)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        cores = max(1, os.cpu_count() or 1)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return min(cores, int(omp)) if omp.isdigit() and int(omp) > 0 else cores


def load(spec: str = DEFAULT_TARGET, dtype: str = "float32", backend: str = "hf", threads: int | None = None,
         kernel: bool = True):
    """A target by alias, GGUF file, folder or hub id, run by ``backend``: ``hf`` (Hugging Face ``transformers``,
    the default) or ``llama`` (llama.cpp on a GGUF file; ``pip install 'verispec[llama]'``)."""
    if backend == "hf":
        return _load_hf(spec, dtype=dtype, kernel=kernel)
    if backend == "llama":
        from .llama import load_llama  # noqa: PLC0415

        return load_llama(spec, threads=threads)
    raise VerispecError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


class Target(Protocol):
    """A target model as the decoding loop uses it.

    A *state* holds one sequence's cache: ``committed`` entries (the text so far) and *pending* ones (tree nodes of
    the last forward). ``forward`` runs tokens at given positions on top of a state, each token seeing the committed
    entries and the pending ones ``attend`` allows, and returns per-token logits (and hidden states of the requested
    ``features`` layers, where the engine has them); ``commit`` keeps the listed pending entries, in order, and drops
    the rest."""

    name: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_context: int

    def new_state(self): ...

    def prefill_output(self, state, tokens: list[int], inputs_embeds=None,
                       features: tuple[int, ...] = (-1,)) -> ForwardOutput | None: ...

    def forward(self, state, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                features: tuple[int, ...] = (-1,)) -> ForwardOutput: ...

    def commit(self, state, keep: list[int]) -> None: ...

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


__all__ = ["BACKENDS", "BUILTIN_MODELS", "DEFAULT_TARGET", "CausalLM", "ForwardOutput", "KVState", "Target",
           "default_threads", "load",
           "quantized_copy"]
