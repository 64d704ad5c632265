"""The engines ``verispec audit-engine`` can sample here, and the negative controls (samplers wrong on purpose).

Each is an ``engines.EngineAdapter``; ``ENGINES`` names them for the command line (``verispec-serve``, which needs a
running server's URL, is built by the command itself). An adapter that starts a process (``llama-server``) stops it
in ``close``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

import torch

from ..probs import Sampling
from .engines import EngineAdapter
from .sampled import tree_logits


def hf_logits(model, prompt: list[int], prefixes: list[tuple[int, ...]], chunk: int = 32) -> torch.Tensor:
    """A Hugging Face model's next-token logits after ``prompt`` + each prefix (all of one length: no padding)."""
    rows = []
    with torch.no_grad():
        for i in range(0, len(prefixes), chunk):
            ids = torch.tensor([prompt + list(p) for p in prefixes[i:i + chunk]])
            rows.append(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float())
    return torch.cat(rows)


class VerispecAdapter(EngineAdapter):
    """verispec's decoding loop (``generate``), one request at a time, or ``batch`` requests at once through the
    batched engine (``generate_batch``: sequences joining and leaving one engine)."""

    def __init__(self, target, draft: str = "auto", verifier: str | None = None, tree: str | None = None,
                 policy: str | None = None, children: str | None = None, batch: int = 1, name: str = "verispec",
                 note: str = ""):
        from ..drafters import build_drafter  # noqa: PLC0415

        self.target, self.batch, self.name, self.note = target, batch, name, note
        self.draft, self.verifier, self.tree, self.policy, self.children = draft, verifier, tree, policy, children
        self.drafter = build_drafter(draft, target)
        self.eos = frozenset(target.eos_token_ids)

    def _sampling(self, sampling: Sampling) -> Sampling:
        return sampling

    def sample(self, prompt, k, seed, sampling):
        from ..decode import generate  # noqa: PLC0415

        s = self._sampling(sampling)
        out = generate(self.target, self.drafter, self.verifier or "chain", prompt, tree=self.tree, policy=self.policy,
                       children=self.children, max_new_tokens=k, temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p, seed=seed)
        return out.token_ids, sum(st.drafted for st in out.steps)

    def sample_many(self, prompt, k, seeds, sampling):
        if self.batch <= 1:
            return super().sample_many(prompt, k, seeds, sampling)
        from ..decode import generate_batch  # noqa: PLC0415

        s = self._sampling(sampling)
        outs = generate_batch(self.target, self.drafter, self.verifier or "chain", [prompt] * len(seeds),
                              tree=self.tree, policy=self.policy, children=self.children, max_new_tokens=k,
                              temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=list(seeds),
                              max_batch=self.batch)
        return [(o.token_ids, sum(st.drafted for st in o.steps)) for o in outs]

    def next_logits(self, prompt, prefixes):
        return tree_logits(self.target, prompt, prefixes)


class ArgmaxControl(VerispecAdapter):
    """A "speculative sampler" that returns the argmax and never samples (mistral.rs #2424)."""

    def _sampling(self, sampling):
        return Sampling(0.0)


class DoubleTemperatureControl(VerispecAdapter):
    """A sampler that divides the logits by the temperature twice, a temperature fault of the kind of dflash #74 and
    lattice #388 (which ignored it): at T it samples at T squared, so at T = 1 it is right."""

    def _sampling(self, sampling):
        return Sampling(sampling.temperature ** 2, sampling.top_k, sampling.top_p)


class HFAssistedAdapter(EngineAdapter):
    """Hugging Face assisted generation of the target (``generate``), with an assistant model or prompt lookup."""

    def __init__(self, target, assistant: str, name: str, note: str = ""):
        self.target, self.name, self.note = target, name, note
        self.eos = frozenset(target.eos_token_ids)
        self.kind = assistant
        if assistant == "int8":
            from ..drafters import build_drafter  # noqa: PLC0415

            self.assistant = build_drafter("int8", target).model
        elif assistant != "lookup":
            raise ValueError(f"assistant is 'int8' or 'lookup', not {assistant!r}")

    def sample(self, prompt, k, seed, sampling):
        from ..bench.peers import HF_LOOKUP_TOKENS, hf_generate  # noqa: PLC0415

        extra = {"assistant": self.assistant} if self.kind == "int8" else {"prompt_lookup": HF_LOOKUP_TOKENS}
        out = hf_generate(self.target, prompt, k, sampling.temperature, seed=seed, top_k=sampling.top_k,
                          top_p=sampling.top_p, **extra)
        return out.token_ids, sum(out.drafted)

    def next_logits(self, prompt, prefixes):
        return hf_logits(self.target.hf, prompt, prefixes)


class _CountedDraft:
    """A llama-cpp-python draft model that counts the tokens it proposes."""

    def __init__(self, inner):
        self.inner, self.drafted = inner, 0

    def __call__(self, input_ids, *args, **kwargs):
        out = self.inner(input_ids, *args, **kwargs)
        self.drafted += len(out)
        return out


class LlamaCppAdapter(EngineAdapter):
    """llama-cpp-python decoding the target's GGUF file with its prompt-lookup speculative decoding (``lookup`` tokens
    proposed a step; its sampler draws each position and keeps a draft token while the draw equals it). The law comes
    from the same llama.cpp model's own logits, by teacher forcing: the quantised model llama.cpp runs is a target of
    its own, not the float32 model's."""

    def __init__(self, target, lookup: int | None = None, name: str = "llama-cpp-lookup", note: str = ""):
        from ..bench.peers import HF_LOOKUP_TOKENS, gguf_path, llama_available  # noqa: PLC0415
        from ..errors import VerispecError  # noqa: PLC0415

        if not llama_available():
            raise VerispecError("llama-cpp-lookup needs llama-cpp-python: bash scripts/install_llama.sh")
        self.path = gguf_path(target.name)
        if self.path is None:
            raise VerispecError(f"llama-cpp-lookup needs a GGUF target (a built-in alias), not {target.name!r}")
        self.target, self.lookup, self.name = target, lookup or HF_LOOKUP_TOKENS, name
        self.note = note or f"prompt lookup of {self.lookup} tokens on {self.path.rsplit('/', 1)[-1]}"
        self._llm = None
        self.eos = frozenset(target.eos_token_ids)  # the same vocabulary: the run stops on the ids the law ends on
        # flash attention off, as the committed llama-cpp-lookup rows ran: runs and law compute alike either way.
        # It moves this model's next-token law by a total variation of 0.05-0.08
        # (scripts/experiments/llama_flash_attention_law.py): a law must come from the engine's own setting
        self.flash_attn = False

    def _model(self):
        if self._llm is None:
            from ..bench.peers import llama_model, lookup_draft  # noqa: PLC0415

            self._llm = llama_model(self.path, 1024, torch.get_num_threads(), _CountedDraft(lookup_draft(self.lookup)),
                                    flash_attn=self.flash_attn)
        return self._llm

    def sample(self, prompt, k, seed, sampling):
        from ..bench.peers import llama_tokens  # noqa: PLC0415

        llm = self._model()
        before = llm.draft_model.drafted
        llm.set_seed(seed)  # no reset: generate keeps the prompt's cache from the last run (15 against 103 ms a run
        # here, the same tokens for the same seeds)
        out = []
        for tok in llama_tokens(llm, prompt, sampling.temperature, sampling.top_k, sampling.top_p):
            out.append(tok)
            if tok in self.eos or len(out) >= k:
                break
        return out, llm.draft_model.drafted - before

    def next_logits(self, prompt, prefixes):
        llm = self._model()
        llm.reset()
        llm.eval(list(prompt))
        base, rows = llm.n_tokens, []
        for p in prefixes:
            llm.n_tokens = base  # the prompt's cache is kept; eval drops what lies past it
            if p:
                llm.eval(list(p))
            rows.append(torch.tensor(llm.scores[llm.n_tokens - 1], dtype=torch.float32))
        return torch.stack(rows)


class LlamaServerAdapter(LlamaCppAdapter):
    """llama.cpp's own ``llama-server`` speculating with a draft model (``-md``, ``--spec-type draft-simple``), started
    here on 127.0.0.1 with one slot and stopped by its pid in ``close``. Its draft proposes greedily, up to
    ``draft_max`` tokens a step whatever its confidence (``--draft-p-min 0``); the server samples the target at each
    drafted position and keeps a draft token while the draw equals it. The draft model is the target's own GGUF file
    unless ``draft`` names another: the law under test is the verification's, and a draft the target agrees with
    drafts most. The first token after a prompt is sampled plainly and the server drafts at most the tokens a request
    still owes less one, so each request asks for ``k + 1`` tokens and keeps the first ``k``: tokens 2 .. k come from a
    speculative step that drafted ``k - 1`` of them. The law is the same GGUF file's own logits, by teacher forcing
    through llama-cpp-python (the same llama.cpp sources, ``scripts/llama_build.py``), with flash attention on as
    the server runs: on this model llama.cpp's flash attention moves the next-token law by a total variation of
    0.05-0.08, and a law read without it made the server's rows differ, a draft model or not."""

    def __init__(self, target, draft: str | None = None, draft_max: int = 4, name: str = "llama-server-draft"):
        from ..bench.peers import llama_server_binary  # noqa: PLC0415
        from ..errors import VerispecError  # noqa: PLC0415

        super().__init__(target, name=name)
        self.binary = llama_server_binary()
        if self.binary is None:
            raise VerispecError("llama-server-draft needs llama.cpp's llama-server: bash scripts/install_llama.sh, "
                                "then .venv/bin/python scripts/llama_build.py server")
        self.draft, self.draft_max = draft or self.path, draft_max
        self.note = f"-md {self.draft.rsplit('/', 1)[-1]} (greedy drafts) on {self.path.rsplit('/', 1)[-1]}"
        self._server, self._port, self.process = None, None, None
        self.flash_attn = True  # the server runs with -fa on, so its law is read with flash attention on too

    def _start(self) -> int:
        import contextlib  # noqa: PLC0415

        from ..bench.serving import free_port, server_process  # noqa: PLC0415

        if self._server is None:
            port = free_port()
            threads = str(torch.get_num_threads())
            command = [self.binary, "-m", self.path, "-md", self.draft, "--spec-type", "draft-simple",
                       "--spec-draft-n-max", str(self.draft_max), "--spec-draft-n-min", "0", "--draft-p-min", "0",
                       "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "1024", "-t", threads, "-tb",
                       threads, "-fa", "on" if self.flash_attn else "off", "--no-webui"]
            self._server = contextlib.ExitStack()
            self.process = self._server.enter_context(server_process("llama-server-draft", command, port))
            self._port = port
        return self._port

    def sample(self, prompt, k, seed, sampling):
        import http.client  # noqa: PLC0415

        from ..errors import VerispecError  # noqa: PLC0415

        body = {"prompt": list(prompt), "n_predict": k + 1, "temperature": float(sampling.temperature),
                "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": 0.0, "typical_p": 1.0,
                "repeat_penalty": 1.0, "seed": seed, "return_tokens": True, "cache_prompt": True}
        conn = http.client.HTTPConnection("127.0.0.1", self._start(), timeout=120)
        try:
            conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            if resp.status != 200:
                raise VerispecError(f"llama-server answered {resp.status}: {raw[:200].decode(errors='replace')}")
        except OSError as e:
            raise VerispecError(f"llama-server did not answer: {e}") from None
        finally:
            conn.close()
        got = json.loads(raw)
        out = []
        for tok in got.get("tokens") or []:
            out.append(int(tok))
            if out[-1] in self.eos or len(out) >= k:
                break
        return out, int((got.get("timings") or {}).get("draft_n", 0))  # the request's drafted tokens

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        super().close()


@dataclass(frozen=True)
class EngineEntry:
    name: str
    help: str
    make: Callable  # (target) -> EngineAdapter
    control: bool = False
    skip: Callable[[float], str | None] = lambda temperature: None  # why it cannot be checked at this temperature


def _entries() -> dict[str, EngineEntry]:
    entries = [
        EngineEntry("verispec", "verispec's loop, one request at a time: the method default (draft auto, chain "
                    "verification, the auto policy)", lambda t: VerispecAdapter(t, name="verispec")),
        EngineEntry("verispec-int8", "verispec's loop with the int8 copy of the target as its draft, a fixed chain of 3",
                    lambda t: VerispecAdapter(t, draft="int8", tree="chain:3", policy="fixed", name="verispec-int8")),
        EngineEntry("verispec-batch", "verispec's batched engine, 8 requests of the prompt at once (generate_batch), "
                    "draft auto, a fixed chain of 3 (the load-aware plan would draft nothing at 8)",
                    lambda t: VerispecAdapter(t, tree="chain:3", policy="fixed", batch=8, name="verispec-batch")),
        EngineEntry("hf-assisted", "Hugging Face assisted generation with the int8 copy of the target as its "
                    "assistant model", lambda t: HFAssistedAdapter(t, "int8", "hf-assisted")),
        EngineEntry("hf-lookup", "Hugging Face assisted generation with prompt lookup",
                    lambda t: HFAssistedAdapter(t, "lookup", "hf-lookup")),
        EngineEntry("llama-cpp-lookup", "llama-cpp-python's prompt-lookup speculative decoding of the target's GGUF "
                    "file (10 tokens a step), the law from that quantised model's own logits (the llama extra: bash "
                    "scripts/install_llama.sh)", lambda t: LlamaCppAdapter(t)),
        EngineEntry("llama-server-draft", "llama.cpp's llama-server with a draft model (-md: the target's own GGUF "
                    "file, greedy drafts of up to 4 tokens), started here on 127.0.0.1 and stopped after; the law from "
                    "that GGUF file's own logits (the llama extra and its server: bash scripts/install_llama.sh, then "
                    ".venv/bin/python scripts/llama_build.py server)", lambda t: LlamaServerAdapter(t)),
        EngineEntry("ctl-resispec", "negative control: verispec's loop verifying with resispec (ResiSpec as "
                    "published: its residual depends on the rejected candidate) on 2 i.i.d. candidates a node from "
                    "the shipped head", lambda t: VerispecAdapter(t, draft="eagle", verifier="resispec", tree="2x2",
                                                                  policy="fixed", children="iid", name="ctl-resispec",
                                                                  note="resispec on 2x2 i.i.d. children of the head"),
                    control=True),
        EngineEntry("ctl-argmax", "negative control: a sampler that returns the argmax", lambda t: ArgmaxControl(
            t, name="ctl-argmax", note="greedy tokens at any temperature"), control=True),
        EngineEntry("ctl-double-temperature", "negative control: the temperature applied twice (logits / T / T; the "
                    "same as once at T = 1, so checked at T < 1 only)", lambda t: DoubleTemperatureControl(
                        t, name="ctl-double-temperature", note="samples at T squared"), control=True,
                    skip=lambda temperature: "at T = 1 the temperature applied twice is T itself"
                    if temperature == 1 else None),
    ]
    return {e.name: e for e in entries}


ENGINES = _entries()



class ServeAdapter(EngineAdapter):
    """A running ``verispec serve`` (or any server of the OpenAI completions API that takes ``seed``, ``top_k`` and
    ``return_token_ids``), sent ``concurrency`` requests at once over HTTP; the law from ``target``, the model it
    serves, loaded here. Drafted tokens are read from its ``/metrics`` (verispec's counter), where it has them."""

    name = "verispec-serve"

    def __init__(self, url: str, target, model: str | None = None, concurrency: int = 8, timeout: float = 120.0):
        self.url, self.target, self.model = url.rstrip("/"), target, model
        self.concurrency, self.timeout = concurrency, timeout
        self.eos = frozenset(target.eos_token_ids)
        self.note = f"{self.url}, {concurrency} requests at a time"

    def _drafted_total(self) -> float | None:
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=self.timeout) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("verispec:spec_decode_num_draft_tokens_total"):
                return float(line.split()[-1])
        return None

    def _one(self, prompt, k, seed, sampling) -> list[int]:
        from ..errors import VerispecError  # noqa: PLC0415

        body = {"prompt": list(prompt), "max_tokens": k, "temperature": sampling.temperature, "seed": seed,
                "top_p": sampling.top_p, "top_k": sampling.top_k, "return_token_ids": True}
        if self.model:
            body["model"] = self.model
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return list(json.loads(r.read())["choices"][0]["token_ids"])
        except urllib.error.HTTPError as e:
            raise VerispecError(f"{self.url} answered {e.code}: {e.read()[:200].decode(errors='replace')}") from None
        except OSError as e:
            raise VerispecError(f"{self.url} did not answer: {e}") from None

    def sample(self, prompt, k, seed, sampling):
        return self.sample_many(prompt, k, [seed], sampling)[0]

    def sample_many(self, prompt, k, seeds, sampling):
        import concurrent.futures as cf  # noqa: PLC0415

        before = self._drafted_total()
        with cf.ThreadPoolExecutor(self.concurrency) as pool:
            outs = list(pool.map(lambda s: self._one(prompt, k, s, sampling), seeds))
        after = self._drafted_total()
        drafted = (after - before) / len(seeds) if before is not None and after is not None else float("nan")
        return [(o, drafted) for o in outs]

    def next_logits(self, prompt, prefixes):
        return tree_logits(self.target, prompt, prefixes)
