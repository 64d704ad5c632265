"""verispec audit-engine: its statistics on laws it knows, and (slow) verispec's own engine, batch and server audited
on a tiny model, with the negative controls that must be flagged."""

from __future__ import annotations

import importlib.util
import random
from collections import Counter

import pytest
import torch

from verispec.audit.engines import (ALPHA, EngineAdapter, check_engine, detectable_tv, engine_law, tv_estimate,
                                    tv_interval, two_sample)
from verispec.probs import Sampling


class TableEngine(EngineAdapter):
    """An engine over a fixed two-token law: ``wrong`` samples its first token from another law."""

    name = "table"

    def __init__(self, first, second, wrong=None):
        self.first, self.second, self.wrong = torch.tensor(first), torch.tensor(second), wrong

    def sample(self, prompt, k, seed, sampling):
        g = torch.Generator().manual_seed(seed)
        law = self.first if self.wrong is None else torch.tensor(self.wrong)
        a = int(torch.multinomial(law, 1, generator=g))
        return [a, int(torch.multinomial(self.second[a], 1, generator=g))], 1

    def next_logits(self, prompt, prefixes):
        rows = [self.first if not p else self.second[p[0]] for p in prefixes]
        return torch.stack(rows).log()

    def plain(self):
        return TableEngine(self.first.tolist(), self.second.tolist())


FIRST = [0.5, 0.3, 0.2]
SECOND = [[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]]


def test_engine_law_is_the_product_of_the_teacher_forced_laws():
    law = engine_law(TableEngine(FIRST, SECOND), [0], 2, Sampling(1.0))
    assert law[(1, 2)] == pytest.approx(0.3 * 0.6) and sum(law.values()) == pytest.approx(1.0)


def test_a_right_engine_passes_and_a_wrong_one_is_flagged_by_both_tests():
    right = check_engine(TableEngine(FIRST, SECOND), [0], 2, 3000, Sampling(1.0))
    assert not right.differs and right.test == "exact law" and right.tv_low <= right.tv <= right.tv_high
    assert right.detectable_tv < 0.1
    wrong = TableEngine(FIRST, SECOND, wrong=[0.4, 0.35, 0.25])  # TV 0.1 on the first token
    assert check_engine(wrong, [0], 2, 3000, Sampling(1.0)).differs
    wrong.next_logits = lambda prompt, prefixes: None  # no logits: against its plain sampling
    two = check_engine(wrong, [0], 2, 3000, Sampling(1.0))
    assert two.test == "two-sample" and two.differs


def test_two_sample_passes_one_law_and_the_tv_estimate_finds_a_shift():
    rnd = random.Random(0)
    a = Counter(rnd.choices(range(5), [5, 4, 3, 2, 1], k=4000))
    b = Counter(rnd.choices(range(5), [5, 4, 3, 2, 1], k=4000))
    assert two_sample(a, b)[2] > ALPHA
    law = {(i,): w / 15 for i, w in enumerate([5, 4, 3, 2, 1])}
    shifted = Counter({(i,): int(4000 * w) for i, w in enumerate([0.4, 0.25, 0.2, 0.1, 0.05])})
    assert tv_estimate(shifted, law, 4000) == pytest.approx(0.5 * sum(abs(x - y) for x, y in zip(
        [0.4, 0.25, 0.2, 0.1, 0.05], [5 / 15, 4 / 15, 3 / 15, 2 / 15, 1 / 15])), abs=1e-9)


def test_the_tv_interval_covers_the_true_tv_and_reaches_zero_for_the_same_law():
    """The bias-corrected estimate is less biased than the plug-in, and the triangle inequality's interval
    covers the true total variation about 95 % of the time: from 0 for a sample of the law itself (where a percentile
    interval of the plug-in lies above the plug-in, far from 0), and for a sample of a law 0.05 away."""
    weights = [0.2, 0.15, 0.1] + [0.55 / 30] * 30
    law = {(i,): w for i, w in enumerate(weights)}
    shifted = [w * (1.5 if i < 3 else 1.0) for i, w in enumerate(weights)]
    shifted = [w / sum(shifted) for w in shifted]
    for truth_law in (weights, shifted):
        truth = 0.5 * sum(abs(a - b) for a, b in zip(truth_law, weights))
        covered, plugin_err, corrected_err = 0, 0.0, 0.0
        for seed in range(40):
            rnd = random.Random(seed)
            counts = Counter((i,) for i in rnd.choices(range(len(weights)), truth_law, k=2000))
            est, low, high = tv_interval(counts, law, 2000, reps=200, seed=seed)
            assert 0.0 <= low <= est <= high <= 1.0
            covered += low <= truth <= high
            plugin_err += tv_estimate(counts, law, 2000) - truth
            corrected_err += est - truth
        assert covered >= 34, (truth, covered)  # 95 % of 40 is 38; allow for chance
        assert abs(corrected_err) < abs(plugin_err)  # less biased (mean errors over the 40 samples)


def test_more_samples_detect_smaller_faults():
    law = {(i,): w for i, w in enumerate([0.3, 0.2, 0.1] + [0.4 / 40] * 40)}
    assert detectable_tv(law, 5000) < detectable_tv(law, 500)


@pytest.mark.slow
def test_verispecs_own_engine_batch_and_server_keep_the_law_and_the_controls_are_flagged():
    """On a tiny model, sharpened so that few outcomes of two tokens hold the mass: the loop with prompt lookup
    drafting a fixed chain of 3, the batched engine at 4, and ``verispec serve`` (tests/tiny_server.py, loopback,
    stopped by pid) keep the target's law; a sampler returning the argmax and one applying the temperature twice are
    flagged by the same harness at the same N."""
    from conftest import tiny_model, tiny_text_model
    from test_serve import server_process

    from verispec.audit.adapters import ArgmaxControl, DoubleTemperatureControl, ServeAdapter, VerispecAdapter

    target = tiny_model("llama", seed=0, layers=2)
    target.eos_token_ids = frozenset()
    with torch.no_grad():
        target.hf.get_output_embeddings().weight.mul_(4.0)
    prompt = [5, 17, 33, 8, 9, 41, 5, 17, 33]
    pieces = dict(draft="ngram", tree="chain:3", policy="fixed")
    s = Sampling(0.8)
    for adapter in (VerispecAdapter(target, **pieces), VerispecAdapter(target, batch=4, **pieces, name="batch")):
        row = check_engine(adapter, prompt, 2, 2000, s, floor=1e-4)
        assert not row.differs and row.drafted > 0.5 and row.cells > 20, row
    for control in (ArgmaxControl(target, **pieces), DoubleTemperatureControl(target, **pieces)):
        assert check_engine(control, prompt, 2, 2000, s, floor=1e-4, control=True).differs

    with server_process("--max-batch", "4") as (_, url):  # tests/tiny_server.py: prompt lookup, chain of 3
        served = ServeAdapter(url, tiny_text_model(), concurrency=4)
        ids = list(b"abcabcabcab")
        row = check_engine(served, ids, 1, 1500, Sampling(1.0), floor=1e-4)
    assert not row.differs and row.drafted > 0 and row.cells > 50, row


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed (the "
                    "optional extra: bash scripts/install_llama.sh; then .venv/bin/python -m pytest -q "
                    "tests/test_audit_engine.py -k llama)")
def test_llama_cpp_prompt_lookup_keeps_its_own_models_law():
    """llama-cpp-python's prompt-lookup speculative decoding of the default model's GGUF file, on a prompt whose text
    it drafts from, keeps the law of that model's own logits (read from llama.cpp by teacher forcing), while its
    drafts are used; runs checked against a law at half the temperature are flagged."""
    from verispec import load
    from verispec.audit.adapters import LlamaCppAdapter

    target = load("smollm2-135m", dtype="float32")
    adapter = LlamaCppAdapter(target)
    prompt = target.encode_prompt("red, blue, green, red, blue, green, red, blue, green, red,", chat=False)
    row = check_engine(adapter, prompt, 2, 600, Sampling(1.0))
    assert not row.differs and row.drafted > 1 and row.cells >= 3, row

    class HalfTemperatureLaw(LlamaCppAdapter):
        def next_logits(self, prompt, prefixes):
            return super().next_logits(prompt, prefixes) * 2  # the law at T / 2: the runs' law is not this one

    spread = target.encode_prompt("Name an animal.")  # many first tokens: a sharper law is far from the runs'
    assert check_engine(HalfTemperatureLaw(target), spread, 2, 600, Sampling(1.0), control=True).differs


def _no_llama_server() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    from verispec.bench.peers import llama_server_binary

    return None if llama_server_binary() else "no llama-server binary"


@pytest.mark.slow
@pytest.mark.skipif(_no_llama_server() is not None, reason=f"{_no_llama_server()} (the optional extra and its server: "
                    "bash scripts/install_llama.sh; .venv/bin/python scripts/llama_build.py server; then "
                    ".venv/bin/python -m pytest -q tests/test_audit_engine.py -k llama)")
def test_llama_server_with_a_draft_model_keeps_its_own_models_law():
    """llama.cpp's llama-server speculating with a draft model (-md) keeps the law of its GGUF file's own logits while
    it drafts, the server it started is gone after ``close``, and runs checked against a law at half the temperature
    are flagged."""
    from verispec import load
    from verispec.audit.adapters import LlamaServerAdapter

    target = load("smollm2-135m", dtype="float32")
    adapter = LlamaServerAdapter(target)
    prompt = target.encode_prompt("Name an animal.")
    try:
        row = check_engine(adapter, prompt, 2, 600, Sampling(1.0))
        assert not row.differs and row.drafted >= 1 and row.cells >= 3, row  # every second token was drafted

        class HalfTemperatureLaw(LlamaServerAdapter):
            def next_logits(self, prompt, prefixes):
                return super().next_logits(prompt, prefixes) * 2  # the law at T / 2: the runs' law is not this one

        wrong = HalfTemperatureLaw(target)
        try:
            assert check_engine(wrong, prompt, 2, 600, Sampling(1.0), control=True).differs
        finally:
            wrong.close()
    finally:
        server = adapter.process
        adapter.close()
    assert server is not None and server.poll() is not None  # started for the audit, stopped by close
