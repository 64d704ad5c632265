"""The transformers door: verispec's loop as a ``custom_generate`` for ``transformers``' own ``generate``.

    from verispec.integrations.transformers import speculative
    out = model.generate(**inputs, custom_generate=speculative(draft="auto"), do_sample=True,
                         temperature=0.6, max_new_tokens=64, streamer=streamer)

The generation config is honoured: ``do_sample`` (greedy when False), ``temperature``, ``top_k``, ``top_p``,
``max_new_tokens`` / ``max_length``, ``eos_token_id``, the ``streamer``, and ``return_dict_in_generate`` (the
output then also carries verispec's per-step records as ``steps``). What verispec cannot do exactly it refuses with
one clear error: beam search, several returned sequences, a streamer on a batch, and logits processors that are not
temperature, top-k or top-p (a repetition penalty, say, changes the target law step by step). A batch (left-padded,
as ``generate`` takes it) runs through the batched engine, each row with its own draft state and seed
(``seed + row``); ``steps`` is then one list per row.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from dataclasses import dataclass

import torch

from ..backends import CausalLM, load
from ..decode import generate_batch, generate_steps
from ..drafters import DraftSpec, NoDrafter, build_drafter
from ..errors import VerispecError
from ..methods import resolve
from ..probs import Sampling
from ..verifiers import check

_WRAPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF model -> the CausalLM verispec made for it


def default_model():
    """The built-in default model as (Hugging Face model, tokenizer), known to verispec (so ``draft="auto"`` finds
    its shipped head)."""
    target = load()
    _WRAPPED[target.hf] = target
    return target.hf, target.tokenizer


def _target_for(model, eos: frozenset[int]):
    known = _WRAPPED.get(model)
    target = known if known is not None else CausalLM(model, None, name=getattr(model.config, "_name_or_path", "model"))
    if eos and eos != target.eos_token_ids:
        target = _with_eos(target, eos)
    return target


def _with_eos(target, eos: frozenset[int]):
    out = copy.copy(target)
    out.eos_token_ids = eos
    return out


try:
    from transformers.generation.utils import GenerateDecoderOnlyOutput as _Output
except ImportError:  # pragma: no cover - an older transformers
    _Output = object


@dataclass
class SpeculativeOutput(_Output):
    """``generate``'s output with ``return_dict_in_generate=True``, plus verispec's per-step records."""

    steps: list | None = None


_ALLOWED = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}


def _callers_streamer():
    """The ``streamer`` given to ``generate``: transformers 5.24 puts the prompt into it but does not pass it on to a
    callable ``custom_generate`` (only keywords outside its own sampling signature are passed), so read it from the
    ``generate`` call that called us."""
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if caller is not None and caller.f_code.co_name == "generate":
            return caller.f_locals.get("streamer")
        return None
    finally:
        del frame


def speculative(draft: str = "auto", verifier: str = "chain", tree: str = "auto", policy: str = "auto",
                children: str | None = None, seed: int = 0):
    """A ``custom_generate`` callable running verispec's loop (see the module docstring). ``draft``, ``verifier``,
    ``tree`` and ``policy`` take the same strings as ``verispec generate``'s options; they are checked here, before
    anything runs (``methods.resolve``: the same rules and messages as the command line)."""
    draft_spec = DraftSpec.parse(draft)
    plan = resolve(verifier=verifier, tree=tree, policy=policy, children=children)
    drafters: dict = {}

    def generate_fn(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                    synced_gpus=False, streamer=None, **model_kwargs):
        cfg = generation_config
        if streamer is None:
            streamer = _callers_streamer()
        if getattr(cfg, "num_beams", 1) and cfg.num_beams > 1:
            raise VerispecError("verispec's custom_generate samples or decodes greedily; beam search (num_beams > 1) "
                                "is not supported")
        if input_ids.shape[0] > 1 and streamer is not None:
            raise VerispecError(f"a streamer shows one sequence; got a batch of {input_ids.shape[0]} (stream each "
                                "prompt alone, or drop the streamer)")
        if getattr(cfg, "num_return_sequences", 1) and cfg.num_return_sequences > 1:
            raise VerispecError("verispec's custom_generate returns one sequence; num_return_sequences must be 1")
        others = sorted({type(p).__name__ for p in (logits_processor or [])} - _ALLOWED)
        if others:
            raise VerispecError(f"verispec's custom_generate keeps the target's law exactly and supports temperature, "
                                f"top_k and top_p only; got {', '.join(others)}")
        prompts = _unpadded(input_ids, model_kwargs.get("attention_mask"))
        greedy = not cfg.do_sample
        sampling = Sampling(0.0 if greedy else float(cfg.temperature if cfg.temperature is not None else 1.0),
                            0 if greedy or cfg.top_k is None else int(cfg.top_k),
                            1.0 if greedy or cfg.top_p is None else float(cfg.top_p))
        eos = cfg.eos_token_id
        eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        check(plan.verifier, None, plan.children, temperature=sampling.temperature)
        target = _target_for(model, eos)
        if draft_spec.kind == "none" or not plan.drafts:
            drafter = NoDrafter()
        else:
            if id(model) not in drafters:
                drafters[id(model)] = build_drafter(draft_spec, target)
            drafter = drafters[id(model)]
        budget = int(cfg.max_length) - int(input_ids.shape[1])
        if budget < 1:
            raise VerispecError(f"max_length {cfg.max_length} leaves no room after a prompt of {input_ids.shape[1]} "
                                "tokens")
        if len(prompts) > 1:
            return _batch(target, drafter, plan, input_ids, prompts, budget, sampling, seed, cfg)
        prompt = prompts[0]
        run = plan.build(target, drafter)
        steps, new = [], []
        for rec in generate_steps(target, run, prompt, max_new_tokens=budget, sampling=sampling, seed=seed):
            steps.append(rec)
            new.extend(rec.emitted)
            if streamer is not None:
                streamer.put(torch.tensor(list(rec.emitted)))
        if streamer is not None:
            streamer.end()
        sequences = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype)], dim=1)
        if getattr(cfg, "return_dict_in_generate", False):
            return SpeculativeOutput(sequences=sequences, steps=steps)
        return sequences

    return generate_fn


def _unpadded(input_ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's prompt without its padding: left padding, as ``generate`` takes for decoder-only models."""
    if mask is None:
        return input_ids.tolist()
    rows = []
    for ids, m in zip(input_ids.tolist(), mask.tolist()):
        first = m.index(1) if 1 in m else len(m)
        if not all(m[first:]):
            raise VerispecError("verispec's custom_generate takes left-padded batches (attention mask zeros before a "
                                "prompt only), as generate does for decoder-only models")
        if first == len(m):
            raise VerispecError("a prompt of the batch is all padding")
        rows.append(ids[first:])
    return rows


def _batch(target, drafter, plan, input_ids, prompts, budget, sampling, seed, cfg):
    """A batch of prompts through the batched engine (``decode.generate_batch``; prompt i's seed is ``seed + i``):
    the padded prompts, then each row's new tokens, padded on the right with the pad token as ``generate`` does."""
    out = generate_batch(target, drafter, plan.verifier, prompts, tree=plan.tree, max_new_tokens=budget,
                         temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                         children=plan.children, policy=plan.policy, seed=seed, max_batch=len(prompts))
    failed = [r.error for r in out if r.error]
    if failed:
        raise VerispecError(failed[0])
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    width = max(len(r.token_ids) for r in out)
    new = torch.tensor([r.token_ids + [pad] * (width - len(r.token_ids)) for r in out], dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, new], dim=1)
    if getattr(cfg, "return_dict_in_generate", False):
        return SpeculativeOutput(sequences=sequences, steps=[r.steps for r in out])
    return sequences
