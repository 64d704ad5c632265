"""The benchmark harness: metrics from hand-written records, resume, and end-to-end runs (tiny model and CLI)."""

import json
import math

import pytest
from conftest import ByteTokenizer, tiny_model

from verispec import cli
from verispec.bench.peers import PEERS
from verispec.bench.records import Results, read_records
from verispec.bench.report import loop_summary, loops_csv, report, rows_csv, summarize, table_width
from verispec.bench.runner import BenchConfig, Runner, plan, plan_groups, run_bench
from verispec.bench.stats import ratio_of_loops, ratio_of_rates
from verispec.datasets import jsonl_problems, load_prompts
from verispec.errors import VerispecError
from verispec.methods import resolve

HEADER = {"type": "header", "config": {"methods": ["ar", "fixed", "hf-generate", "hf-assisted"], "drafts": ["d"]},
          "command": "hand", "machine": {}, "versions": {}, "git": "x"}


def cell(method, prompt, draft="-", t=0.6, seed=0):
    return {"T": t, "seed": seed, "prompt": prompt, "draft": draft, "method": method}


def prompt_rec(c, tokens, wall, category="qa", correct=None):
    return {"type": "prompt", "cell": c, "dataset": "x", "category": category, "tokens": tokens, "wall_s": wall,
            "prefill_s": 0.0, "steps": 0, "correct": correct, "text": ""}


def step(c, acc_len, drafted=0, depth=0, ranks=(), tested=(), draft_s=0.0, target_s=0.0, verify_s=0.0):
    return {"type": "step", "cell": c, "drafted": drafted, "depth": depth, "accepted_length": acc_len,
            "accepted_ranks": list(ranks), "tested": list(tested), "draft_s": draft_s, "target_s": target_s,
            "verify_s": verify_s}


def hand_records():
    recs = [HEADER]
    # ar: prompt a (qa) 4 tokens in 2.0 s, prompt b (rag) 6 tokens in 2.0 s; target 0.1 s per step
    for p, n, wall, cat in (("a", 4, 2.0, "qa"), ("b", 6, 2.0, "rag")):
        c = cell("ar", p)
        recs += [step(c, 1, target_s=0.1) for _ in range(n)] + [prompt_rec(c, n, wall, cat)]
    # fixed with draft d: prompt a 4 tokens in 1.0 s (2 steps), prompt b 6 tokens in 1.0 s (2 steps)
    c = cell("fixed", "a", "d")
    recs += [dict(step(c, 3, 2, 2, (0, 0), (1, 1, 1), draft_s=0.05, target_s=0.1, verify_s=0.01), i=0),
             step(c, 1, 2, 2, (), (1,), draft_s=0.03, target_s=0.1, verify_s=0.01), prompt_rec(c, 4, 1.0, "qa")]
    c = cell("fixed", "b", "d")
    recs += [step(c, 3, 2, 2, (0, 0), (1, 1, 1), draft_s=0.04, target_s=0.1, verify_s=0.01),
             step(c, 3, 2, 2, (0, 0), (1, 1, 1), draft_s=0.04, target_s=0.1, verify_s=0.01),
             prompt_rec(c, 6, 1.0, "rag")]
    # hf-generate: only prompt a (the ratio uses the shared prompt only); no step records
    recs.append(prompt_rec(cell("hf-generate", "a"), 4, 1.6, "qa"))
    # hf-assisted with d: both prompts, one verification each
    c = cell("hf-assisted", "a", "d")
    recs += [{"type": "step", "cell": c, "drafted": 5, "accepted_length": 4}, prompt_rec(c, 4, 0.8, "qa")]
    c = cell("hf-assisted", "b", "d")
    recs += [{"type": "step", "cell": c, "drafted": 5, "accepted_length": 2}, prompt_rec(c, 6, 1.6, "rag")]
    # an unfinished cell: its steps must not count
    recs.append(step(cell("fixed", "c", "d"), 99, 2, 2, (0, 0), (1, 1, 1), draft_s=9.0))
    return recs


def write(path, recs, partial_tail=True):
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
        if partial_tail:
            f.write('{"type": "step", "cell": {"T": 0.6')  # a line cut short by an interruption


def test_metrics_from_hand_written_records(tmp_path):
    path = tmp_path / "r.jsonl"
    write(path, hand_records())
    res = Results.load(path)
    rows = {(r.method, r.draft): r for r in summarize(res)}
    ar, fixed, gen, hfa = rows["ar", "-"], rows["fixed", "d"], rows["hf-generate", "-"], rows["hf-assisted", "d"]
    assert ar.tokens_per_s == pytest.approx(10 / 4.0) and ar.mean_accepted_length == 1.0
    assert fixed.tokens_per_s == pytest.approx(10 / 2.0)
    assert fixed.mean_accepted_length == pytest.approx((3 + 1 + 3 + 3) / 4)
    assert fixed.vs["speedup_ar"] == pytest.approx(2.0)
    # against HF generate only prompt a is shared: (4 / 1.0) / (4 / 1.6)
    assert fixed.vs["vs_hf_generate"] == pytest.approx(1.6)
    assert ar.vs["vs_hf_generate"] == pytest.approx((4 / 2.0) / (4 / 1.6))
    assert fixed.vs["vs_hf_assisted"] == pytest.approx((10 / 2.0) / (10 / 2.4))
    assert fixed.vs["vs_best_hf_assisted"] == pytest.approx(fixed.vs["vs_hf_assisted"])
    assert ar.vs["vs_best_hf_assisted"] < 1
    assert hfa.mean_accepted_length == pytest.approx(3.0) and hfa.drafted_per_step == pytest.approx(5.0)
    assert math.isnan(gen.mean_accepted_length) and math.isnan(gen.draft_ms)
    # time split per step; draft cost leaves out a prompt's first step (i = 0: it includes the draft's prefill):
    # (0.11 s / 6 drafted levels) / 0.1 s per ar target forward
    assert fixed.draft_ms == pytest.approx(1000 * 0.16 / 4)
    assert fixed.target_ms == pytest.approx(100.0) and fixed.verify_ms == pytest.approx(10.0)
    assert fixed.draft_cost == pytest.approx(0.11 / 6 / 0.1)
    # candidate 1: tested at 3 + 1 + 3 + 3 depths, accepted at 2 + 0 + 2 + 2 of them
    assert fixed.per_candidate == pytest.approx([6 / 10])
    cats = {(r.method, r.category): r for r in summarize(res, by_category=True) if r.draft == "d"}
    assert cats["fixed", "qa"].vs["speedup_ar"] == pytest.approx((4 / 1.0) / (4 / 2.0))
    assert cats["fixed", "rag"].vs["speedup_ar"] == pytest.approx((6 / 1.0) / (6 / 2.0))
    text = report(res)
    line = next(x for x in text.splitlines() if x.startswith("| 0.6 | d | fixed |"))
    assert line.startswith("| 0.6 | d | fixed | 2 | 10 | 5.0 [") and "| 2.00x [" in line and "| 1.60x |" in line
    # intervals resample prompts: prompt a runs at 4 tokens/s, prompt b at 6 (a bootstrap sees only those)
    assert 4.0 <= fixed.ci["tokens_per_s"][0] <= 5.0 <= fixed.ci["tokens_per_s"][1] <= 6.0
    assert fixed.ci["speedup_ar"] == pytest.approx((2.0, 2.0))  # 2x on both prompts: no spread
    assert rows_csv(summarize(res)).splitlines()[0].startswith("T,draft,method,category,prompts")
    assert "tokens_per_s_low" in rows_csv(summarize(res)).splitlines()[0]


def test_intervals_against_hand_computed_values():
    from verispec.bench.stats import bootstrap, mean_interval, t95

    # mean 2.5, sd 1.2910, se 0.6455, t(3) = 3.182: 2.5 -+ 2.054
    m, low, high = mean_interval([1, 2, 3, 4])
    assert m == 2.5 and low == pytest.approx(0.4460, abs=1e-4) and high == pytest.approx(4.5540, abs=1e-4)
    assert math.isnan(mean_interval([3.0])[1]) and t95(500) == 1.96
    # a paired ratio of sums that is 2 on every prompt has no spread; one that is not, has
    est, low, high = bootstrap([(2, 1), (4, 2), (6, 3)], lambda g: sum(a for a, _ in g) / sum(b for _, b in g))
    assert (est, low, high) == (2.0, 2.0, 2.0)
    est, low, high = bootstrap([(1, 1), (3, 1)], lambda g: sum(a for a, _ in g) / sum(b for _, b in g))
    assert est == 2.0 and low == 1.0 and high == 3.0  # resamples of two prompts: 1, 2 or 3


def test_contended_cells_are_left_out_and_counted(tmp_path):
    recs = hand_records()
    for r in recs:
        if r.get("type") == "prompt" and r["cell"]["method"] == "fixed" and r["cell"]["prompt"] == "b":
            r["load"] = {"own_cores": 1.0, "others_cores": 1.5}  # another job used 1.5 cores meanwhile
    path = tmp_path / "r.jsonl"
    write(path, recs, partial_tail=False)
    res = Results.load(path)
    fixed = next(r for r in summarize(res) if r.method == "fixed")
    assert fixed.prompts == 1 and fixed.vs["speedup_ar"] == pytest.approx((4 / 1.0) / (4 / 2.0))
    assert "1 of 7 cells are left out" in report(res)  # ar 2, fixed 2, hf-generate 1, hf-assisted 2


def test_shadow_rows_and_paired_differences_from_hand_written_records(tmp_path):
    from verispec.bench.report import shadow_summary, share_of_bias_gain

    recs = [dict(HEADER, config={"methods": ["specinfer@2x2"], "drafts": ["d"]})]
    # two prompts, two steps each; shadows with two seeds each
    lengths = {"a": [({"specinfer": [2, 2], "reserve": [3, 2], "resispec": [3, 3]}),
                     ({"specinfer": [1, 1], "reserve": [1, 2], "resispec": [2, 2]})],
               "b": [({"specinfer": [2, 2], "reserve": [2, 2], "resispec": [3, 3]}),
                     ({"specinfer": [3, 3], "reserve": [3, 4], "resispec": [4, 4]})]}
    for prompt, steps in lengths.items():
        c = cell("specinfer@2x2", prompt, "d")
        for i, sh in enumerate(steps):
            shadow = {v: [{"accepted_length": x, "tested": [1], "accepted_ranks": [0] * (x - 1)} for x in xs]
                      for v, xs in sh.items()}
            recs.append(dict(step(c, 2, 6, 2), i=i, shadow=shadow))
        recs.append(prompt_rec(c, 4, 1.0))
    path = tmp_path / "s.jsonl"
    write(path, recs, partial_tail=False)
    res = Results.load(path)
    rows = {r.verifier: r for r in shadow_summary(res)}
    # per-step seed means: specinfer 2, 1, 2, 3 (mean 2); reserve 2.5, 1.5, 2, 3.5 (mean 2.375)
    assert rows["specinfer"].mean_accepted_length == pytest.approx(2.0)
    assert rows["reserve"].mean_accepted_length == pytest.approx(2.375)
    assert rows["reserve"].diff == pytest.approx(0.375) and rows["reserve"].reference == "specinfer"
    # resispec gains 1 on every step: reserve achieves 0.375 of it
    (est, low, high), = share_of_bias_gain(res, "reserve").values()
    assert est == pytest.approx(0.375) and low <= est <= high
    assert "minus specinfer (paired)" in report(res)
    from verispec.bench.report import table_trees, table_width

    trees = table_trees(shadow_summary(res))  # one row per tree: each verifier's length, paired differences
    assert "| T | draft | tree | nodes | specinfer L | reserve L | resispec L | reserve - specinfer |" in trees
    assert "| 0.6 | d | 2x2 | 6 | 2.00 [" in trees and "+0.375 [" in trees
    assert table_width(shadow_summary(res)).count("\n") == 1  # one width only: no series to show


def test_eta_from_hand_written_width_records(tmp_path):
    recs = [dict(HEADER, config={"methods": [], "drafts": ["d"]})]
    for method, lengths in (("specinfer@1x2", [2, 2]), ("specinfer@2x2", [3, 2]), ("specinfer@4x2", [3, 3])):
        c = cell(method, "a", "d")
        recs += [step(c, n, 2, 2) for n in lengths] + [prompt_rec(c, sum(lengths), 1.0)]
    path = tmp_path / "w.jsonl"
    write(path, recs, partial_tail=False)
    table = table_width(summarize(Results.load(path)))
    # N = 1: L = 2; N = 2: L = 2.5, eta = 0.5; N = 4: L = 3, eta = (3 - 2.5) / 2 = 0.25
    assert "| 0.6 | d | specinfer | 2 | 1 | 2 | 2.00 | - |" in table
    assert "| 0.6 | d | specinfer | 2 | 2 | 6 | 2.50 | 0.500 |" in table
    assert "| 0.6 | d | specinfer | 2 | 4 | 20 | 3.00 | 0.250 |" in table


def test_method_and_dataset_specs(tmp_path):
    assert resolve("specinfer@3x5").tree_for().size == 364
    assert resolve("fixed@chain:8").policy == "fixed" and resolve("fixed@chain:8").tree_for().max_depth == 8
    assert resolve("fsd:0.2").verifier.name == "fsd:0.2" and resolve("reserve").tree == "chain:5"
    assert not resolve("ar").drafts and not PEERS["hf-generate"].drafts
    assert PEERS["hf-assisted"].drafts
    for bad, msg in (("nope", "unknown method"), ("ar@3x5", "takes no tree"), ("chain@3y", "cannot parse tree"),
                     ("hf-generate", "unknown method")):  # a peer is not a verispec method
        with pytest.raises(VerispecError, match=msg):
            resolve(bad)
    sb = load_prompts("spec-bench:qa,rag", 2)
    assert [p.group for p in sb] == ["qa", "qa", "rag", "rag"] and all(p.chat for p in sb)
    assert len(load_prompts("spec-bench", 1)) == 6 and len(load_prompts("spec-bench")) == 480
    assert not load_prompts("humaneval", 1)[0].chat and load_prompts("gsm8k", 3)[2].reference["answer"]
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "hi", "category": "greet"}\n\n{"turns": ["two", "x"], "id": "t2", "chat": false}\n')
    mine = load_prompts(str(f))
    assert [(p.id, p.prompt, p.group, p.chat) for p in mine] == [("mine/0", "hi", "greet", True),
                                                                 ("t2", "two", "mine", False)]
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    for spec, msg in (("spec-bench:nope", "unknown Spec-Bench"), ("wiki", "unknown data set"),
                      (str(tmp_path / "bad.jsonl"), "needs a non-empty"), ("jsonl:/no/such.jsonl", "not found")):
        with pytest.raises(VerispecError, match=msg):
            load_prompts(spec, 1)
    with pytest.raises(VerispecError, match="limit"):
        load_prompts("gsm8k", 0)


def test_plan_runs_draft_free_methods_once_and_skips_what_hf_cannot_do(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    config = BenchConfig(drafts=["ngram", "layerskip:2"], methods=["hf-generate", "hf-assisted", "ar", "fixed"],
                         datasets=[str(f)], temperatures=[0.0], limit=None)
    cells, notes = plan(config, config.validate(), jsonl_problems(f))
    per_prompt = [(c.method.name, c.draft) for c in cells if c.problem.prompt == "a"]
    assert per_prompt == [("hf-generate", "-"), ("hf-assisted", "ngram"), ("ar", "-"), ("fixed", "ngram"),
                          ("fixed", "layerskip:2")]
    assert len(notes) == 1 and "layerskip:2" in notes[0]
    config.seeds = [0, 1]  # every other seed a round in reverse order
    cells, _ = plan(config, config.validate(), jsonl_problems(f))
    second = [(c.method.name, c.draft) for c in cells if c.problem.prompt == "a" and c.seed == 1]
    assert second == [("fixed", "ngram"), ("fixed", "layerskip:2"), ("ar", "-"), ("hf-assisted", "ngram"),
                      ("hf-generate", "-")]
    with pytest.raises(VerispecError, match="twice"):
        BenchConfig(methods=["ar", "ar"]).validate()


class FakeTime:
    """A deterministic clock: each reading advances 10 ms, so timings depend only on the work done."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 0.01
        return self.now


class QuietMachine:
    """A load meter that reports no other work (the tests run beside anything)."""

    def stop(self):
        return {"own_cores": 1.0, "others_cores": 0.0}


@pytest.fixture
def tiny_target(monkeypatch):
    import verispec.bench.peers
    import verispec.bench.runner
    import verispec.decode
    import verispec.engine

    monkeypatch.setattr(verispec.decode, "time", FakeTime())
    monkeypatch.setattr(verispec.engine, "time", FakeTime())
    monkeypatch.setattr(verispec.bench.peers, "time", FakeTime())
    monkeypatch.setattr(verispec.bench.runner, "LoadMeter", QuietMachine)  # the real one reads this machine's load
    target = tiny_model("llama")
    target.tokenizer = ByteTokenizer(target.vocab_size)
    return target


def tiny_config(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n"
                         for p, c in (("one two", "a"), ("three four five", "b"), ("six", "a"))))
    return BenchConfig(target="tiny", drafts=["ngram", "layerskip:2"],
                       methods=["hf-generate", "hf-assisted", "ar", "fixed", "specinfer@2x2", "reserve@2x2"],
                       datasets=[str(f)], limit=None, temperatures=[0.0, 0.9], seeds=[0, 1], max_new_tokens=6,
                       audit_cases=2)


def test_tiny_bench_end_to_end_and_resume(tmp_path, tiny_target, monkeypatch):
    config = tiny_config(tmp_path)
    full = run_bench(config, tmp_path / "full.jsonl", target=tiny_target, progress=False, log=lambda m: None)
    records = read_records(full)
    cells = [r for r in records if r["type"] == "prompt"]
    # 3 prompts x 2 temperatures x 2 seeds x (hf-generate, ar, and per draft fixed, specinfer, reserve; hf-assisted
    # with ngram only)
    assert len(cells) == 3 * 2 * 2 * (2 + 3 * 2 + 1)
    assert {r["verifier"] for r in records if r["type"] == "audit"} == {"chain", "specinfer", "reserve"}
    assert all(r["verdict"] == "exact" for r in records if r["type"] == "audit")
    # greedy: every method reproduces plain decoding token for token
    greedy = {}
    for r in cells:
        if r["cell"]["T"] == 0.0:
            greedy.setdefault((r["cell"]["prompt"], r["cell"]["seed"]), set()).add(tuple(r["token_ids"]))
    assert all(len(v) == 1 for v in greedy.values())
    expected = report(Results.load(full))

    # interrupt a second run after 17 cells (as Ctrl-C would), add the debris of a cut-off cell, then resume
    calls = {"n": 0}
    original = Runner.run

    def flaky(self, cell, max_new_tokens=None, warm=False):
        if max_new_tokens is None:
            calls["n"] += 1
            if calls["n"] > 17:
                raise KeyboardInterrupt
        return original(self, cell, max_new_tokens, warm)

    monkeypatch.setattr(Runner, "run", flaky)
    part = tmp_path / "part.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_bench(config, part, target=tiny_target, progress=False, log=lambda m: None)
    monkeypatch.setattr(Runner, "run", original)
    assert sum(r["type"] == "prompt" for r in read_records(part)) == 17
    with part.open("a") as f:
        f.write(json.dumps({"type": "step", "cell": cells[20]["cell"], "drafted": 1, "accepted_length": 50}) + "\n")
        f.write('{"type": "prompt", "cell"')
    with pytest.raises(VerispecError, match="--resume"):
        run_bench(config, part, target=tiny_target, progress=False)
    other = BenchConfig(**{**config.to_dict(), "max_new_tokens": 7})
    with pytest.raises(VerispecError, match="differs in max_new_tokens"):
        run_bench(other, part, target=tiny_target, progress=False, resume=True)
    run_bench(config, part, target=tiny_target, progress=False, resume=True, log=lambda m: None)
    resumed = Results.load(part)
    assert report(resumed).split("\n", 1)[1] == expected.split("\n", 1)[1]  # all but the header line
    assert sorted(json.dumps(r["cell"]) + str(r["token_ids"]) for r in resumed.prompts) == \
        sorted(json.dumps(r["cell"]) + str(r["token_ids"]) for r in cells)
    assert not any(s["accepted_length"] == 50 for steps in resumed.steps.values() for s in steps)

    from verispec.bench.plots import plot_all

    figures = plot_all(full, tmp_path / "figs")
    assert {p.name for p in figures} == {"per_candidate.png", "speedup_by_category.png", "latency.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in figures)


def test_shadows_never_change_the_text_and_match_separate_runs(tmp_path, tiny_target):
    """Shadow verification on a tiny model: the driven text is the same with and without shadows (same seed), and
    a shadow's mean accepted length agrees with the same verifier's own runs within noise."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"p{i} " * (1 + i % 3)}) + "\n" for i in range(12)))
    base = dict(target="tiny", drafts=["layerskip:2"], datasets=[str(f)], limit=None, temperatures=[0.9],
                seeds=[0], max_new_tokens=24)
    plain = run_bench(BenchConfig(methods=["specinfer@3x2", "reserve@3x2"], **base), tmp_path / "plain.jsonl",
                      target=tiny_target, progress=False, warm_up=False, log=lambda m: None)
    shadowed = run_bench(BenchConfig(methods=["specinfer@3x2"], shadow=["specinfer", "reserve"], shadow_seeds=6,
                                     **base), tmp_path / "shadow.jsonl", target=tiny_target, progress=False,
                         warm_up=False, log=lambda m: None)
    a, b = Results.load(plain), Results.load(shadowed)
    text = {r["cell"]["prompt"]: r["token_ids"] for r in a.prompts if r["cell"]["method"] == "specinfer@3x2"}
    assert all(r["token_ids"] == text[r["cell"]["prompt"]] for r in b.prompts)
    from verispec.bench.report import shadow_summary

    own = {r.method: r for r in summarize(a)}
    shadow = {r.verifier: r for r in shadow_summary(b)}
    for name in ("specinfer", "reserve"):
        low, high = own[f"{name}@3x2"].ci["mean_accepted_length"]
        s_low, s_high = shadow[name].ci
        assert s_low <= high and low <= s_high, (name, own[f"{name}@3x2"], shadow[name])  # intervals overlap
    assert shadow["reserve"].diff >= -1e-9 or shadow["reserve"].diff_ci[1] >= 0
    notes = []  # a shadow that cannot judge the driver's drafts is left out with a note, the others still run
    out = run_bench(BenchConfig(methods=["specinfer@2x2"], shadow=["swor", "reserve"], **base), tmp_path / "x.jsonl",
                    target=tiny_target, progress=False, warm_up=False, log=notes.append)
    assert any("'swor' skipped" in n for n in notes), notes
    judged = {name for rs in Results.load(out).steps.values() for r in rs for name in r.get("shadow", {})}
    assert judged == {"reserve"}


def test_carried_state_and_decoded_position_distortion(tmp_path, tiny_target):
    """--carry-state keeps a learning verifier's state across prompts; --distortion records the exact TV of a lossy
    rule at the positions it tested (0 for an exact rule) and each sampled cell's NLL under the target."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i} " * 2}) + "\n" for i in range(3)))
    config = BenchConfig(target="tiny", drafts=["layerskip:2"], methods=["fixed", "fsd@chain:3", "adasd"],
                         datasets=[str(f)], limit=None, temperatures=[0.9], seeds=[0], max_new_tokens=12,
                         carry_state=True, distortion=True)
    out = run_bench(config, tmp_path / "d.jsonl", target=tiny_target, progress=False, warm_up=False,
                    log=lambda m: None)
    res = Results.load(out)
    rows = {r.method: r for r in summarize(res)}
    assert rows["fixed"].tv == pytest.approx(0.0, abs=1e-6) and rows["fsd@chain:3"].tv > 1e-3  # float32 laws
    assert all(r.get("nll") is not None and r["nll"] > 0 for r in res.prompts)
    runner = Runner(config, tiny_target)
    cells, _ = plan(config, config.validate(), load_prompts(str(f)))
    adasd = [c for c in cells if c.method.name == "adasd"]
    runner.run(adasd[0])
    state = runner._build(adasd[1], warm=False).verifier_state
    assert len(state.accepted) + len(state.rejected) > 0  # learned on the first prompt, carried to the second


@pytest.mark.slow
def test_cli_bench_report_and_plot_on_the_default_model(tmp_path, capsys):
    out = tmp_path / "b.jsonl"
    argv = ["bench", "--methods", "hf-generate", "ar", "fixed", "--drafts", "ngram", "--datasets", "spec-bench:qa",
            "--limit", "1", "--temperatures", "0", "--max-new-tokens", "6", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "| 0 | ngram | fixed | 1 | 6 |" in text
    assert (tmp_path / "b.summary.md").read_text().strip() == text.strip()
    assert (tmp_path / "b.summary.csv").read_text().startswith("T,draft,method")
    header = read_records(out)[0]
    assert header["command"].startswith("verispec bench --methods") and header["versions"]["torch"]
    assert cli.main(argv) == 2 and "--resume" in capsys.readouterr().err
    assert cli.main([*argv, "--resume"]) == 0  # nothing left to do
    assert "3 of 3 cells done" in capsys.readouterr().err
    assert cli.main(["report", str(out), "--csv"]) == 0 and capsys.readouterr().out.startswith("T,draft")
    assert cli.main(["plot", str(out), "--out", str(tmp_path / "f")]) == 0
    assert (tmp_path / "f" / "latency.png").exists()
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 2


def test_committed_summaries_match_what_report_derives_from_their_records():
    """Every results/NAME.summary.md is what `verispec report results/NAME.jsonl.gz` prints today, and NAME.summary.csv
    what `verispec bench` writes beside it (the records are kept gzipped; a plain NAME.jsonl is a run still going,
    which git ignores)."""
    from pathlib import Path

    assert _same_csv("T,x\n0,0.30000000000000004\n", "T,x\n0,0.3\n")  # a last bit apart
    assert not _same_csv("T,x\n0,0.3001\n", "T,x\n0,0.3\n") and not _same_csv("T,x\n0,a\n", "T,x\n0,b\n")
    root = Path(__file__).resolve().parent.parent / "results"
    files = sorted(root.glob("*.jsonl.gz"))
    assert files
    for path in files:
        summary = path.with_name(path.name.removesuffix(".jsonl.gz") + ".summary.md")
        assert summary.exists(), summary
        res = Results.load(path)
        assert summary.read_text().strip() == report(res).strip(), path.name
        table = summary.with_suffix(".csv")
        derived = loops_csv(loop_summary(res)) if res.cells else rows_csv(summarize(res))
        assert _same_csv(table.read_bytes().decode(), derived), table.name


def _same_csv(kept: str, derived: str) -> bool:
    """The same table: every cell the same text, or numbers equal to 1e-9 relative (a CSV keeps floats at full
    precision, and a sum's last bit may differ on a CPU whose vector units group its terms otherwise: AVX-512 against
    AVX2)."""
    a, b = kept.splitlines(), derived.splitlines()
    if len(a) != len(b):
        return False
    for row_a, row_b in zip(a, b):
        cells_a, cells_b = row_a.split(","), row_b.split(",")
        if len(cells_a) != len(cells_b):
            return False
        for x, y in zip(cells_a, cells_b):
            if x == y:
                continue
            try:
                fx, fy = float(x), float(y)
            except ValueError:
                return False
            if not abs(fx - fy) <= 1e-9 * max(abs(fx), abs(fy)):
                return False
    return True


def test_traversal_records_from_before_the_tested_fix_are_repaired_on_reading(tmp_path):
    """Records written before d2ca1e0 gave traversal a phantom first ``tested`` entry when nothing was accepted."""
    import copy

    from verispec.bench.records import Results
    from verispec.metrics import per_candidate_acceptance

    cell = {"T": 1.0, "seed": 0, "prompt": "p", "draft": "int8", "method": "specinfer@3x3"}
    old = [{"accepted_length": 1, "tested": [4, 3], "accepted_ranks": []},  # all 3 rejected, as written then
           {"accepted_length": 2, "tested": [2, 3], "accepted_ranks": [2]}]  # a path: written right, left alone
    own = {"type": "step", "cell": {**cell, "method": "traversal@3x3"}, "i": 0, "tested": [4, 3], "accepted_ranks": []}
    records = [{"type": "header", "config": {}},
               {"type": "step", "cell": cell, "i": 0, "shadow": {"traversal": copy.deepcopy(old), "specinfer": old}},
               own, {"type": "prompt", "cell": cell}, {"type": "prompt", "cell": own["cell"]}]
    res = Results.from_records(records)
    steps = [s for ss in res.steps.values() for s in ss]
    runs = steps[0]["shadow"]
    assert [r["tested"] for r in runs["traversal"]] == [[3], [2, 3]]
    assert [r["tested"] for r in runs["specinfer"]] == [[4, 3], [2, 3]]  # other verifiers never had the bug
    assert steps[1]["tested"] == [3]
    assert per_candidate_acceptance(runs["traversal"]) == pytest.approx([0.0, 1 / 3, 0.0])  # [0, 1/4, 0, 0] unrepaired


def test_closed_loops_of_concurrent_requests(tmp_path, tiny_target):
    """--concurrency: every prompt as a request of a closed loop with N in flight, for verispec's batched engine and
    Hugging Face's static batches; greedy tokens do not depend on the loop; a cut-off loop runs again on resume."""
    base = tiny_config(tmp_path)
    config = BenchConfig(**{**base.to_dict(), "methods": ["hf-generate", "ar", "fixed", "hf-continuous"],
                            "drafts": ["ngram"], "temperatures": [0.0], "seeds": [0], "concurrency": [1, 2],
                            "audit_cases": 0})
    notes = []
    out = run_bench(config, tmp_path / "c.jsonl", target=tiny_target, progress=False, log=notes.append)
    records = read_records(out)
    cells = [r for r in records if r["type"] == "cell"]
    assert len(cells) == 2 * 4 and all(c["requests"] == 3 and c["throughput"] > 0 for c in cells)
    prompts = [r for r in records if r["type"] == "prompt"]
    assert len(prompts) == 2 * 4 * 3 and all(r["latency_s"] >= 0 and r["cell"]["concurrency"] in (1, 2)
                                             for r in prompts)
    by_prompt = {}
    for r in prompts:
        if r["cell"]["method"] != "hf-continuous":  # transformers' scheduler is its own (its text checked below)
            by_prompt.setdefault(r["cell"]["prompt"], set()).add(tuple(r["token_ids"]))
    assert all(len(v) == 1 for v in by_prompt.values())  # greedy: the same tokens whatever the loop
    res = Results.load(out)
    from verispec.bench.report import loop_summary

    rows = {(r.method, r.concurrency): r for r in loop_summary(res)}
    assert rows["ar", 1].vs["vs_ar"] == pytest.approx(1.0) and "vs_own_1" in rows["fixed", 2].vs
    # against plain decoding one request at a time: this loop's throughput over ar's at N = 1, paired by round
    assert rows["fixed", 2].vs["vs_ar_1"] == pytest.approx(rows["fixed", 2].throughput / rows["ar", 1].throughput)
    assert "vs_ar_1" not in rows["ar", 2].vs and "vs_ar_1" not in rows["fixed", 1].vs
    assert "vs HF static batches" in report(res) and "N" in report(res)
    # an interrupted run resumes: the cut-off loop is dropped and run again
    lines = out.read_text().splitlines()
    last_cell = max(i for i, line in enumerate(lines) if '"type": "cell"' in line)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:last_cell]) + "\n")
    run_bench(config, cut, target=tiny_target, progress=False, resume=True, log=lambda m: None)
    again = Results.load(cut)
    assert len(again.cells) == 8 and len(again.prompts) == 24


def test_continuous_batching_peer_sizes_its_cache_from_the_requests():
    """transformers' continuous batching gets a cache for the N longest requests whole, not 90 % of the machine."""
    from verispec.bench.peers import CB_PAGE, continuous_sizes

    blocks, tokens = continuous_sizes([40, 300, 90, 600], 128, 2)
    assert blocks == -(-(600 + 128) // CB_PAGE) + -(-(300 + 128) // CB_PAGE) + 1 == 6
    assert tokens == 602 and continuous_sizes([10], 8, 1) == (2, 256)
    assert continuous_sizes([10, 10], 8, 8)[0] == 3  # never more than the requests there are


def test_rounds_alternate_the_order_of_closed_loops_and_their_ratios_pair_round_by_round(tmp_path, tiny_target):
    """--rounds K: each (temperature, N) runs its methods K times, in reverse order every other round; the report
    pools a method's rounds and pairs its ratios round by round, so a slot that is slow whichever method holds it
    cancels out."""
    base = tiny_config(tmp_path)
    config = BenchConfig(**{**base.to_dict(), "methods": ["ar", "fixed"], "drafts": ["ngram"], "temperatures": [0.0],
                            "seeds": [0], "concurrency": [1, 2], "rounds": 2, "audit_cases": 0})
    groups, _ = plan_groups(config, config.validate())
    assert [(g.concurrency, g.round, g.method.name) for g in groups] == [
        (1, 0, "ar"), (1, 0, "fixed"), (1, 1, "fixed"), (1, 1, "ar"),
        (2, 0, "ar"), (2, 0, "fixed"), (2, 1, "fixed"), (2, 1, "ar")]
    out = run_bench(config, tmp_path / "r.jsonl", target=tiny_target, progress=False, log=lambda m: None)
    res = Results.load(out)
    assert sorted(c["cell"]["round"] for c in res.cells) == [0, 0, 0, 0, 1, 1, 1, 1]
    rows = {(r.method, r.concurrency): r for r in loop_summary(res)}
    assert len(rows) == 4 and all(r.rounds == 2 and r.requests == 6 for r in rows.values())
    assert "| rounds |" in report(res)
    # a slot bias: whichever method runs first in a round is 25 % faster; paired rounds cancel it
    for c in res.cells:
        first = (c["cell"]["method"] == "ar") == (c["cell"]["round"] == 0)
        c["throughput"] = 125.0 if first else 100.0
    rows = {(r.method, r.concurrency): r for r in loop_summary(res)}
    low, high = rows["fixed", 2].ci["vs_ar"]
    assert rows["fixed", 2].vs["vs_ar"] == pytest.approx(1.0) and low < 1.0 < high
    with pytest.raises(VerispecError, match="give --concurrency"):
        BenchConfig(**{**config.to_dict(), "concurrency": []}).validate()


def test_each_round_of_a_closed_loop_draws_with_its_own_seed(tmp_path, tiny_target):
    """At T > 0 round r draws with seed + 1000 r, the same for every method of the round (and for a peer): rounds
    sample texts of their own, so a ratio's interval over rounds takes in the texts drawn. At T = 0 every round
    writes the same text."""
    base = tiny_config(tmp_path)
    config = BenchConfig(**{**base.to_dict(), "methods": ["ar", "fixed", "hf-generate"], "drafts": ["ngram"],
                            "temperatures": [0.0, 1.0], "seeds": [3], "concurrency": [2], "rounds": 3,
                            "audit_cases": 0, "max_new_tokens": 8})
    groups, _ = plan_groups(config, config.validate())
    assert {(g.temperature, g.round, g.draw_seed) for g in groups} == {
        (t, r, 3 + 1000 * r) for t in (0.0, 1.0) for r in range(3)}
    res = Results.load(run_bench(config, tmp_path / "s.jsonl", target=tiny_target, progress=False,
                                 log=lambda m: None))
    texts: dict = {}
    for p in res.prompts:
        c = p["cell"]
        texts.setdefault((c["T"], c["method"], c["prompt"]), {})[c["round"]] = tuple(p["token_ids"])
    greedy = [v for (t, _, _), v in texts.items() if t == 0.0]
    assert greedy and all(len(set(v.values())) == 1 for v in greedy)
    for method in ("ar", "fixed", "hf-generate"):
        sampled = [v for (t, m, _), v in texts.items() if t == 1.0 and m == method]
        assert any(len(set(v.values())) > 1 for v in sampled), method


def test_the_loop_interval_takes_in_rounds_and_prompts():
    """``ratio_of_loops``: one round gives the prompt bootstrap scaled to the measured ratio; rounds that disagree
    widen the interval, rounds that agree do not."""
    tokens, times = [100, 120, 90, 128, 64, 110], [2.0, 2.5, 1.5, 3.0, 1.0, 2.2]
    other = [t * f for t, f in zip(times, (1.1, 0.9, 1.2, 1.0, 0.8, 1.05))]
    est, low, high = ratio_of_rates(tokens, times, tokens, other)
    one = ratio_of_loops([(90.0, 100.0, tokens, times, tokens, other)])
    assert one == pytest.approx((0.9, 0.9 * low / est, 0.9 * high / est))
    agree = ratio_of_loops([(90.0, 100.0, tokens, times, tokens, other)] * 3)
    apart = ratio_of_loops([(70.0, 100.0, tokens, times, tokens, other), (110.0, 100.0, tokens, times, tokens, other)])
    assert agree[0] == pytest.approx(0.9) and agree[2] - agree[1] <= (one[2] - one[1]) * 1.01
    assert apart[0] == pytest.approx(math.sqrt(0.77)) and apart[2] - apart[1] > 2 * (one[2] - one[1])


def test_gzipped_records_read_as_the_plain_ones_and_runs_write_plain(tmp_path, capsys):
    """The repository keeps its records gzipped (results/*.jsonl.gz): they read as the plain file they came from, a
    folder's gzipped records are reported, a cut-off gzip is refused in one line, and a run refuses a .gz --out
    (it appends its records line by line)."""
    import gzip
    import shutil
    from pathlib import Path

    kept = Path(__file__).resolve().parent.parent / "results" / "kernel.jsonl.gz"
    plain = tmp_path / "kernel.jsonl"
    with gzip.open(kept, "rb") as src, open(plain, "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert read_records(kept) == read_records(plain) and len(read_records(plain)) > 10
    folder = tmp_path / "kept"
    folder.mkdir()
    shutil.copy(kept, folder)
    assert cli.main(["report", str(folder), "--csv"]) == 0 and capsys.readouterr().out.startswith("T,draft")
    cut = folder / "cut.jsonl.gz"
    cut.write_bytes(kept.read_bytes()[:2000])
    assert cli.main(["report", str(cut)]) == 2
    err = capsys.readouterr().err
    assert "not a verispec results file" in err and "Traceback" not in err
    assert cli.main(["bench", "--methods", "ar", "--out", str(tmp_path / "new.jsonl.gz")]) == 2
    assert "writes its records plain" in capsys.readouterr().err


def test_identical_greedy_seeds_count_once_in_a_speed_interval():
    """At T = 0 every seed of a prompt decodes the same text: three seeds are one sample timed three times, so the
    interval must be the one of the prompts alone (pooled per prompt), not one that narrows with the copies; at
    T > 0 seeds are samples of their own."""
    from verispec.bench.report import paired_ratio

    def records(method, T, seeds, speed):  # the speed-up varies from prompt to prompt, a little from seed to seed
        return [{"cell": {"T": T, "seed": s, "prompt": f"p{i}", "method": method}, "tokens": 100,
                 "wall_s": (1.0 + 0.3 * ((i * 7) % 5)) / (speed * (1 + 0.1 * ((i * 3) % 4 - 1.5) * (speed > 1)))
                 * (1 + 0.02 * ((s * 5 + i) % 3))} for i in range(8) for s in seeds]

    once = paired_ratio(records("a", 0.0, [0], 1.2), records("b", 0.0, [0], 1.0))
    thrice = paired_ratio(records("a", 0.0, [0, 1, 2], 1.2), records("b", 0.0, [0, 1, 2], 1.0))
    assert once[0] == pytest.approx(1.2, rel=0.05) and thrice[0] == pytest.approx(once[0], rel=0.05)
    width = lambda r: r[2] - r[1]  # noqa: E731
    assert width(once) > 0.05 and width(thrice) == pytest.approx(width(once), rel=0.15)  # the copies add nothing
    sampled = paired_ratio(records("a", 0.6, [0, 1, 2], 1.2), records("b", 0.6, [0, 1, 2], 1.0))
    assert width(sampled) < width(once)  # at T > 0 a seed is a sample of its own
