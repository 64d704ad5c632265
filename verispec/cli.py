"""Command-line interface: ``verispec generate``, ``audit``, ``bench``, ``report``, ``plot``, ``train-draft`` and
``tune-tree``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from . import __version__
from .drafters import CHILD_MODES, ModelDrafter, NgramDrafter, NoDrafter, layer_skip_drafter
from .errors import VerispecError
from .models import BUILTIN_MODELS, DEFAULT_TARGET, CausalLM, quantized_copy
from .policies import POLICIES, get_policy
from .tree import Tree
from .verifiers import VERIFIERS, get_verifier

DEFAULT_DRAFT = "auto"

DRAFT_HELP = (
    "draft to use: 'none' (plain autoregressive decoding), 'layerskip:L' (first L layers of the target) or "
    "'layerskip:0,2,4' or 'layerskip:0-9,20-29' (a chosen subset), 'ngram' or 'ngram:N' (prompt lookup, n-grams up to N), "
    "'int8' (a dynamically int8-quantised copy of the target), 'eagle' (the trained EAGLE-style draft head shipped for "
    "the target; 'eagle:PATH' for a head from 'verispec train-draft'), or "
    "'model:SPEC' (a separate draft model: alias, .gguf file, folder or hub id; must share the tokenizer). "
    "Default 'auto': 'eagle' when a trained head ships for the target (the default target has one), else 'ngram'"
)


def parse_layers(text: str, spec: str) -> list[int]:
    """``0,2,4`` or ranges ``0-9,20-29`` -> sorted layer indices."""
    out = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise VerispecError(f"bad layer list in --draft {spec!r}; use layerskip:L, layerskip:0,2,4 or layerskip:0-9,20-29") from None
    return out


def build_drafter(spec: str, target: CausalLM, dtype: str = "float32"):
    """Turn a ``--draft`` string into a drafter for ``target``."""
    kind, _, arg = spec.partition(":")
    if spec == "auto":
        from .eagle import HEADS_DIR  # noqa: PLC0415

        return build_drafter("eagle" if (HEADS_DIR / f"{target.name}.pt").is_file() else "ngram", target, dtype)
    if kind == "none":
        return NoDrafter()
    if kind == "layerskip":
        if not arg:
            return layer_skip_drafter(target, target.num_layers // 4)
        if arg.isdigit():
            return layer_skip_drafter(target, int(arg))
        return layer_skip_drafter(target, parse_layers(arg, spec))
    if kind == "ngram":
        try:
            n = int(arg) if arg else 3
        except ValueError:
            raise VerispecError(f"bad n in --draft {spec!r}; use ngram:N") from None
        return NgramDrafter(target.vocab_size, max_n=n)
    if kind == "int8" and not arg:
        return ModelDrafter(quantized_copy(target), name="int8")
    if kind == "eagle":
        from .drafters.eagle import EagleDrafter  # noqa: PLC0415
        from .eagle import EagleHead, shipped_head  # noqa: PLC0415

        path = Path(arg) if arg else shipped_head(target.name)
        drafter = EagleDrafter(EagleHead.load(path, target), name=spec)
        sidecar = path.with_suffix(".json")  # written by scripts/ship_head.py: how it was made and its tuned tree
        if sidecar.is_file():
            drafter.default_tree = json.loads(sidecar.read_text()).get("default_tree")
        return drafter
    if kind == "model" and arg:
        drafter = ModelDrafter(CausalLM.load(arg, dtype=dtype))
        drafter.check_compatible(target)
        return drafter
    raise VerispecError(f"unknown --draft {spec!r}. {DRAFT_HELP}")


def _add_generate(sub):
    g = sub.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate text from a prompt with speculative decoding; streams the text, then prints a summary.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g.add_argument("--prompt", required=True, help="the user prompt (sent through the chat template if the model has one)")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"target model: built-in alias ({', '.join(BUILTIN_MODELS)}), .gguf file, local folder or hub id")
    g.add_argument("--draft", default=DEFAULT_DRAFT, help=DRAFT_HELP)
    g.add_argument("--method", default="chain", metavar="METHOD",
                   help="verification rule; 'ar' is plain autoregressive decoding of the target (same as --draft none). "
                        + "; ".join(f"{v.name}: {v.note}" for v in VERIFIERS.values()))
    g.add_argument("--policy", default="fixed", metavar="POLICY",
                   help="draft-length policy (the tree still caps the depth): "
                        + "; ".join(f"{k}: {v}" for k, v in POLICIES.items()))
    g.add_argument("--tree", default="auto",
                   help="draft tree: chain:G, BxD (complete, e.g. 3x5), b1,b2,... (per-depth branching, e.g. 3,1,1), "
                        "paths:0;1;0.0 (Medusa-style rank paths) or dyn:DEPTH,K,N (EAGLE-2 dynamic tree, top-k "
                        "children). Default 'auto': the tree 'verispec tune-tree' chose for a shipped draft head, "
                        "else chain:5")
    g.add_argument("--children", default=None, choices=CHILD_MODES,
                   help="how the children of a tree node are drawn: iid from q, without replacement, or the top-k "
                        "(default: what the method needs; iid for methods that take any)")
    g.add_argument("--temperature", type=float, default=0.6, help="sampling temperature; 0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens")
    g.add_argument("--seed", type=int, default=0, help="random seed (same seed, same output on the same machine)")
    g.add_argument("--dtype", default="float32", help="model weights dtype: float32, bfloat16, float16")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON record (text, ids, summary, per-step records)")
    g.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from .decode import generate  # noqa: PLC0415

    if args.tree != "auto":
        Tree.parse(args.tree)  # fail before loading anything
    draft_spec = "none" if args.method == "ar" else args.draft
    method = "chain" if args.method == "ar" else args.method
    verifier = get_verifier(method)
    policy = get_policy(args.policy)
    info = (lambda *a: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    t = time.perf_counter()
    info(f"loading target {args.target} ...")
    target = CausalLM.load(args.target, dtype=args.dtype)
    drafter = build_drafter(draft_spec, target, dtype=args.dtype)
    tree = Tree.parse(getattr(drafter, "default_tree", None) or "chain:5" if args.tree == "auto" else args.tree)
    if isinstance(drafter, NoDrafter):
        tree = Tree.root_only()
    info(f"loaded in {time.perf_counter() - t:.1f}s; draft {drafter.name}, method {verifier.name}, {tree.describe()}")

    shown = {"ids": [], "text": ""}

    def stream(tokens):
        if args.json:
            return
        shown["ids"].extend(tokens)
        text = target.decode(shown["ids"])
        sys.stdout.write(text[len(shown["text"]):] if text.startswith(shown["text"]) else "")
        sys.stdout.flush()
        shown["text"] = text

    result = generate(
        target, drafter, verifier, args.prompt, tree=tree, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, children=args.children,
        seed=args.seed, chat=not args.no_chat, on_tokens=stream, policy=policy,
    )
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    s = result.summary()
    total = max(s["draft_s"] + s["target_s"] + s["verify_s"], 1e-12)
    print("\n")
    print(
        f"[{s['tokens']} tokens in {s['steps']} steps | mean accepted length {s['mean_accepted_length']:.2f} | "
        f"{s['tokens_per_s']:.1f} tokens/s | drafting {100 * s['draft_s'] / total:.0f}% "
        f"target {100 * s['target_s'] / total:.0f}% verify {100 * s['verify_s'] / total:.0f}% | "
        f"prefill {s['prefill_s']:.2f}s | stop: {s['stop_reason']}]"
    )
    return 0


def _add_audit(sub):
    a = sub.add_parser(
        "audit",
        help="check verifiers' exactness by computing their exact output law",
        description="For each verifier, compute the exact law of one speculative step on random small cases "
                    "(prefix-dependent target/draft tables, vocabulary <= 6, depth <= 3, branching <= 3) by "
                    "enumerating every draw and every accept/reject outcome in float64, and compare it with the "
                    "target's autoregressive law. Prints max total variation, max KL, mean per-node acceptance, the "
                    "i.i.d. optimum alpha*, and a verdict.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a.add_argument("--verifiers", nargs="+", default=None, help="verifiers to audit (default: all registered)")
    a.add_argument("--controls", action="store_true", help="also audit the negative controls (known-biased rules)")
    a.add_argument("--cases", type=int, default=30, help="random cases per verifier")
    a.add_argument("--seed", type=int, default=0, help="seed of the random cases")
    a.add_argument("--tol", type=float, default=1e-12, help="total variation below which a verifier counts as exact")
    a.add_argument("--json", action="store_true", help="print the rows as JSON")
    a.add_argument("--montecarlo", type=int, default=0, metavar="PAIRS",
                   help="also check node rules on PAIRS real (p, q) pairs from the target and --draft at full vocabulary "
                        "size: Monte Carlo over --draws draws of --k i.i.d. children, total variation from p against a "
                        "4-standard-error noise bound (slow: minutes per verifier and pair)")
    a.add_argument("--target", default=DEFAULT_TARGET, help="target model for --montecarlo")
    a.add_argument("--draft", default=None,
                   help="draft for --montecarlo (default layerskip:0-11,18-29) and --distortion (default int8); "
                        "a model, int8 or layerskip draft")
    a.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for --montecarlo")
    a.add_argument("--distortion", action="store_true",
                   help="instead of the exhaustive audit: the distortion of the lossy rules (--verifiers, default all "
                        "inexact chain rules) on real (p, q) pairs of --target and --draft at each of --temperatures: "
                        "exact per-position total variation and KL from the target's law, overshoot, acceptance; then "
                        "the NLL of generated text under the target against the target's own samples")
    a.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.6, 1.0], help="temperatures for --distortion")
    a.add_argument("--prompts", type=int, default=8, help="Spec-Bench prompts for --distortion pairs")
    a.add_argument("--positions", type=int, default=16, help="response positions per prompt for --distortion pairs")
    a.add_argument("--sequence-prompts", type=int, default=3,
                   help="prompts for the sequence-level NLL check of --distortion (0: skip it)")
    a.add_argument("--sequence-tokens", type=int, default=64, help="tokens generated per prompt for the NLL check")
    a.add_argument("--k", type=int, default=2, help="children per node for --montecarlo")
    a.add_argument("--draws", type=int, default=1_000_000, help="draws per node for --montecarlo")
    a.set_defaults(func=cmd_audit)


def cmd_audit(args) -> int:
    from .audit.controls import NEGATIVE_CONTROLS  # noqa: PLC0415
    from .audit.run import audit, format_table  # noqa: PLC0415

    if args.cases < 1:
        raise VerispecError(f"--cases must be >= 1, got {args.cases}")
    if args.distortion:
        return _audit_distortion(args)
    specs = [get_verifier(n) for n in args.verifiers] if args.verifiers else list(VERIFIERS.values())
    if args.controls:
        specs += list(NEGATIVE_CONTROLS.values())
    bar = None if args.json else _progress(len(specs) * args.cases, "auditing")
    rows = audit(specs, cases=args.cases, seed=args.seed, tol=args.tol,
                 progress=None if bar is None else (lambda name, i, n: (bar.set_postfix_str(name), bar.update(1))))
    if bar is not None:
        bar.close()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows]))
    else:
        print(format_table(rows))
    failed = [r.verifier for r in rows if r.verdict.startswith("FAIL")]
    if args.montecarlo > 0:
        failed += _audit_montecarlo(args, [s for s in specs if s.node_rule is not None and (s.children or "iid") == "iid"
                                           and not s.greedy_only])
    return 1 if failed else 0


def _audit_montecarlo(args, specs) -> list[str]:
    from dataclasses import asdict  # noqa: PLC0415

    from .audit.montecarlo import monte_carlo_node  # noqa: PLC0415
    from .audit.optimum import alpha_star_iid  # noqa: PLC0415
    from .audit.real import real_pairs  # noqa: PLC0415

    target = CausalLM.load(args.target)
    draft = build_drafter(args.draft or "layerskip:0-11,18-29", target)
    pairs = real_pairs(target, draft, 1, args.montecarlo, args.temperature, args.seed)
    pairs = pairs[: args.montecarlo]
    results, failed = [], []
    bar = None if args.json else _progress(len(pairs) * len(specs), "monte carlo")
    for i, (p, q) in enumerate(pairs):
        star = alpha_star_iid(p, q, args.k)
        for spec in specs:
            r = monte_carlo_node(spec, p, q, args.k, n_draws=args.draws, seed=args.seed + i)
            results.append({"pair": i, "alpha_star": star, "claims_exact": spec.exact, **asdict(r), "biased": r.biased})
            if spec.exact and r.biased:
                failed.append(spec.name)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if args.json:
        print(json.dumps(results))
        return failed
    print(f"\nMonte Carlo on real pairs: target {args.target}, draft {args.draft}, T = {args.temperature}, "
          f"k = {args.k}, {args.draws} draws per node")
    print("| pair | verifier | claims exact | distinct tuples | TV from p | noise bound | verdict | acceptance | alpha*_iid |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        verdict = ("biased" if r["biased"] else "consistent with p") + ("" if r["claims_exact"] != r["biased"] else
                                                                         (" (FAIL)" if r["claims_exact"] else ""))
        print(f"| {r['pair']} | {r['verifier']} | {'yes' if r['claims_exact'] else 'no'} | {r['distinct_tuples']} | "
              f"{r['tv']:.4f} | {r['noise_bound']:.4f} | {verdict} | {r['acceptance']:.4f} | {r['alpha_star']:.4f} |")
    return failed


def _audit_distortion(args) -> int:
    from .audit.distortion import distortion, format_distortion, sequence_nll  # noqa: PLC0415
    from .audit.real import real_pairs  # noqa: PLC0415
    from .datasets import spec_bench_prompts  # noqa: PLC0415

    names = args.verifiers or [v.name for v in VERIFIERS.values() if v.position_rule is not None and not v.exact]
    specs = [get_verifier(n) for n in names]
    missing = [s.name for s in specs if s.position_rule is None]
    if missing:
        raise VerispecError(f"--distortion needs chain rules given per position; not: {', '.join(missing)}")
    if any(t < 0 for t in args.temperatures):
        raise VerispecError("--temperatures must be >= 0")
    if args.prompts < 1 or args.positions < 1 or args.sequence_prompts < 0 or args.sequence_tokens < 1:
        raise VerispecError("--prompts, --positions and --sequence-tokens must be >= 1, --sequence-prompts >= 0")
    specs = [get_verifier("chain"), *[s for s in specs if s.name != "chain"]]  # the exact rule as a reference
    target = CausalLM.load(args.target)
    draft_spec = args.draft or "int8"
    drafter = build_drafter(draft_spec, target)
    if not hasattr(drafter, "model"):
        raise VerispecError(f"--distortion needs a model draft (int8, layerskip:..., model:...), not {draft_spec!r}")
    rows = []
    for t in args.temperatures:
        info = _progress(1, f"pairs at T={t}") if not args.json else None
        pairs = real_pairs(target, drafter, args.prompts, args.positions, t, args.seed)
        rows += distortion(specs, pairs, t, args.seed)
        if info is not None:
            info.update(1)
            info.close()
    nll_rows = []
    if args.sequence_prompts > 0:
        prompts = [p for _, p in spec_bench_prompts(args.sequence_prompts)]
        temps = [t for t in args.temperatures if t > 0]
        bar = None if args.json else _progress(len(temps) * (len(specs) + 1), "sequence NLL")
        for t in temps:
            own = sequence_nll(target, drafter, None, prompts, t, args.sequence_tokens, seed=args.seed)
            nll_rows.append({"temperature": t, "rule": "target samples", "nll": own, "delta": 0.0})
            if bar is not None:
                bar.update(1)
            for spec in specs:
                v = sequence_nll(target, drafter, spec, prompts, t, args.sequence_tokens, seed=args.seed)
                nll_rows.append({"temperature": t, "rule": spec.name, "nll": v, "delta": v - own})
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps({"distortion": [r.as_dict() for r in rows], "sequence_nll": nll_rows}))
        return 0
    print(f"Per-position distortion on real pairs: target {args.target}, draft {draft_spec}, "
          f"{args.prompts} prompts x {args.positions} positions per temperature")
    print(format_distortion(rows))
    if nll_rows:
        print(f"\nSequence level: mean NLL per token under the target (its sampling law at T), "
              f"{args.sequence_prompts} prompts x {args.sequence_tokens} tokens, chain of 5")
        print("| T | text from | NLL/token | minus target's own |")
        print("|---|---|---|---|")
        for r in nll_rows:
            print(f"| {r['temperature']:g} | {r['rule']} | {r['nll']:.3f} | {r['delta']:+.3f} |")
    return 0


def _add_bench(sub):
    from .bench import BenchConfig  # noqa: PLC0415
    from .datasets import DATASETS_HELP  # noqa: PLC0415
    from .methods import METHODS_HELP  # noqa: PLC0415

    d = BenchConfig()
    b = sub.add_parser(
        "bench",
        help="benchmark methods x drafts x data sets x temperatures x seeds (resumable JSONL + tables)",
        description="Run every method on the same prompts in one process (Hugging Face's generate and assisted "
                    "generation included), one JSONL record per step and per prompt, then print summary tables "
                    "(also written next to the results file as .md and .csv). An interrupted run continues with "
                    "--resume. Speeds are ratios within the run: tokens/s of a method over plain decoding ('ar').",
    )
    b.add_argument("--quick", action="store_true",
                   help="a small preset that exercises every part on the default model in under 10 minutes on 2 CPU "
                        "cores (the other options then default to the preset's)")
    b.add_argument("--target", default=None, help=f"target model (default {d.target})")
    b.add_argument("--drafts", nargs="+", default=None, metavar="DRAFT", help=f"drafts (default {d.drafts}). " + DRAFT_HELP)
    b.add_argument("--methods", nargs="+", default=None, metavar="METHOD", help=f"methods (default {d.methods}): {METHODS_HELP}")
    b.add_argument("--datasets", nargs="+", default=None, metavar="SET", help=f"prompt sets (default {d.datasets}): {DATASETS_HELP}")
    b.add_argument("--limit", type=int, default=None, help=f"prompts per Spec-Bench category / per other set (default {d.limit})")
    b.add_argument("--temperatures", type=float, nargs="+", default=None, help=f"default {d.temperatures}")
    b.add_argument("--seeds", type=int, nargs="+", default=None, help=f"default {d.seeds}")
    b.add_argument("--max-new-tokens", type=int, default=None, help=f"default {d.max_new_tokens}")
    b.add_argument("--audit-cases", type=int, default=None,
                   help=f"exhaustive exactness audit of the verifiers used, cases each (default {d.audit_cases}: none)")
    b.add_argument("--dtype", default=None, help=f"default {d.dtype}")
    b.add_argument("--out", default="results/bench.jsonl", help="results file (JSONL)")
    b.add_argument("--resume", action="store_true", help="continue an interrupted run of the same configuration")
    b.add_argument("--overwrite", action="store_true", help="start again even if the results file exists")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    import dataclasses  # noqa: PLC0415

    from .bench import QUICK, BenchConfig, run_bench  # noqa: PLC0415
    from .report import Results, report, rows_csv, summarize  # noqa: PLC0415

    base = QUICK if args.quick else BenchConfig()
    given = {k: getattr(args, k) for k in ("target", "drafts", "methods", "datasets", "limit", "temperatures", "seeds",
                                            "max_new_tokens", "audit_cases", "dtype") if getattr(args, k) is not None}
    config = dataclasses.replace(base, **given)
    out = run_bench(config, args.out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                    log=lambda msg: print(msg, file=sys.stderr), command=args.command_line)
    res = Results.load(out)
    text = report(res)
    stem = out.with_suffix("")
    stem.with_name(stem.name + ".summary.md").write_text(text + "\n", encoding="utf-8")
    stem.with_name(stem.name + ".summary.csv").write_text(rows_csv(summarize(res)), encoding="utf-8")
    print(text)
    print(f"\nrecords: {out}; tables: {stem.name}.summary.md / .csv", file=sys.stderr)
    return 0


def _add_report(sub):
    r = sub.add_parser("report", help="summary tables of a results file",
                       description="Print the summary tables (Markdown, or CSV with --csv) derived from the records "
                                   "of a results file written by 'verispec bench'.")
    r.add_argument("results", help="results file (JSONL) from 'verispec bench'")
    r.add_argument("--csv", action="store_true", help="print the per-method rows as CSV instead")
    r.add_argument("--by-category", action="store_true", help="with --csv: one row per task category too")
    r.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from .report import Results, report, rows_csv, summarize  # noqa: PLC0415

    res = Results.load(args.results)
    print(rows_csv(summarize(res, by_category=args.by_category)) if args.csv else report(res), end="\n")
    return 0


def _add_plot(sub):
    p = sub.add_parser("plot", help="PNG figures from a results file",
                       description="Write PNG figures from a results file of 'verispec bench': per-candidate acceptance "
                                   "per verifier, accepted length vs the number of candidates N, speedup by task "
                                   "category, per-step latency split. Figures without data in the file are skipped.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("results", help="results file (JSONL) from 'verispec bench'")
    p.add_argument("--out", default="figures", help="folder for the PNG files")
    p.add_argument("--prefix", default="", help="prefix of the file names")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    from .plots import plot_all  # noqa: PLC0415

    paths = plot_all(args.results, args.out, args.prefix)
    if not paths:
        print("no figure has data in this results file", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def _add_train_draft(sub):
    from .eagle import TrainConfig  # noqa: PLC0415

    d = TrainConfig()
    t = sub.add_parser(
        "train-draft",
        help="train an EAGLE-style draft head for a target (self-generated data, resumable)",
        description="Train a one-layer EAGLE-style draft head for TARGET by distillation on text the target writes "
                    "itself (a user turn from an empty one, then the answer; never the evaluation sets). Stages: "
                    "corpus (OUT/corpus.jsonl), target features, training with checkpoints (OUT/checkpoint.pt, "
                    "OUT/log.jsonl), then OUT/head.pt. Run the same command again to resume. Use the head with "
                    "--draft eagle:OUT/head.pt.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t.add_argument("--target", default=DEFAULT_TARGET, help="target model")
    t.add_argument("--out", default=None, help="run folder (default runs/eagle-<target>)")
    for name in ("sequences", "prompt_tokens", "response_tokens", "gen_batch", "top_k", "epochs", "batch",
                 "checkpoint_every", "seed"):
        t.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    t.add_argument("--vocab", type=int, default=d.vocab,
                   help="draft vocabulary: the head's output layer keeps this many tokens (the corpus's most frequent), "
                        "cutting its cost; other tokens get draft probability 0, which every verifier handles exactly. "
                        "0: the whole vocabulary")
    for name in ("temperature", "lr", "feature_weight", "noise", "held_out"):
        t.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    t.add_argument("--no-resume", action="store_true", help="refuse to continue a run folder that exists")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args) -> int:
    import dataclasses  # noqa: PLC0415

    from .eagle import TrainConfig, train  # noqa: PLC0415

    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if config.sequences < 2 or config.epochs < 1 or config.batch < 1 or not 0 < config.held_out < 1 or config.vocab < 0:
        raise VerispecError("need --sequences >= 2, --epochs >= 1, --batch >= 1, 0 < --held-out < 1 and --vocab >= 0")
    out = Path(args.out or f"runs/eagle-{Path(args.target).stem}")
    if args.no_resume and out.exists() and any(out.iterdir()):
        raise VerispecError(f"{out} exists and is not empty (--no-resume)")
    target = CausalLM.load(args.target)
    path = train(target, out, config, progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr))
    print(path)
    return 0


def _add_tune_tree(sub):
    t = sub.add_parser(
        "tune-tree",
        help="search the draft tree shape that maximises tokens per second for a target and draft (Sequoia-style)",
        description="Measure, on this machine, the target's forward time as a function of the number of tree tokens "
                    "and the draft's time per depth, and the draft's per-candidate acceptance on a few Spec-Bench "
                    "prompts; then solve Sequoia's dynamic programme for the tree with the most expected accepted "
                    "tokens per second. Prints the best shape in --tree syntax and writes a JSON report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t.add_argument("--target", default=DEFAULT_TARGET)
    t.add_argument("--draft", default="eagle", help=DRAFT_HELP)
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--children", default="iid", choices=CHILD_MODES)
    t.add_argument("--prompts", type=int, default=4,
                   help="Spec-Bench prompts to measure acceptance on (each category's last questions, so that the "
                        "first ones, which the benchmarks use, stay unseen)")
    t.add_argument("--max-new-tokens", type=int, default=48)
    t.add_argument("--width", type=int, default=4, help="candidates per node measured (and allowed)")
    t.add_argument("--max-nodes", type=int, default=48)
    t.add_argument("--max-depth", type=int, default=8)
    t.add_argument("--out", default=None, help="JSON report (default: print only)")
    t.set_defaults(func=cmd_tune_tree)


def cmd_tune_tree(args) -> int:
    from .tune import tune_tree  # noqa: PLC0415

    target = CausalLM.load(args.target)
    drafter = build_drafter(args.draft, target)
    report = tune_tree(target, drafter, temperature=args.temperature, children=args.children, prompts=args.prompts,
                       max_new_tokens=args.max_new_tokens, width=args.width, max_nodes=args.max_nodes,
                       max_depth=args.max_depth, log=lambda m: print(m, file=sys.stderr))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(report["best"]["tree"])
    return 0


def _progress(total: int, desc: str):
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verispec",
        description="Speculative decoding whose verification you can trust. "
                    "Run 'verispec COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_audit(sub)
    _add_bench(sub)
    _add_report(sub)
    _add_plot(sub)
    _add_train_draft(sub)
    _add_tune_tree(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["verispec", *(shlex.quote(a) for a in argv)])
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nverispec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
