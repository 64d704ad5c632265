"""The decoding loop: propose -> one target forward over the tree -> verify -> commit -> update policy.

Accepted length per step counts the accepted drafted tokens plus the one recovered/bonus token, so
plain autoregressive decoding (``NoDrafter``) scores exactly 1.0 per step.

A step with nothing drafted (plain decoding, or a policy that drafts nothing this step) does not call the verifier:
every registered verifier returns ``rng.categorical(p[0])`` for a root alone, with the same random calls and no
feedback (tests/test_verifiers.py checks each one), so the loop draws that token itself -- at temperature 0 the
logits' argmax, without the one-hot law a verifier would need.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

from .backends.base import Target
from .drafters.base import Drafter
from .engine import Engine, run_all
from .errors import VerispecError
from .methods import DEFAULT_METHOD, Recipe, resolve
from .policies import Policy
from .probs import DEFAULT_TEMPERATURE, Sampling
from .rng import Randomness
from .sequence import StepRecord
from .tree import DynamicTree, Tree
from .verifiers.base import VerifierSpec


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens (EOS included when it stopped on EOS)
    prompt_ids: list[int]
    steps: list[StepRecord]
    stop_reason: str  # "eos" or "max_new_tokens" ("error" or "cancelled" in a batch, which go on without it)
    prefill_s: float
    wall_s: float  # whole generation, prefill included (in a batch: from submission to the last token)
    config: dict = field(default_factory=dict)
    error: str | None = None  # why a sequence of a batch failed (the others went on)
    first_token_s: float | None = None  # from submission to the first token (time to first token)

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
            "error": self.error,
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


def generate_steps(
    target: Target,
    recipe: Recipe,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int = 0,
    stats: dict | None = None,
    rng: Randomness | None = None,
) -> Iterator[StepRecord]:
    """Yield one ``StepRecord`` per step of decoding ``prompt_ids`` with ``recipe`` (``Plan.build``); the emitted
    tokens of all steps are the generated text.

    The recipe's policy and, for a learning verifier, its ``verifier_state`` carry what was learned; pass the same
    recipe to later calls to keep learning across prompts. ``stats``, if given, receives ``prefill_s`` (the target's
    prefill of the prompt). ``rng`` replaces the seeded randomness (the audit passes a scripted one to enumerate
    every outcome of the whole loop).
    """
    engine = Engine(target)
    seq = engine.submit(prompt_ids, recipe, sampling=sampling, max_new_tokens=max_new_tokens, seed=seed, rng=rng)
    engine.step()  # the prefill, and the first step
    if stats is not None:
        stats["prefill_s"] = seq.prefill_s
    yield seq.steps[-1]
    while not seq.done:
        engine.step()
        yield seq.steps[-1]


def generate(
    target: Target,
    drafter: Drafter,
    verifier: VerifierSpec | str | Recipe,
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
    of the method ``default``, as in ``verispec generate``: the draft's tuned tree, and the ``auto`` policy choosing
    each step's depth. ``children`` defaults to the child mode the verifier needs (``iid`` for those that take any).
    A ``methods.Recipe`` (``Plan.build``) in the verifier's place is decoded with as it is (its tree, policy, child
    mode and learning state: then leave those out). ``on_tokens`` is called with each step's emitted tokens as soon
    as they are verified (streaming).
    """
    sampling = Sampling(temperature, top_k, top_p)
    recipe = _recipe(target, drafter, verifier, tree, policy, children, verifier_state)
    prompt_ids = target.encode_prompt(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
    start = time.perf_counter()
    steps, out, stats = [], [], {}
    for rec in generate_steps(target, recipe, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                              stats=stats):
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


def _recipe(target, drafter, verifier, tree, policy, children, verifier_state) -> Recipe:
    """What ``generate`` decodes with: a recipe given whole, or the method ``default`` with the given overrides."""
    if not isinstance(verifier, Recipe):
        return resolve(DEFAULT_METHOD, verifier=verifier, tree=tree, policy=policy, children=children).build(
            target, drafter, verifier_state)
    if tree is not None or policy is not None or children is not None or verifier_state is not None:
        raise VerispecError("a recipe is decoded with as it is: leave tree, policy, children and verifier_state out")
    return verifier if verifier.drafter is not None else dataclasses.replace(verifier, drafter=drafter)


def generate_batch(
    target: Target,
    drafter: Drafter,
    verifier: VerifierSpec | str,
    prompts: list[str | list[int]],
    *,
    tree: Tree | DynamicTree | str | None = None,
    max_new_tokens: int | list[int] = 128,
    temperature: float | list[float] = DEFAULT_TEMPERATURE,
    top_k: int = 0,
    top_p: float = 1.0,
    children: str | None = None,
    policy: str | None = None,
    seed: int | list[int] = 0,
    chat: bool = True,
    max_batch: int = 8,
    row_budget: int | None = None,
    load_aware: bool = True,
    prefill_chunk: int | None = 128,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> list[GenerationResult]:
    """``generate`` for many prompts at once, through one ``engine.Engine``: up to ``max_batch`` sequences share each
    target forward, a finished one frees its slot for the next prompt. Each sequence has its own draft state, policy
    (built from the ``policy`` name: policies learn per sequence) and randomness (``seed``: one per prompt, or a base
    that the i-th prompt adds i to). ``max_new_tokens`` and ``temperature`` may be given per prompt.
    ``load_aware``: with ``auto`` policies, depths are chosen for the batch from the measured cost of its forwards
    (lengths only; the output law is the verifier's either way). ``prefill_chunk``: a joining prompt goes through
    the running sequences' forwards this many tokens at a time (``engine.Engine``). A prompt that cannot run (empty,
    too long) comes back
    with ``error`` set, and the others run. ``on_tokens(i, tokens)`` streams prompt i's tokens."""
    if policy is not None and not isinstance(policy, str):
        raise VerispecError("generate_batch builds one policy per sequence: give the policy by name")
    n = len(prompts)
    if not n:
        return []
    per = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * n  # noqa: E731
    budgets, temperatures = per(max_new_tokens), per(temperature)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed + i for i in range(n)]
    if not len(budgets) == len(temperatures) == len(seeds) == n:
        raise VerispecError(f"max_new_tokens, temperature and seed must be given once or once per prompt ({n})")
    plan = resolve(DEFAULT_METHOD, verifier=verifier, tree=tree, policy=policy, children=children)
    encoded: list[list[int] | str] = []  # a prompt's ids, or why it has none
    for prompt in prompts:
        try:
            encoded.append(target.encode_prompt(prompt, chat=chat) if isinstance(prompt, str) else list(prompt))
        except VerispecError as exc:
            encoded.append(str(exc))
    size = plan.tree_for(drafter).size
    longest = max((len(e) + b + size for e, b in zip(encoded, budgets) if not isinstance(e, str)), default=1)
    engine = Engine(target, max_batch=min(max_batch, n), row_budget=row_budget, load_aware=load_aware, isolate=True,
                    max_context=min(longest, target.max_context),  # the batch's caches, sized for its longest
                    prefill_chunk=prefill_chunk if n > 1 else None)
    seqs: list = []
    failed: dict[int, tuple[list[int], str]] = {}  # prompt -> (its ids, why it cannot run)
    for i, prompt_ids in enumerate(encoded):
        try:
            if isinstance(prompt_ids, str):
                raise VerispecError(prompt_ids)
            seqs.append(engine.submit(prompt_ids, plan.start(target, drafter),
                                      sampling=Sampling(temperatures[i], top_k, top_p), max_new_tokens=budgets[i],
                                      seed=seeds[i], id=i))
        except VerispecError as exc:
            failed[i] = ([] if isinstance(prompt_ids, str) else prompt_ids, str(exc))
            seqs.append(None)

    def stream(seq):
        if on_tokens is not None and seq.steps:
            on_tokens(seq.id, list(seq.steps[-1].emitted))

    run_all(engine, stream)
    out = []
    for i, seq in enumerate(seqs):
        if seq is None:
            out.append(GenerationResult("", [], failed[i][0], [], "error", 0.0, 0.0, {}, error=failed[i][1]))
            continue
        config = {"target": target.name, "draft": seq.drafter.name, "verifier": seq.verifier.name,
                  "tree": list(seq.tree.parents) if isinstance(seq.tree, Tree) else str(seq.tree),
                  "children": seq.children, "temperature": temperatures[i], "top_k": top_k, "top_p": top_p,
                  "max_new_tokens": budgets[i], "seed": seeds[i], "policy": seq.policy.name, "max_batch": max_batch}
        end = seq.finished if seq.finished is not None else time.perf_counter()
        out.append(GenerationResult(
            text=target.decode(seq.token_ids), token_ids=list(seq.token_ids), prompt_ids=seq.prompt_ids,
            steps=list(seq.steps), stop_reason=seq.stop_reason or "error", prefill_s=seq.prefill_s,
            wall_s=end - seq.submitted, config=config, error=seq.error,
            first_token_s=None if seq.first_token is None else seq.first_token - seq.submitted))
    return out
