"""What the decoding loop needs from a target model: the ``Target`` protocol, the output of a forward, and the prompt
encoding every backend shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import VerispecError


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [n, V] float32
    hidden: torch.Tensor  # [n, k H] hidden states of the k requested layers (default: the last, after the final norm)


class Target(Protocol):
    """A target model as the decoding loop uses it.

    A *state* holds one sequence's cache: ``committed`` entries (the text so far) and *pending* ones (tree nodes of
    the last forward). ``forward`` runs tokens at given positions on top of a state, each token seeing the committed
    entries and the pending ones ``attend`` allows, and returns per-token logits (and hidden states of the requested
    ``features`` layers, where the engine has them); ``commit`` keeps the listed pending entries, in order, and drops
    the rest; ``forward_batch`` does the same for several sequences' states in one pass of the model (an engine that
    cannot refuses more than one with a clear error). ``backend`` says which engine it is (``"hf"`` or
    ``"llama"``): drafts that need a model's weights or features ask it, never the object's attributes. ``forward_id`` names what a forward computes with (model file,
    engine, threads, kernels), the key under which its measured costs are kept."""

    name: str
    backend: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_context: int

    @property
    def forward_id(self) -> str: ...

    def new_state(self): ...

    def prefill(self, state, tokens: list[int]) -> torch.Tensor | None: ...

    def prefill_output(self, state, tokens: list[int], inputs_embeds=None,
                       features: tuple[int, ...] = (-1,)) -> ForwardOutput | None: ...

    def forward(self, state, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                features: tuple[int, ...] = (-1,)) -> ForwardOutput: ...

    def forward_batch(self, states: list, tokens: list[torch.Tensor], positions: list[torch.Tensor],
                      attends: list[torch.Tensor], features: tuple[int, ...] = (-1,),
                      logits_from: list[int] | None = None) -> list[ForwardOutput]: ...

    def state_pool(self, slots: int, capacity: int):
        """States for a batch sized up front (``acquire()`` / ``release(state)``), or None: ``new_state`` then."""

    def commit(self, state, keep: list[int]) -> None: ...

    def encode_prompt(self, prompt: str | list[dict], chat: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool, name: str) -> list[int]:
    """Token ids for a user prompt, through the chat template when the tokenizer has one (every backend's rule), or
    for a conversation (a list of ``{"role", "content"}`` messages, which needs a chat template)."""
    if not isinstance(prompt, list) and (not isinstance(prompt, str) or not prompt.strip()):
        raise VerispecError("the prompt is empty")
    if tokenizer is None:
        raise VerispecError(f"model {name!r} has no tokenizer; pass token ids instead")
    for text in [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt if isinstance(m, dict)]:
        _check_text(text)
    if isinstance(prompt, list):
        if not getattr(tokenizer, "chat_template", None):  # a Hugging Face tokenizer's optional attribute
            raise VerispecError(f"model {name!r} has no chat template; send a plain prompt instead")
        return _templated(tokenizer, prompt)
    if chat and getattr(tokenizer, "chat_template", None):
        return _templated(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def _check_text(text) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON can carry and no
    tokenizer can encode) with one sentence naming where it is."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise VerispecError(f"the text is not valid Unicode: a lone surrogate ({text[exc.start]!r}) at character "
                            f"{exc.start}") from None


def _templated(tokenizer, messages: list[dict]) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template may refuse a conversation (jinja raises its own errors)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise VerispecError(f"the chat template refused these messages: {first}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
