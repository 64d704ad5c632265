"""The systems people use today, run in the same process on the same models, and their registry (``PEERS``).

Hugging Face ``generate`` of the target, plain, assisted (``assistant_model=draft``) and with prompt lookup (the
peer of the n-gram draft); llama.cpp's own decoding of the target's GGUF file. Adding a peer is one ``Peer`` entry:
its run function, when it cannot run, and the ratio columns the report shows against it (``Baseline``).

Sampling settings are matched to verispec's: ``temperature`` (0 = greedy), top-k and top-p off
(Hugging Face's default top-k of 50 is disabled). The assistant's ``generation_config`` keeps Hugging
Face's defaults unless given (20 assistant tokens, "constant" schedule, confidence threshold 0.4,
re-fitted by ROC when scikit-learn is installed). ``assisted`` also counts, per verification, the
drafted and accepted tokens, by observing Hugging Face's own ``update_candidate_strategy`` call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..backends import CausalLM
from ..backends.llama import INSTALL_HINT, check_engine
from ..backends.loading import gguf_file
from ..drafters import DraftSpec, ModelDrafter
from ..errors import VerispecError

HF_LOOKUP_TOKENS = 10  # Hugging Face prompt lookup's default number of proposed tokens


@dataclass(frozen=True)
class PeerResult:
    token_ids: list[int]
    wall_s: float
    drafted: list[int]  # per verification step (assisted only)
    accepted: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _sampling_kwargs(temperature: float) -> dict:
    if temperature == 0:
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    return {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}


@contextlib.contextmanager
def _count_candidates(drafted: list[int], accepted: list[int]):
    """Record (drafted, accepted) at each call of Hugging Face's ``update_candidate_strategy``: the assisted
    generator overrides it, prompt lookup inherits the base class's; a flag keeps a nested call from counting twice."""
    from transformers.generation import candidate_generator as cg  # noqa: PLC0415

    classes = (cg.CandidateGenerator, cg.AssistedCandidateGenerator)
    originals = {cls: cls.__dict__["update_candidate_strategy"] for cls in classes}
    inside = [False]

    def wrap(original):
        def observe(self, input_ids, scores, num_matches):
            if inside[0]:
                return original(self, input_ids, scores, num_matches)
            drafted.append(int(scores.shape[1]) - 1)
            accepted.append(int(num_matches))
            inside[0] = True
            try:
                return original(self, input_ids, scores, num_matches)
            finally:
                inside[0] = False

        return observe

    for cls, original in originals.items():
        cls.update_candidate_strategy = wrap(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.update_candidate_strategy = original


def hf_generate(target: CausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int = 0,
                assistant: CausalLM | None = None, assistant_config: dict | None = None,
                prompt_lookup: int | None = None) -> PeerResult:
    """Hugging Face ``generate`` of ``target``: plain, assisted by the draft model ``assistant``, or with prompt
    lookup (``prompt_lookup`` = tokens proposed per step). Stops at EOS (kept in the output)."""
    if assistant is not None and prompt_lookup is not None:
        raise ValueError("give an assistant model or prompt lookup, not both")
    torch.manual_seed(seed)
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=sorted(target.eos_token_ids) or None,
                  pad_token_id=target.hf.generation_config.pad_token_id or 0, **_sampling_kwargs(temperature))
    drafted, accepted = [], []
    ctx = contextlib.nullcontext()
    if assistant is not None:
        for key, value in (assistant_config or {}).items():
            setattr(assistant.hf.generation_config, key, value)
        kwargs["assistant_model"] = assistant.hf
        ctx = _count_candidates(drafted, accepted)
    elif prompt_lookup is not None:
        kwargs["prompt_lookup_num_tokens"] = int(prompt_lookup)
        ctx = _count_candidates(drafted, accepted)
    inputs = torch.tensor([prompt_ids])
    with ctx, torch.no_grad():
        t = time.perf_counter()
        out = target.hf.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
        wall = time.perf_counter() - t
    ids = out[0, len(prompt_ids):].tolist()
    for i, tok in enumerate(ids):  # nothing after the first EOS (padding of a finished sequence)
        if tok in target.eos_token_ids:
            ids = ids[: i + 1]
            break
    return PeerResult(ids, wall, drafted, accepted)


_LLAMAS: dict[tuple, object] = {}


def gguf_path(target_spec: str) -> str | None:
    """The GGUF file behind a target spec (a built-in alias or an existing .gguf file), or None."""
    try:
        return gguf_file(target_spec)
    except VerispecError:
        return None


def llama_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_generate(target_spec: str, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int = 0,
                   lookup: int | None = None, threads: int | None = None) -> PeerResult:
    """llama.cpp's own decoding of the target's GGUF file (``llama-cpp-python``): plain, or with its prompt-lookup
    speculative decoding proposing ``lookup`` tokens. The quantised model llama.cpp runs is a target of its own:
    its law is not the float32 model's. Sampling matched to verispec's: temperature only (top-k, top-p, min-p and
    the repetition penalty off). Stops at EOS (kept in the output)."""
    if not llama_available():
        raise VerispecError(f"the llama-cpp peers need llama-cpp-python: {INSTALL_HINT}")
    path = gguf_path(target_spec)
    if path is None:
        raise VerispecError(f"the llama-cpp peers need a GGUF target (a built-in alias or a .gguf file), not "
                            f"{target_spec!r}")
    threads = threads or torch.get_num_threads()
    # A draft model makes llama-cpp-python keep logits for every position, but it sizes its score buffer from the
    # logits_all argument (n_batch rows otherwise): a prompt past n_batch tokens then fails to broadcast. Pass
    # logits_all=True with a draft, and keep the context (n_ctx x vocabulary floats) as short as the request allows.
    n_ctx = 8192
    if lookup:
        n_ctx = 1024
        while n_ctx < len(prompt_ids) + max_new_tokens + lookup + 1:
            n_ctx *= 2
    key = (path, lookup, threads, n_ctx)
    if key not in _LLAMAS:
        check_engine(path)
        import llama_cpp  # noqa: PLC0415 - the optional extra
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: PLC0415 - the optional extra

        draft = None
        if lookup:
            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        for old in [k for k in _LLAMAS if k[:3] == key[:3]]:  # one context per file and mode: free the old size
            del _LLAMAS[old]
        _LLAMAS[key] = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                       verbose=False, draft_model=draft, logits_all=bool(lookup), flash_attn=True)
    llm = _LLAMAS[key]
    eos = llm.token_eos()
    llm.reset()
    llm.set_seed(seed)
    out = []
    t = time.perf_counter()
    for tok in llm.generate(prompt_ids, temp=float(temperature), top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                            repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok == eos or len(out) >= max_new_tokens:
            break
    wall = time.perf_counter() - t
    return PeerResult(out, wall, [], [])


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Baseline:
    """A ratio column of the report: a row's tokens/s over ``method``'s on the same prompts."""

    column: str  # the report row's key and CSV column ("vs_llama_cpp")
    label: str  # its table heading ("vs llama.cpp")
    method: str  # the method or peer whose speed it divides by
    same_draft: bool = False  # against that method run with the row's own draft (else its draft-free run)
    best_draft: bool = False  # against that method with whichever draft made it fastest in the run
    optional: bool = False  # left out of a table where no row has it


@dataclass(frozen=True)
class PeerRun:
    """What a peer needs for one cell: the runner's target and drafter for the cell's draft, the prompt, the
    budget and the sampling settings."""

    target: object
    target_spec: str
    drafter: object
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    seed: int


@dataclass(frozen=True)
class Peer:
    name: str
    note: str
    run: Callable[[PeerRun], PeerResult]
    missing: Callable[[object], str | None] = lambda config: None  # why it cannot run with a bench config, or None
    drafts: bool = False  # runs with the cell's draft (one cell per draft)
    takes_draft: Callable[[str], bool] = lambda draft: True  # which drafts it can use
    scores_text: bool = True  # its text is the target's law at the cell's temperature (NLL comparable)
    baselines: tuple[Baseline, ...] = field(default_factory=tuple)


def _hf_only(config) -> str | None:
    return None if config.backend == "hf" else "it runs the Hugging Face model only; left out with the llama backend"


def _needs_gguf(config) -> str | None:
    if not llama_available():
        return f"llama-cpp-python is not installed ({INSTALL_HINT})"
    return None if gguf_path(config.target) is not None else f"the target {config.target!r} is not a GGUF file"


def supports_assisted(draft: str) -> bool:
    """Hugging Face assisted generation takes a draft model (``int8``, ``model:...``) or prompt lookup (``ngram``)."""
    return DraftSpec.parse(draft).kind in ("int8", "model", "ngram")


def _assisted(r: PeerRun) -> PeerResult:
    if isinstance(r.drafter, ModelDrafter):
        return hf_generate(r.target, r.prompt_ids, r.max_new_tokens, r.temperature, seed=r.seed,
                           assistant=r.drafter.model)
    return hf_generate(r.target, r.prompt_ids, r.max_new_tokens, r.temperature, seed=r.seed,
                       prompt_lookup=HF_LOOKUP_TOKENS)


PEERS = {p.name: p for p in [
    Peer("hf-generate", "Hugging Face generate of the target (no draft)",
         lambda r: hf_generate(r.target, r.prompt_ids, r.max_new_tokens, r.temperature, seed=r.seed),
         missing=_hf_only, baselines=(Baseline("vs_hf_generate", "vs HF generate", "hf-generate"),)),
    Peer("hf-assisted", "Hugging Face assisted generation with the same draft (a model draft, or prompt lookup for "
         "ngram)", _assisted, missing=_hf_only, drafts=True, takes_draft=supports_assisted,
         baselines=(Baseline("vs_hf_assisted", "vs HF assisted", "hf-assisted", same_draft=True, optional=True),
                    Baseline("vs_best_hf_assisted", "vs HF assisted (its best draft)", "hf-assisted",
                             best_draft=True))),
    Peer("llama-cpp", "llama.cpp's plain decoding of the same GGUF file (llama-cpp-python; a quantised model: its "
         "own target)", lambda r: llama_generate(r.target_spec, r.prompt_ids, r.max_new_tokens, r.temperature,
                                                 seed=r.seed),
         missing=_needs_gguf, scores_text=False,
         baselines=(Baseline("vs_llama_cpp", "vs llama.cpp", "llama-cpp", optional=True),)),
    Peer("llama-cpp-lookup", "llama-cpp-python's prompt-lookup speculative decoding of the same GGUF file (its own "
         "target)", lambda r: llama_generate(r.target_spec, r.prompt_ids, r.max_new_tokens, r.temperature,
                                             seed=r.seed, lookup=HF_LOOKUP_TOKENS),
         missing=_needs_gguf, scores_text=False),
]}
BASELINES = (Baseline("speedup_ar", "vs ar", "ar"), *(b for p in PEERS.values() for b in p.baselines))
