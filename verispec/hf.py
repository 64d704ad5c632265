"""The Hugging Face door: verispec's loop as a ``custom_generate`` for ``transformers``' own ``generate``.

    import verispec.hf
    out = model.generate(**inputs, custom_generate=verispec.hf.speculative(draft="auto"), do_sample=True,
                         temperature=0.6, max_new_tokens=64, streamer=streamer)

The generation config is honoured: ``do_sample`` (greedy when False), ``temperature``, ``top_k``, ``top_p``,
``max_new_tokens`` / ``max_length``, ``eos_token_id``, the ``streamer``, and ``return_dict_in_generate`` (the
output then also carries verispec's per-step records as ``steps``). What verispec cannot do exactly it refuses with
one clear error: batches of more than one sequence, beam search, several returned sequences, and logits processors
that are not temperature, top-k or top-p (a repetition penalty, say, changes the target law step by step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .errors import VerispecError

_WRAPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF model -> the CausalLM verispec made for it


def default_model():
    """The built-in default model as (Hugging Face model, tokenizer), known to verispec (so ``draft="auto"`` finds
    its shipped head)."""
    from .backends import load  # noqa: PLC0415

    target = load()
    _WRAPPED[target.hf] = target
    return target.hf, target.tokenizer


def _target_for(model, eos: frozenset[int]):
    from .backends import CausalLM  # noqa: PLC0415

    known = _WRAPPED.get(model)
    target = known if known is not None else CausalLM(model, None, name=getattr(model.config, "_name_or_path", "model"))
    if eos and eos != target.eos_token_ids:
        target = _with_eos(target, eos)
    return target


def _with_eos(target, eos: frozenset[int]):
    import copy  # noqa: PLC0415

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


def _policy(policy: str, target, drafter):
    from .policies import get_policy  # noqa: PLC0415

    if policy.partition(":")[0] != "auto":
        return get_policy(policy)
    from .backends.costs import auto_policy  # noqa: PLC0415

    return auto_policy(target, drafter, policy)


def _callers_streamer():
    """The ``streamer`` given to ``generate``: transformers 5.24 puts the prompt into it but does not pass it on to a
    callable ``custom_generate`` (only keywords outside its own sampling signature are passed), so read it from the
    ``generate`` call that called us."""
    import inspect  # noqa: PLC0415

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
    anything runs."""
    from .drafters import DraftSpec  # noqa: PLC0415
    from .policies import get_policy  # noqa: PLC0415
    from .tree import Tree  # noqa: PLC0415
    from .verifiers import get_verifier  # noqa: PLC0415

    draft_spec = DraftSpec.parse(draft)
    spec = get_verifier(verifier)
    get_policy(policy)
    if tree != "auto":
        Tree.parse(tree)
    drafters: dict = {}

    def generate_fn(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                    synced_gpus=False, streamer=None, **model_kwargs):
        from .decode import generate_steps  # noqa: PLC0415
        from .drafters import NoDrafter, build_drafter  # noqa: PLC0415
        from .probs import Sampling  # noqa: PLC0415

        cfg = generation_config
        if streamer is None:
            streamer = _callers_streamer()
        if getattr(cfg, "num_beams", 1) and cfg.num_beams > 1:
            raise VerispecError("verispec.hf.speculative samples or decodes greedily; beam search (num_beams > 1) "
                                "is not supported")
        if input_ids.shape[0] != 1:
            raise VerispecError(f"verispec.hf.speculative decodes one sequence at a time; got a batch of "
                                f"{input_ids.shape[0]}")
        if getattr(cfg, "num_return_sequences", 1) and cfg.num_return_sequences > 1:
            raise VerispecError("verispec.hf.speculative returns one sequence; num_return_sequences must be 1")
        others = sorted({type(p).__name__ for p in (logits_processor or [])} - _ALLOWED)
        if others:
            raise VerispecError(f"verispec.hf.speculative keeps the target's law exactly and supports temperature, "
                                f"top_k and top_p only; got {', '.join(others)}")
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise VerispecError("verispec.hf.speculative needs an unpadded prompt (the attention mask has zeros)")
        greedy = not cfg.do_sample
        sampling = Sampling(0.0 if greedy else float(cfg.temperature if cfg.temperature is not None else 1.0),
                            0 if greedy or cfg.top_k is None else int(cfg.top_k),
                            1.0 if greedy or cfg.top_p is None else float(cfg.top_p))
        eos = cfg.eos_token_id
        eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        target = _target_for(model, eos)
        if draft_spec.kind == "none":
            drafter = NoDrafter()
        else:
            if id(model) not in drafters:
                drafters[id(model)] = build_drafter(draft_spec, target)
            drafter = drafters[id(model)]
        shape = Tree.root_only() if isinstance(drafter, NoDrafter) else \
            Tree.parse(getattr(drafter, "default_tree", None) or "chain:5") if tree == "auto" else Tree.parse(tree)
        prompt = input_ids[0].tolist()
        budget = int(cfg.max_length) - len(prompt)
        if budget < 1:
            raise VerispecError(f"max_length {cfg.max_length} leaves no room after a prompt of {len(prompt)} tokens")
        steps, new = [], []
        for rec in generate_steps(target, drafter, spec, prompt, tree=shape, max_new_tokens=budget, sampling=sampling,
                                  children=children or spec.children or "iid",
                                  policy=_policy(policy, target, drafter), seed=seed):
            steps.append(rec)
            new.extend(rec.emitted)
            if streamer is not None:
                streamer.put(torch.tensor(list(rec.emitted)))
        if streamer is not None:
            streamer.end()
        sequences = torch.tensor([prompt + new], dtype=input_ids.dtype)
        if getattr(cfg, "return_dict_in_generate", False):
            return SpeculativeOutput(sequences=sequences, steps=steps)
        return sequences

    return generate_fn
