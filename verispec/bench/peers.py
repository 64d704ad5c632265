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
import http.client
import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import cache
from ..backends import CausalLM
from ..backends.llama import INSTALL_HINT, check_engine
from ..backends.loading import converted_folder, gguf_file
from ..drafters import DraftSpec, ModelDrafter
from ..errors import VerispecError
from .concurrency import Request, one_at_a_time, static_batches
from .serving import (
    chat_body,
    chat_loop,
    closed_loop,
    free_port,
    llama_cpp_server_command,
    llama_server_command,
    server_process,
    transformers_command,
    verispec_command,
)

HF_LOOKUP_TOKENS = 10  # Hugging Face prompt lookup's default number of proposed tokens


@dataclass(frozen=True)
class PeerResult:
    token_ids: list[int]
    wall_s: float
    drafted: list[int]  # per verification step (assisted only)
    accepted: list[int]
    first_token_s: float | None = None  # seconds to the first token, where the peer shows it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _sampling_kwargs(temperature: float, top_k: int = 0, top_p: float = 1.0) -> dict:
    if temperature == 0:
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    return {"do_sample": True, "temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}


@contextlib.contextmanager
def _count_candidates(drafted: list[int], accepted: list[int]):
    """Record (drafted, accepted) at each call of Hugging Face's ``update_candidate_strategy``: the assisted
    generator overrides it, prompt lookup inherits the base class's; a flag keeps a nested call from counting twice."""
    from transformers.generation import candidate_generator as cg  # noqa: PLC0415 - a 0.7 s import, needed here only

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
                prompt_lookup: int | None = None, top_k: int = 0, top_p: float = 1.0) -> PeerResult:
    """Hugging Face ``generate`` of ``target``: plain, assisted by the draft model ``assistant``, or with prompt
    lookup (``prompt_lookup`` = tokens proposed per step). Stops at EOS (kept in the output)."""
    if assistant is not None and prompt_lookup is not None:
        raise ValueError("give an assistant model or prompt lookup, not both")
    torch.manual_seed(seed)
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=sorted(target.eos_token_ids) or None,
                  pad_token_id=target.hf.generation_config.pad_token_id or 0,
                  **_sampling_kwargs(temperature, top_k, top_p))
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


def lookup_draft(tokens: int):
    """llama-cpp-python's own prompt-lookup draft model, proposing ``tokens`` tokens a step."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: PLC0415 - the optional [llama] extra

    return LlamaPromptLookupDecoding(num_pred_tokens=tokens)


def llama_model(path: str, n_ctx: int, threads: int, draft=None, flash_attn: bool = True):
    """A llama-cpp-python model of the GGUF file ``path``, speculating with ``draft`` (a llama-cpp-python draft model)
    if given. A draft makes llama-cpp-python keep logits for every position, but it sizes its score buffer from the
    logits_all argument (n_batch rows otherwise): a prompt past n_batch tokens then fails to broadcast. So
    logits_all=True with a draft."""
    check_engine(path)
    import llama_cpp  # noqa: PLC0415 - the optional [llama] extra

    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                           draft_model=draft, logits_all=draft is not None, flash_attn=flash_attn)


def llama_tokens(llm, prompt_ids: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The tokens llama-cpp-python samples after ``prompt_ids`` (its cache of a common prefix kept), one at a time, as
    ints; sampling matched to verispec's: temperature, top-k and top-p as given, min-p, typical-p and the repetition
    penalty off."""
    for tok in llm.generate(list(prompt_ids), temp=float(temperature), top_k=top_k, top_p=top_p, min_p=0.0,
                            typical_p=1.0, repeat_penalty=1.0, reset=True):
        yield int(tok)


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
    # with a draft every position's logits are kept (``llama_model``): the context (n_ctx x vocabulary floats) as
    # short as the request allows
    n_ctx = 8192
    if lookup:
        n_ctx = 1024
        while n_ctx < len(prompt_ids) + max_new_tokens + lookup + 1:
            n_ctx *= 2
    key = (path, lookup, threads, n_ctx)
    if key not in _LLAMAS:
        for old in [k for k in _LLAMAS if k[:3] == key[:3]]:  # one context per file and mode: free the old size
            del _LLAMAS[old]
        _LLAMAS[key] = llama_model(path, n_ctx, threads, lookup_draft(lookup) if lookup else None)
    llm = _LLAMAS[key]
    eos = llm.token_eos()
    llm.reset()
    llm.set_seed(seed)
    out, first = [], None
    t = time.perf_counter()
    for tok in llama_tokens(llm, prompt_ids, temperature):
        if first is None:
            first = time.perf_counter() - t
        out.append(tok)
        if tok == eos or len(out) >= max_new_tokens:
            break
    wall = time.perf_counter() - t
    return PeerResult(out, wall, [], [], first)


class _StepClock:
    """A logits processor that only notes when ``generate`` computes each step's logits (the step's token follows at
    once): per-token timing for a batch, which Hugging Face's streamer does not give."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_generate_batch(target: CausalLM, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                      seed: int = 0) -> list[tuple[list[int], float, float]]:
    """Hugging Face ``generate`` of a static batch: the prompts left-padded into one batch, decoded together until
    the last one stops. Per prompt: its tokens (up to its first EOS), seconds to its first and to its last token."""
    from transformers import LogitsProcessorList  # noqa: PLC0415 - a 0.7 s import, needed here only

    torch.manual_seed(seed)
    pad = target.hf.generation_config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock()
    with torch.no_grad():
        t = time.perf_counter()
        out = target.hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                 eos_token_id=sorted(target.eos_token_ids) or None,
                                 logits_processor=LogitsProcessorList([clock]), **_sampling_kwargs(temperature))
    results = []
    for row in out[:, width:].tolist():
        for i, tok in enumerate(row):
            if tok in target.eos_token_ids:
                row = row[: i + 1]
                break
        n = max(len(row), 1)
        results.append((row, clock.times[0] - t, clock.times[min(n, len(clock.times)) - 1] - t))
    return results


CB_PAGE = 256  # tokens a page of transformers' continuous-batching cache holds (its default)


def continuous_sizes(prompt_lengths: list[int], max_new_tokens: int, concurrency: int) -> tuple[int, int]:
    """(``num_blocks``, ``max_batch_tokens``) for transformers' continuous batching of these requests, at most
    ``concurrency`` at once: cache blocks for the ``concurrency`` longest requests whole (prompt and new tokens) plus
    one to spare, and a forward of the longest prompt beside a decoding row for every other request. Left unset, on
    a CPU it sizes its cache from 90 % of the machine's whole memory (a 135M model's loop reached 15 GB)."""
    longest = sorted(prompt_lengths, reverse=True)[:max(concurrency, 1)] or [0]
    blocks = sum(-(-(n + max_new_tokens) // CB_PAGE) for n in longest) + 1
    return blocks, max(max(longest) + concurrency, 256)


def hf_continuous(target: CausalLM, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
                  concurrency: int, problems) -> list:
    """transformers' own continuous batching (``generate_batch``, 5.24): every prompt queued at once, at most
    ``concurrency`` requests scheduled together; its per-request timestamps give when each started and produced."""
    from transformers import GenerationConfig  # noqa: PLC0415 - a 0.7 s import, needed here only
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: PLC0415 - a 0.7 s import, needed here only

    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=sorted(target.eos_token_ids) or None,
                              pad_token_id=target.hf.generation_config.pad_token_id or 0,
                              **_sampling_kwargs(temperature))
    num_blocks, max_batch_tokens = continuous_sizes([len(p) for p in prompts], max_new_tokens, concurrency)
    cb = ContinuousBatchingConfig(max_requests_per_batch=concurrency, seed=seed, num_blocks=num_blocks,
                                  max_batch_tokens=max_batch_tokens, page_size=CB_PAGE)
    with torch.no_grad():
        got = target.hf.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                                       record_timestamps=True, progress_bar=False, warmup=True)
    outs = [got[f"req_{i}"] for i in range(len(prompts))]
    t0 = min(o.lifespan[0] for o in outs)
    return [Request(problem, list(o.generated_tokens), o.lifespan[0] - t0,
                    (o.timestamps[0] - t0) if o.timestamps else None, o.lifespan[1] - t0,
                    error=str(o.error) if o.error else None) for problem, o in zip(problems, outs)]


def llama_server_binary() -> str | None:
    """llama.cpp's ``llama-server``: ``$VERISPEC_LLAMA_SERVER``, else the one ``scripts/llama_build.py server``
    built; None when there is none."""
    path = os.environ.get("VERISPEC_LLAMA_SERVER")
    if not path:
        try:
            path = cache.path("llama-server", "current").read_text().strip()
        except OSError:
            return None
    return path if path and os.access(path, os.X_OK) else None


def _stream_completion(port: int, body: dict, timeout: float) -> tuple[list[int], float | None]:
    """One streamed ``/completion`` request to a local llama-server: its token ids, and seconds to the first."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t = time.perf_counter()
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise VerispecError(f"llama-server answered {resp.status}: {resp.read()[:200]!r}")
        tokens, first = [], None
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            got = chunk.get("tokens") or []
            if got and first is None:
                first = time.perf_counter() - t
            tokens += [int(x) for x in got]
            if chunk.get("stop"):
                break
        return tokens, first
    finally:
        conn.close()


def llama_server_loop(gguf: str, prompts: list[list[int]], problems, concurrency: int, temperature: float,
                      seed: int, max_new_tokens: int, threads: int) -> list[Request]:
    """llama.cpp's ``llama-server`` with ``concurrency`` parallel slots (continuous batching in C++), started on
    127.0.0.1 for this loop and stopped after it, driven by that many clients over loopback with the same prompts
    (token ids, its own ``/completion`` route) and sampling matched to verispec's (temperature only; top-k, top-p,
    min-p and penalties off)."""
    binary = llama_server_binary()
    if binary is None:
        raise VerispecError("no llama-server binary: build it with .venv/bin/python scripts/llama_build.py server")
    port = free_port()
    per_slot = max(len(p) for p in prompts) + max_new_tokens + 16
    with server_process("llama-server", llama_server_command(binary, gguf, port, concurrency, threads, per_slot),
                        port):
        def body(i: int, budget: int) -> dict:
            return {"prompt": prompts[i], "n_predict": budget, "temperature": float(temperature), "top_k": 0,
                    "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "seed": seed,
                    "stream": True, "return_tokens": True, "cache_prompt": False}

        _stream_completion(port, body(0, 4), 300)  # warm-up

        def send(i: int):
            try:
                return (*_stream_completion(port, body(i, max_new_tokens), 600), None)
            except (OSError, VerispecError, ValueError) as exc:
                return [], None, str(exc)

        loop = closed_loop(len(prompts), concurrency, send)
        return [Request(problems[i], tokens, submitted, None if first is None else submitted + first, end,
                        error=error) for i, (submitted, (tokens, first, error), end) in enumerate(loop)]


def _served(name: str, command: Callable[["ConcurrentRun", int], list[str]], model: Callable[["ConcurrentRun"], str],
            ready: str = "/health", **extra) -> Callable[["ConcurrentRun"], list[Request]]:
    """A server peer (``bench.serving``): started for the loop with its threads pinned to the run's, then driven
    through ``/v1/chat/completions`` by the client every server gets, ``extra`` fields added to each request."""
    def concurrent(c: ConcurrentRun) -> list[Request]:
        port = free_port()
        threads = str(c.threads)
        with server_process(name, command(c, port), port, ready, env={"OMP_NUM_THREADS": threads}):
            tokenizer = c.target.tokenizer
            return chat_loop(port, lambda i: chat_body(c.problems[i].prompt, model(c), c.max_new_tokens,
                                                       c.temperature, c.seed, **extra),
                             c.problems, c.concurrency,
                             lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]))

    return concurrent


def _transformers_serve(continuous: bool, note: str, label: str) -> "Peer":
    """``transformers serve`` on the copy of the weights verispec loads (in the run's dtype), without or with its
    continuous batching."""
    name = "transformers-serve-cb" if continuous else "transformers-serve"
    return Peer(name, note, None, missing=_needs_converted,
                concurrent=_served(name, lambda c, port: transformers_command(converted_folder(c.target_spec, c.dtype),
                                                                              port, c.dtype, continuous=continuous),
                                   lambda c: converted_folder(c.target_spec, c.dtype)),
                baselines=(Baseline("vs_" + name.replace("-", "_"), label, name, optional=True),), loop_label=label)


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
class ConcurrentRun:
    """What a peer needs for one closed loop (``bench.concurrency``): every prompt, N in flight."""

    target: object
    target_spec: str
    drafter: object
    problems: list
    prompt_ids: list[list[int]]
    concurrency: int
    temperature: float
    seed: int
    max_new_tokens: int
    threads: int
    dtype: str = "float32"  # what the Hugging Face model computes in (the servers of it are started with it)


@dataclass(frozen=True)
class Peer:
    name: str
    note: str
    run: Callable[[PeerRun], PeerResult] | None  # one request alone (None: a peer of closed loops only)
    missing: Callable[[object], str | None] = lambda config: None  # why it cannot run with a bench config, or None
    drafts: bool = False  # runs with the cell's draft (one cell per draft)
    takes_draft: Callable[[str], bool] = lambda draft: True  # which drafts it can use
    scores_text: bool = True  # its text is the target's law at the cell's temperature (NLL comparable)
    baselines: tuple[Baseline, ...] = field(default_factory=tuple)
    concurrent: Callable[[ConcurrentRun], list[Request]] | None = None  # a closed loop of N requests in flight
    loop_label: str | None = None  # the column of closed-loop tables that compares with it (None: no column)


def _one_at_a_time(run: Callable[[PeerRun], PeerResult]) -> Callable[[ConcurrentRun], list[Request]]:
    """A peer that serves one request at a time, as a closed loop (``concurrency.one_at_a_time``)."""
    def concurrent(c: ConcurrentRun) -> list[Request]:
        def serve(i: int):
            r = run(PeerRun(c.target, c.target_spec, c.drafter, c.prompt_ids[i], c.max_new_tokens, c.temperature,
                            c.seed))
            return r.token_ids, r.first_token_s

        return one_at_a_time(serve, c.problems, c.concurrency)

    return concurrent


def _static(c: ConcurrentRun) -> list[Request]:
    return static_batches(lambda idx: hf_generate_batch(c.target, [c.prompt_ids[i] for i in idx], c.max_new_tokens,
                                                        c.temperature, c.seed), c.problems, c.concurrency)


def _needs_server(config) -> str | None:
    why = None if gguf_path(config.target) is not None else f"the target {config.target!r} is not a GGUF file"
    if llama_server_binary() is None:
        why = "no llama-server binary (build it: .venv/bin/python scripts/llama_build.py server)"
    if not config.concurrency:
        why = "it runs closed loops only (--concurrency)"
    return why


def _closed_loops_only(config) -> str | None:
    return _hf_only(config) or (None if config.concurrency else "it runs closed loops only (--concurrency)")


def _hf_only(config) -> str | None:
    return None if config.backend == "hf" else "it runs the Hugging Face model only; left out with the llama backend"


def _needs_converted(config) -> str | None:
    if config.backend != "hf" or not config.concurrency:
        return "it runs closed loops of the Hugging Face model only (--concurrency)"
    if converted_folder(config.target, config.dtype) is None:
        return f"no {config.dtype} folder of {config.target!r} (a built-in GGUF model writes one on its first load)"
    return None


def _needs_llama_server_module(config) -> str | None:
    why = _needs_gguf(config)
    if why is None and importlib.util.find_spec("sse_starlette") is None:
        why = "llama_cpp.server's own dependencies are missing (bash scripts/install_llama.sh installs them)"
    return why or (None if config.concurrency else "it runs closed loops only (--concurrency)")


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


def _plain(r: PeerRun) -> PeerResult:
    return hf_generate(r.target, r.prompt_ids, r.max_new_tokens, r.temperature, seed=r.seed)


def _llama(r: PeerRun) -> PeerResult:
    return llama_generate(r.target_spec, r.prompt_ids, r.max_new_tokens, r.temperature, seed=r.seed)


def _llama_lookup(r: PeerRun) -> PeerResult:
    return llama_generate(r.target_spec, r.prompt_ids, r.max_new_tokens, r.temperature, seed=r.seed,
                          lookup=HF_LOOKUP_TOKENS)


PEERS = {p.name: p for p in [
    Peer("hf-generate", "Hugging Face generate of the target (no draft); in closed loops, static padded batches of "
         "N prompts", _plain, missing=_hf_only, concurrent=_static,
         baselines=(Baseline("vs_hf_generate", "vs HF generate", "hf-generate"),),
         loop_label="vs HF static batches"),
    Peer("hf-assisted", "Hugging Face assisted generation with the same draft (a model draft, or prompt lookup for "
         "ngram); one request at a time in closed loops (transformers refuses batches for it)", _assisted,
         missing=_hf_only, drafts=True, takes_draft=supports_assisted, concurrent=_one_at_a_time(_assisted),
         baselines=(Baseline("vs_hf_assisted", "vs HF assisted", "hf-assisted", same_draft=True, optional=True),
                    Baseline("vs_best_hf_assisted", "vs HF assisted (its best draft)", "hf-assisted",
                             best_draft=True))),
    Peer("hf-continuous", "transformers' own continuous batching (generate_batch) of the target, at most N requests "
         "scheduled together (closed loops only)", None, missing=_closed_loops_only,
         concurrent=lambda c: hf_continuous(c.target, c.prompt_ids, c.max_new_tokens, c.temperature, c.seed,
                                            c.concurrency, c.problems),
         baselines=(Baseline("vs_hf_continuous", "vs HF continuous batching", "hf-continuous", optional=True),),
         loop_label="vs HF continuous batching"),
    Peer("llama-cpp", "llama.cpp's plain decoding of the same GGUF file (llama-cpp-python; a quantised model: its "
         "own target); one request at a time in closed loops, as llama-cpp-python serves", _llama,
         missing=_needs_gguf, scores_text=False, concurrent=_one_at_a_time(_llama),
         baselines=(Baseline("vs_llama_cpp", "vs llama.cpp", "llama-cpp", optional=True),),
         loop_label="vs llama.cpp one at a time"),
    Peer("llama-cpp-lookup", "llama-cpp-python's prompt-lookup speculative decoding of the same GGUF file (its own "
         "target)", _llama_lookup, missing=_needs_gguf, scores_text=False, concurrent=_one_at_a_time(_llama_lookup)),
    Peer("llama-server", "llama.cpp's own llama-server with N parallel slots (continuous batching in C++), built with "
         "the extra's options from the source llama-cpp-python vendors, driven over loopback (closed loops only)",
         None, missing=_needs_server, scores_text=False,
         concurrent=lambda c: llama_server_loop(gguf_path(c.target_spec), c.prompt_ids, c.problems, c.concurrency,
                                                c.temperature, c.seed, c.max_new_tokens, c.threads),
         baselines=(Baseline("vs_llama_server", "vs llama-server", "llama-server", optional=True),),
         loop_label="vs llama-server"),
    # servers, each started for its loop and driven by the same client through /v1/chat/completions (bench.serving)
    Peer("verispec-serve", "verispec serve (the default method, N slots), driven over loopback by the client every "
         "server gets (closed loops only)", None, missing=_closed_loops_only,
         concurrent=_served("verispec-serve", lambda c, port: verispec_command(c.target_spec, port, c.concurrency,
                                                                                 c.threads, c.dtype),
                            lambda c: c.target_spec, top_k=0, return_token_ids=True),
         baselines=(Baseline("vs_verispec_serve", "vs verispec serve", "verispec-serve", optional=True),)),
    _transformers_serve(False, "transformers serve on the same weights in the same dtype, one request at a time as it "
                        "serves without continuous batching (closed loops only)", "vs transformers serve"),
    _transformers_serve(True, "transformers serve --continuous-batching on the same weights in the same dtype "
                        "(closed loops only)", "vs transformers serve CB"),
    Peer("llama-cpp-server", "llama-cpp-python's server (llama_cpp.server) on the GGUF file, which serves one "
         "request at a time (closed loops only)", None, missing=_needs_llama_server_module, scores_text=False,
         concurrent=_served("llama-cpp-server", lambda c, port: llama_cpp_server_command(
             gguf_path(c.target_spec), port, c.threads, 4096), lambda c: gguf_path(c.target_spec),
             ready="/v1/models", top_k=0, min_p=0.0),
         baselines=(Baseline("vs_llama_cpp_server", "vs llama-cpp-python server", "llama-cpp-server",
                             optional=True),),
         loop_label="vs llama-cpp-python server"),
    Peer("llama-server-chat", "llama.cpp's llama-server with N slots, driven through /v1/chat/completions by the "
         "client every server gets (closed loops only)", None, missing=_needs_server, scores_text=False,
         concurrent=_served("llama-server-chat", lambda c, port: llama_server_command(
             llama_server_binary(), gguf_path(c.target_spec), port, c.concurrency, c.threads,
             max(map(len, c.prompt_ids)) + c.max_new_tokens + 64), lambda c: "model", top_k=0, min_p=0.0),
         baselines=(Baseline("vs_llama_server_chat", "vs llama-server (chat route)", "llama-server-chat",
                             optional=True),),
         loop_label="vs llama-server (chat route)"),
]}
BASELINES = (Baseline("speedup_ar", "vs ar", "ar"), *(b for p in PEERS.values() for b in p.baselines))
