"""The systems people use today, run in the same process on the same models: Hugging Face ``generate``
of the target, plain and assisted (``assistant_model=draft``).

Sampling settings are matched to verispec's: ``temperature`` (0 = greedy), top-k and top-p off
(Hugging Face's default top-k of 50 is disabled). The assistant's ``generation_config`` keeps Hugging
Face's defaults unless given (20 assistant tokens, "constant" schedule, confidence threshold 0.4,
re-fitted by ROC when scikit-learn is installed). ``assisted`` also counts, per verification, the
drafted and accepted tokens, by observing Hugging Face's own ``update_candidate_strategy`` call.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from .models import CausalLM


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
    from transformers.generation import candidate_generator as cg  # noqa: PLC0415

    original = cg.AssistedCandidateGenerator.update_candidate_strategy

    def observe(self, input_ids, scores, num_matches):
        drafted.append(int(scores.shape[1]) - 1)
        accepted.append(int(num_matches))
        return original(self, input_ids, scores, num_matches)

    cg.AssistedCandidateGenerator.update_candidate_strategy = observe
    try:
        yield
    finally:
        cg.AssistedCandidateGenerator.update_candidate_strategy = original


def hf_generate(target: CausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int = 0,
                assistant: CausalLM | None = None, assistant_config: dict | None = None) -> PeerResult:
    """Hugging Face ``generate`` of ``target`` (with ``assistant`` as draft if given); stops at EOS."""
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
    inputs = torch.tensor([prompt_ids])
    with ctx, torch.no_grad():
        t = time.perf_counter()
        out = target.hf.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
        wall = time.perf_counter() - t
    return PeerResult(out[0, len(prompt_ids):].tolist(), wall, drafted, accepted)
