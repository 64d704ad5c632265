"""The decoding loop: propose -> one target forward over the tree -> verify -> commit -> update policy.

Accepted length per step counts the accepted drafted tokens plus the one recovered/bonus token, so
plain autoregressive decoding (``NoDrafter``) scores exactly 1.0 per step.

A step with nothing drafted (plain decoding, or a policy that drafts nothing this step) does not call the verifier:
every registered verifier returns ``rng.categorical(p[0])`` for a root alone, with the same random calls and no
feedback (tests/test_verifiers.py checks each one), so the loop draws that token itself -- at temperature 0 the
logits' argmax, without the one-hot law a verifier would need.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch

from .backends.base import Target
from .drafters.base import DraftControl, Drafter
from .errors import VerispecError
from .methods import resolve
from .policies import Feedback, Fixed, Policy
from .probs import DEFAULT_TEMPERATURE, Sampling, greedy_index, logits_to_probs
from .rng import Randomness, TorchRandomness
from .tree import DynamicTree, Tree
from .verifiers import check
from .verifiers.base import Verdict, VerifierSpec


@dataclass(frozen=True)
class StepRecord:
    drafted: int  # drafted tokens (tree nodes) this step
    draft_depth: int
    accepted_length: int  # accepted drafted tokens + 1 (recovered/bonus), before EOS/budget truncation
    accepted_ranks: tuple[int, ...]  # candidate index accepted at each depth
    tested: tuple[int, ...]  # candidates tested at each depth reached
    emitted: tuple[int, ...]  # tokens appended to the output (after EOS/budget truncation)
    draft_s: float
    target_s: float
    verify_s: float
    source: str | None = None  # which draft source proposed (a drafter with several), else None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens (EOS included when it stopped on EOS)
    prompt_ids: list[int]
    steps: list[StepRecord]
    stop_reason: str  # "eos" or "max_new_tokens"
    prefill_s: float
    wall_s: float  # whole generation, prefill included
    config: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted_length(self) -> float:
        return sum(s.accepted_length for s in self.steps) / max(len(self.steps), 1)

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.wall_s - self.prefill_s
        return self.num_tokens / decode_s if decode_s > 0 else float("nan")

    def time_split(self) -> dict[str, float]:
        return {k: sum(getattr(s, k) for s in self.steps) for k in ("draft_s", "target_s", "verify_s")}

    def summary(self) -> dict:
        return {
            "tokens": self.num_tokens,
            "steps": len(self.steps),
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_s": self.tokens_per_s,
            "prefill_s": self.prefill_s,
            "wall_s": self.wall_s,
            **self.time_split(),
            "stop_reason": self.stop_reason,
        }

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_ids": self.prompt_ids,
            "config": self.config,
            "summary": self.summary(),
            "steps": [asdict(s) for s in self.steps],
        }


class TextStream:
    """Text as tokens arrive, whole characters only: a character whose bytes span several tokens (most non-Latin
    scripts under byte-level tokenizers) is held back until its last byte arrives, instead of showing as a
    replacement character. ``push(ids)`` returns the new text; ``flush()`` whatever is left at the end."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self.text = ""

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        return self._advance(self._decode(self._ids).rstrip("\ufffd"))

    def flush(self) -> str:
        return self._advance(self._decode(self._ids))

    def _advance(self, text: str) -> str:
        if not text.startswith(self.text):  # the tokenizer rewrote earlier text (rare): show nothing until it settles
            return ""
        new, self.text = text[len(self.text):], text
        return new


def _check_args(target, drafter, verifier, prompt_ids, tree, max_new_tokens, sampling, children, policy):
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise VerispecError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    if not prompt_ids:
        raise VerispecError("the prompt is empty")
    if any(not 0 <= t < target.vocab_size for t in prompt_ids):
        raise VerispecError(f"prompt token ids must lie in [0, {target.vocab_size})")
    need = len(prompt_ids) + max_new_tokens + tree.max_depth
    if need > target.max_context:
        raise VerispecError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) + draft depth ({tree.max_depth}) "
            f"exceeds the model's context of {target.max_context} tokens"
        )
    check(verifier, tree, children, policy.name, 0.0 if sampling.greedy else sampling.temperature)
    drafter.check_compatible(target)


def generate_steps(
    target: Target,
    drafter: Drafter,
    verifier: VerifierSpec,
    prompt_ids: list[int],
    *,
    tree: Tree | DynamicTree,
    max_new_tokens: int,
    sampling: Sampling,
    children: str = "iid",
    policy: Policy | None = None,
    verifier_state=None,
    seed: int = 0,
    stats: dict | None = None,
    rng: Randomness | None = None,
) -> Iterator[StepRecord]:
    """Yield one ``StepRecord`` per step; the emitted tokens of all steps are the generated text.

    ``policy`` and, for a learning verifier, ``verifier_state`` carry what was learned; pass the same
    objects to later calls to keep learning across prompts (by default both start fresh).
    ``stats``, if given, receives ``prefill_s`` (the target's prefill of the prompt). ``rng`` replaces the
    seeded randomness (the audit passes a scripted one to enumerate every outcome of the whole loop).
    """
    policy = policy or Fixed()
    _check_args(target, drafter, verifier, prompt_ids, tree, max_new_tokens, sampling, children, policy)
    if verifier.new_state is not None and verifier_state is None:
        verifier_state = verifier.new_state()
    rng = rng if rng is not None else TorchRandomness(seed)
    t = time.perf_counter()
    state = target.new_state()
    features = drafter.feature_layers
    pre = target.prefill_output(state, prompt_ids[:-1], features=features)
    drafter.reset(prompt_ids)
    if drafter.uses_target_hidden:
        drafter.observe(pre.hidden if pre is not None else torch.zeros(0, 0))
    if stats is not None:
        stats["prefill_s"] = time.perf_counter() - t
    context = list(prompt_ids)
    produced = 0
    while True:
        t0 = time.perf_counter()
        source = drafter.source(context)  # None unless the drafter has several sources
        if source is not None:
            policy.select_source(source)
        planned = tree
        if isinstance(tree, Tree):  # a dynamic tree sets its own depth
            depth = policy.planned_depth(tree.max_depth)
            planned = tree if depth >= tree.max_depth else tree.truncate(max(depth, 0))
        draft = drafter.propose(context, planned, sampling, children, rng, DraftControl.of(policy))
        t1 = time.perf_counter()
        positions = state.committed + torch.tensor(draft.tree.depths)
        out = target.forward(state, draft.tokens, positions, draft.tree.ancestors_mask(), features=features)
        t2 = time.perf_counter()
        if draft.num_drafted:
            p = logits_to_probs(out.logits, sampling)  # [N, V]
            verdict = verifier(draft, p, rng, verifier_state)
            if verifier_state is not None:
                verifier_state.update(verdict.feedback)
        else:  # nothing to verify: a draw from the target, as every verifier returns for a root alone (tested)
            verdict = Verdict((), _draw_root(out.logits[:1], sampling, rng), ())
        t3 = time.perf_counter()
        target.commit(state, [0, *verdict.path])
        t4 = time.perf_counter()
        if drafter.uses_target_hidden:  # the target's features of the root and the accepted path (EAGLE)
            drafter.observe(out.hidden[[0, *verdict.path]])
        drafter.commit(draft, list(verdict.path))
        t5 = time.perf_counter()
        new = [int(draft.tokens[n]) for n in verdict.path] + [verdict.token]
        emitted, stop = [], False
        for tok in new:
            emitted.append(tok)
            produced += 1
            if tok in target.eos_token_ids or produced >= max_new_tokens:
                stop = True
                break
        context.extend(new)
        policy.update(Feedback.from_step(draft, verdict.path))
        ranks = draft.tree.ranks
        yield StepRecord(
            drafted=draft.num_drafted,
            draft_depth=draft.tree.max_depth,
            accepted_length=len(verdict.path) + 1,
            accepted_ranks=tuple(ranks[n] for n in verdict.path),
            tested=verdict.tested,
            emitted=tuple(emitted),
            draft_s=(t1 - t0) + (t5 - t4),
            target_s=(t2 - t1) + (t4 - t3),
            verify_s=t3 - t2,
            source=source,
        )
        if stop:
            return


def _draw_root(logits: torch.Tensor, sampling: Sampling, rng: Randomness) -> int:
    """The token of a step with nothing drafted: ``rng.categorical`` of the target's law, or at temperature 0 the
    argmax of the logits itself (the greedy law's point mass without building it, and without a draw)."""
    if sampling.greedy:
        return int(greedy_index(logits)[0])
    return int(rng.categorical(logits_to_probs(logits, sampling)[0]))


def generate(
    target: Target,
    drafter: Drafter,
    verifier: VerifierSpec | str,
    prompt: str | list[int],
    *,
    tree: Tree | DynamicTree | str | None = None,
    max_new_tokens: int = 128,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int = 0,
    top_p: float = 1.0,
    children: str | None = None,
    policy: Policy | str | None = None,
    verifier_state=None,
    seed: int = 0,
    chat: bool = True,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate from ``prompt`` (text, through the chat template if any, or token ids).

    ``verifier``, ``tree`` and ``policy`` are objects or the names ``verispec generate`` takes (``"specinfer"``,
    ``"3x2"`` or ``"auto"``, ``"auto"`` or ``"fixed:3"``), resolved by ``methods.resolve``; left out, they are those
    of the method ``fixed``: the whole ``DEFAULT_TREE`` every step. ``children`` defaults to the child mode the
    verifier needs (``iid`` for those that take any). ``on_tokens`` is called with each step's emitted tokens as
    soon as they are verified (streaming).
    """
    sampling = Sampling(temperature, top_k, top_p)
    recipe = resolve("fixed", verifier=verifier, tree=tree, policy=policy, children=children).build(
        target, drafter, verifier_state)
    prompt_ids = target.encode_prompt(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
    start = time.perf_counter()
    steps, out, stats = [], [], {}
    for rec in generate_steps(
        target, drafter, recipe.verifier, prompt_ids, tree=recipe.tree, max_new_tokens=max_new_tokens,
        sampling=sampling, children=recipe.children, policy=recipe.policy, verifier_state=recipe.verifier_state,
        seed=seed, stats=stats,
    ):
        steps.append(rec)
        out.extend(rec.emitted)
        if on_tokens is not None:
            on_tokens(list(rec.emitted))
    wall = time.perf_counter() - start
    stop = "eos" if out and out[-1] in target.eos_token_ids else "max_new_tokens"
    config = {
        "target": target.name, "draft": drafter.name, "verifier": recipe.verifier.name,
        "tree": list(recipe.tree.parents) if isinstance(recipe.tree, Tree) else str(recipe.tree),
        "children": recipe.children, "temperature": temperature, "top_k": top_k, "top_p": top_p,
        "max_new_tokens": max_new_tokens, "seed": seed, "policy": recipe.policy.name,
    }
    return GenerationResult(
        text=target.decode(out), token_ids=out, prompt_ids=prompt_ids, steps=steps, stop_reason=stop,
        prefill_s=stats.get("prefill_s", 0.0), wall_s=wall, config=config,
    )
