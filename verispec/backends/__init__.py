"""Target engines behind one small interface (``base.Target``): what the decoding loop needs from a model.

``hf`` is the Hugging Face adapter (unmodified ``transformers`` models driven by 4-D masks and explicit positions),
``lean`` its lean forward for Llama-architecture models, ``llama`` llama.cpp (an optional extra), ``kv`` the KV
caches, ``loading`` finds and loads models (built-in aliases, GGUF files, folders, hub ids), ``kernels`` holds the
optional CPU linear-layer plan, ``costs`` the measured cost of a forward by its size.
"""

from __future__ import annotations

import os

from ..errors import VerispecError
from .base import ForwardOutput, Target
from .hf import CausalLM, quantized_copy
from .kv import KVState
from .llama import load_llama
from .loading import BUILTIN_MODELS, DEFAULT_TARGET, DTYPES, resolve_dtype
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
         kernel: bool = True, device: str = "cpu"):
    """A target by alias, GGUF file, folder or hub id, run by ``backend``: ``hf`` (Hugging Face ``transformers``,
    the default) or ``llama`` (llama.cpp on a GGUF file; ``bash scripts/install_llama.sh``). ``device``: where an
    ``hf`` target runs (``loading.load``)."""
    if backend == "hf":
        return _load_hf(spec, dtype=dtype, kernel=kernel, device=device)
    if device != "cpu":
        raise VerispecError(f"the {backend} backend runs on the CPU only, not on {device!r}")
    if backend == "llama":
        return load_llama(spec, threads=threads)
    raise VerispecError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "BUILTIN_MODELS", "DEFAULT_TARGET", "DTYPES", "CausalLM", "ForwardOutput", "KVState", "Target",
           "default_threads", "load",
           "quantized_copy", "resolve_dtype"]
