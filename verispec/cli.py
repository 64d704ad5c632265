"""Command-line interface, a thin layer over the library: parse, check, call, print.

``verispec generate``, ``serve``, ``audit``, ``bench``, ``report``, ``plot``, ``train-draft``, ``eval-draft``,
``tune-tree``.
Every command checks its arguments before it loads a model, and ends a bad input with one line on stderr
(``verispec: error: ...``, exit code 2). ``docs/cli.md`` is the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
import urllib.parse
from pathlib import Path

import torch
from tqdm import tqdm

from .audit.controls import NEGATIVE_CONTROLS
from .audit.distortion import distortion_report, format_distortion, format_nll
from .audit.montecarlo import format_monte_carlo, monte_carlo_report
from .audit.run import (
    CHAIN_RULES, audit, chain_optimum_table, format_pairs, format_table, never_lose_table, pair_rows,
)
from .backends import DTYPES, default_threads, load
from .bench import QUICK, BenchConfig, Results, run_bench
from .bench.agreement import agreement_report, format_agreement
from .bench.peers import PEERS
from .bench.plots import plot_all
from .bench.records import git_revision, machine
from .bench.report import loop_summary, loops_csv, report, rows_csv, summarize
from .bench.runner import BENCH_HELP
from .datasets import DATASETS_HELP
from .decode import TextStream, generate
from .drafters import CHILD_MODES, DraftSpec, ModelDrafter, build_drafter, draft_help
from .eagle.corpus import is_corpus
from .eagle.train import TRAIN_HELP, TrainConfig, train
from .errors import VerispecError
from .methods import DEFAULT_TREE, METHODS, METHODS_HELP, resolve
from .policies import POLICIES
from .probs import DEFAULT_TEMPERATURE, Sampling
from .serve import ServiceRecipe, bind
from .serve import run as run_server
from .tree import MAX_NODES
from .tune import VERIFIER_FOR, tune_tree
from .verifiers import VERIFIERS, get_verifier
from .version import __version__

BUILTIN = "smollm2-135m (the default), gemma3-270m"
TREE_HELP = (f"draft tree: chain:G, BxD (complete, e.g. 3x5), b1,b2,... (per-depth branching, e.g. 3,1,1), "
             f"paths:0;1;0.0 (Medusa-style rank paths), dyn:DEPTH,K,N (EAGLE-2 dynamic tree, top-k children), or "
             f"auto (the tree tuned for the draft, else {DEFAULT_TREE}); at most {MAX_NODES} drafted nodes")


def _threads(parser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: the cores this process may use, at most "
                             "OMP_NUM_THREADS). On a busy machine fewer threads than cores run much faster than more")


def _set_threads(args) -> None:
    n = getattr(args, "threads", None)
    if n is None:
        n = default_threads()
    if n < 1:
        raise VerispecError(f"--threads must be >= 1, got {n}")

    torch.set_num_threads(n)


def _progress(total: int, desc: str):
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)


def _info(args):
    return (lambda *a: None) if getattr(args, "json", False) else (lambda msg: print(msg, file=sys.stderr, flush=True))


# ---------------------------------------------------------------- generate

def _add_generate(sub):
    g = sub.add_parser(
        "generate", help="generate text with speculative decoding",
        description="Generate text from a prompt with speculative decoding; streams the text, then prints a summary. "
                    "With no options: the default model, its shipped draft head and tuned tree, exact verification, "
                    "and the draft length chosen step by step from measured acceptance (the method 'default').",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--prompt", required=True, help="the user prompt (sent through the chat template if the model has one)")
    _recipe_args(g)
    g.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="sampling temperature; 0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens")
    g.add_argument("--seed", type=int, default=0, help="random seed (same seed, same output on the same machine)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON record (text, ids, summary, per-step records)")
    _threads(g)
    g.set_defaults(func=cmd_generate)


def _recipe_args(g, dtype: str = "float32") -> None:
    """What a run decodes with: the target and its engine, the draft, the method and its overrides."""
    g.add_argument("--target", default="smollm2-135m",
                   help=f"target model: built-in alias ({BUILTIN}), .gguf file, local folder or hub id")
    g.add_argument("--draft", default="auto", help="the draft: " + draft_help())
    g.add_argument("--method", default=None, metavar="METHOD",
                   help="a named method (verifier + policy + tree; default 'default'): "
                        + "; ".join(f"{m.name}: {m.note}" for m in METHODS.values())
                        + ". A tree after '@' overrides the method's, e.g. fixed@chain:3")
    g.add_argument("--verifier", default=None, metavar="VERIFIER",
                   help="the verification rule, overriding the method's: "
                        + "; ".join(f"{v.name}: {v.note}" for v in VERIFIERS.values()))
    g.add_argument("--policy", default=None, metavar="POLICY",
                   help="draft-length policy, overriding the method's (the tree caps the depth): "
                        + "; ".join(f"{k}: {v}" for k, v in POLICIES.items()))
    g.add_argument("--tree", default=None, help=TREE_HELP + " (default: the method's)")
    g.add_argument("--children", default=None, choices=CHILD_MODES,
                   help="how the children of a tree node are drawn: i.i.d. from q, without replacement, the top-k, "
                        "or SpecHub's pairs through q's top token (hub: at most 2 a node) (default: what the verifier "
                        "needs; iid for verifiers that take any)")
    g.add_argument("--dtype", default=dtype, choices=DTYPES,
                   help=f"what the model computes in (default {dtype}; auto: bfloat16 where the CPU has bfloat16 "
                        "arithmetic, AVX512-BF16 or AMX, else float32; bfloat16 pays from a few sequences at once, "
                        "float32 is faster for one)")
    g.add_argument("--backend", default="hf", choices=("hf", "llama"),
                   help="the target's engine: hf (Hugging Face transformers) or llama (llama.cpp on the GGUF file, a "
                        "quantised target of its own; bash scripts/install_llama.sh). With llama, drafts are ngram or "
                        "model:SPEC (a GGUF draft run by llama.cpp too)")


def cmd_generate(args) -> int:
    info = _info(args)
    if not args.prompt.strip():
        raise VerispecError("the prompt is empty")
    if args.max_new_tokens < 1:
        raise VerispecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature):
        raise VerispecError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    plan = resolve(args.method, verifier=args.verifier, policy=args.policy, tree=args.tree, children=args.children,
                   temperature=sampling.temperature, info=info)
    draft = DraftSpec.parse(args.draft if plan.drafts else "none")
    _set_threads(args)
    t = time.perf_counter()
    info(f"loading target {args.target} ({args.backend}) ...")
    target = load(args.target, dtype=args.dtype, backend=args.backend, threads=args.threads)
    drafter = build_drafter(draft, target, dtype=args.dtype)
    run = plan.build(target, drafter)
    info(f"loaded in {time.perf_counter() - t:.1f}s; draft {drafter.name}, verifier {run.verifier.name}, policy "
         f"{run.policy.name}, {run.tree.describe()}")
    stream = TextStream(target.decode)

    def show(tokens):
        sys.stdout.write(stream.push(tokens))
        sys.stdout.flush()

    result = generate(target, drafter, run, args.prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      chat=not args.no_chat, on_tokens=None if args.json else show)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    sys.stdout.write(stream.flush())
    s = result.summary()
    total = max(s["draft_s"] + s["target_s"] + s["verify_s"], 1e-12)
    print("\n")
    print(f"[{s['tokens']} tokens in {s['steps']} steps | mean accepted length {s['mean_accepted_length']:.2f} | "
          f"{s['tokens_per_s']:.1f} tokens/s | drafting {100 * s['draft_s'] / total:.0f}% "
          f"target {100 * s['target_s'] / total:.0f}% verify {100 * s['verify_s'] / total:.0f}% | "
          f"prefill {s['prefill_s']:.2f}s | stop: {s['stop_reason']}]")
    return 0


# ---------------------------------------------------------------- serve

def _add_serve(sub):
    g = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible HTTP API (POST /v1/chat/completions and "
                    "/v1/completions, streaming or not; GET /v1/models, /health, /metrics) on the batched engine: up "
                    "to --max-batch requests share each target forward, each with its own draft state and seed, the "
                    "drafted depths chosen for the whole batch. Loads the model at start; stops on Ctrl-C or SIGTERM "
                    "after the requests in flight end (at most --drain-timeout seconds). docs/serving.md tells more.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _recipe_args(g, dtype="auto")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0 opens the server to the network: set --api-key then)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"),
                   help="a key every request but GET /health must send as 'Authorization: Bearer KEY' (default: "
                        "$VERISPEC_API_KEY; none: no key needed)")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: --target)")
    g.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (they share each forward)")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; one more is answered 429 at once")
    g.add_argument("--max-context", type=int, default=None,
                   help="prompt + new tokens + draft tree per request (default: the model's context); the batch's "
                        "caches are sized for --max-batch of these at start")
    g.add_argument("--answer-cache", type=int, default=100_000, metavar="TOKENS",
                   help="draft from the answers already served too, up to this many tokens of them (about 0.5 KB "
                        "a token; a draft with prompt lookup reads them: auto, hybrid, ngram, suffix); 0: off. A "
                        "request's law stays the target's, but its seeded text then depends on what was served before")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C, seconds to let the requests in flight finish before they are cut")
    g.add_argument("--ray", action="store_true",
                   help="serve --replicas copies of the engine as a Ray Serve application behind the same routes (the "
                        "[ray] extra), on the cluster at --ray-address or a local Ray instance on 127.0.0.1")
    g.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas (a process each)")
    g.add_argument("--ray-address", default=None,
                   help="with --ray: a running Ray cluster ('auto', or HOST:PORT; default: start a local instance)")
    _threads(g)
    g.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    info = _info(args)
    if args.max_batch < 1:
        raise VerispecError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not 0 <= args.port <= 65535:
        raise VerispecError(f"--port must lie in 0..65535 (0: any free port), got {args.port}")
    if args.max_queue < 0:
        raise VerispecError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not math.isfinite(args.drain_timeout) or args.drain_timeout < 0:
        raise VerispecError(f"--drain-timeout must be a finite number >= 0, got {args.drain_timeout}")
    if args.backend == "llama" and args.max_batch > 1:
        raise VerispecError("the llama backend decodes one sequence at a time: serve it with --max-batch 1")
    if args.api_key is not None and not args.api_key.strip():
        raise VerispecError("--api-key is empty")
    if args.replicas < 1:
        raise VerispecError(f"--replicas must be >= 1, got {args.replicas}")
    if args.answer_cache < 0:
        raise VerispecError(f"--answer-cache must be >= 0 tokens, got {args.answer_cache}")
    if not args.ray and (args.ray_address is not None or args.replicas != 2):
        raise VerispecError("--replicas and --ray-address go with --ray")
    recipe = ServiceRecipe(args.target, backend=args.backend, dtype=args.dtype, threads=args.threads,
                           draft=args.draft, method=args.method, verifier=args.verifier, policy=args.policy,
                           tree=args.tree, children=args.children, max_batch=args.max_batch,
                           max_queue=args.max_queue, max_context=args.max_context, answer_cache=args.answer_cache)
    recipe.plan(info=info)  # a wrong method is one line now, before any model loads
    name = args.served_model_name or args.target
    if args.ray:
        from .serve.ray_serve import deploy  # noqa: PLC0415 - the optional extra's module, for --ray only

        if args.port == 0:
            raise VerispecError("--ray needs a fixed --port (Ray Serve's proxy binds it)")
        bind(args.host, args.port).close()  # a port in use is one line now, not a failed Ray proxy later
        info(f"starting Ray Serve with {args.replicas} replicas of {args.target} ...")
        deploy(recipe, name, address=args.ray_address, host=args.host, port=args.port, replicas=args.replicas,
               api_key=args.api_key, max_ongoing=args.max_batch + args.max_queue,
               ready=lambda: info(f"serving {name!r} on http://{args.host}:{args.port}/v1 through Ray Serve "
                                  f"({args.replicas} replicas; Ctrl-C or SIGTERM to stop)"))
        info("stopped")
        return 0
    sock = bind(args.host, args.port)  # before the model loads: a port in use is one line, at once
    _set_threads(args)
    service = recipe(info)
    host, port = sock.getsockname()[:2]
    where = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    run_server(service, name, sockets=[sock], api_key=args.api_key, drain_s=args.drain_timeout,
               ready=lambda: info(f"serving {name!r} on {where}/v1 (Ctrl-C or SIGTERM to stop)"))
    info("stopped")
    return 0


# ---------------------------------------------------------------- audit

def _add_audit(sub):
    a = sub.add_parser(
        "audit", help="check verifiers' exactness by computing their exact output law",
        description="For each verifier, compute the exact law of one speculative step on random small cases "
                    "(prefix-dependent target/draft tables, vocabulary <= 6, depth <= 3, branching <= 3) by "
                    "enumerating every draw and every accept/reject outcome in float64, and compare it with the "
                    "target's autoregressive law. Prints max total variation, max KL, mean per-node acceptance, the "
                    "i.i.d. optimum alpha*, and a verdict.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    a.add_argument("--target", default="smollm2-135m", help="target model for --montecarlo and --distortion")
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
    _threads(a)
    a.set_defaults(func=cmd_audit)


def _model_draft(target, spec: str, what: str):
    drafter = build_drafter(spec, target)
    if not isinstance(drafter, ModelDrafter):
        raise VerispecError(f"{what} needs a model draft (int8, layerskip:..., model:...), not {spec!r}")
    return drafter


def cmd_audit(args) -> int:
    if args.cases < 1:
        raise VerispecError(f"--cases must be >= 1, got {args.cases}")
    specs = [get_verifier(n) for n in args.verifiers] if args.verifiers else list(VERIFIERS.values())
    if args.draft is not None:
        DraftSpec.parse(args.draft)
    if args.distortion:
        return _audit_distortion(args)
    if args.montecarlo < 0 or args.k < 1 or args.draws < 1:
        raise VerispecError("--montecarlo must be >= 0, --k and --draws >= 1")
    if args.controls:
        specs += list(NEGATIVE_CONTROLS.values())
    bar = None if args.json else _progress(len(specs) * args.cases, "auditing")
    rows = audit(specs, cases=args.cases, seed=args.seed, tol=args.tol,
                 progress=None if bar is None else (lambda name, i, n: (bar.set_postfix_str(name), bar.update(1))))
    if bar is not None:
        bar.close()
    print(json.dumps([r.as_dict() for r in rows]) if args.json else format_table(rows))
    if not args.json:
        print("\nAgainst specinfer, node by node (exact i.i.d.-children rules on random small (p, q, k)):\n")
        print(never_lose_table([s for s in specs if s.exact and s.default_children == "iid" and s.node_rule],
                               cases=max(args.cases, 50), seed=args.seed))
        if any(s.name == "spechub" for s in specs):
            print("\nTwo candidates a node, each rule with its own children (SpecHub's pairs through the hub):\n")
            print(format_pairs(pair_rows(cases=max(args.cases, 50), seed=args.seed)))
        chains = [s for s in specs if s.name in CHAIN_RULES]
        if chains and any(s.name == "block" for s in specs):
            print("\nOn chains, against block verification (the most an exact rule keeps from one chain):\n")
            print(chain_optimum_table(chains, cases=max(args.cases, 40), seed=args.seed))
    failed = [r.verifier for r in rows if r.verdict.startswith("FAIL")]
    if args.montecarlo > 0:
        failed += _audit_montecarlo(args, [s for s in specs if s.node_rule is not None and s.default_children == "iid"
                                           and not s.greedy_only])
    return 1 if failed else 0


def _audit_montecarlo(args, specs) -> list[str]:
    _set_threads(args)
    target = load(args.target)
    drafter = _model_draft(target, args.draft or "layerskip:0-11,18-29", "--montecarlo")
    bar = None if args.json else _progress(args.montecarlo * len(specs), "monte carlo")
    rows = monte_carlo_report(target, drafter, specs, args.montecarlo, args.k, args.draws, args.temperature, args.seed,
                              progress=None if bar is None else (lambda: bar.update(1)))
    if bar is not None:
        bar.close()
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"\nMonte Carlo on real pairs: target {args.target}, draft {args.draft}, T = {args.temperature}, "
              f"k = {args.k}, {args.draws} draws per node")
        print(format_monte_carlo(rows))
    return [r["verifier"] for r in rows if r["claims_exact"] and r["biased"]]


def _audit_distortion(args) -> int:
    names = args.verifiers or [v.name for v in VERIFIERS.values() if v.position_rule is not None and not v.exact]
    specs = [get_verifier(n) for n in names]
    missing = [s.name for s in specs if s.position_rule is None]
    if missing:
        raise VerispecError(f"--distortion needs chain rules given per position; not: {', '.join(missing)}")
    if any(not 0 <= t < math.inf for t in args.temperatures):
        raise VerispecError("--temperatures must be finite and >= 0")
    if args.prompts < 1 or args.positions < 1 or args.sequence_prompts < 0 or args.sequence_tokens < 1:
        raise VerispecError("--prompts, --positions and --sequence-tokens must be >= 1, --sequence-prompts >= 0")
    specs = [get_verifier("chain"), *[s for s in specs if s.name != "chain"]]  # the exact rule as a reference
    _set_threads(args)
    target = load(args.target)
    draft_spec = args.draft or "int8"
    drafter = _model_draft(target, draft_spec, "--distortion")
    work = len(args.temperatures) + len(specs) * sum(1 for t in args.temperatures if t > 0) * (args.sequence_prompts > 0)
    bar = None if args.json else _progress(work, "distortion")
    rows, nll_rows = distortion_report(target, drafter, specs, args.temperatures, args.prompts, args.positions,
                                       args.sequence_prompts, args.sequence_tokens, args.seed,
                                       progress=None if bar is None else (lambda label: bar.update(1)))
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
        print(format_nll(nll_rows))
    return 0


# ---------------------------------------------------------------- bench, report, plot

def _add_bench(sub):
    d = BenchConfig()
    b = sub.add_parser(
        "bench", help="benchmark methods x drafts x data sets x temperatures x seeds (resumable records + tables)",
        description="Run every method on the same prompts in one process (the peers -- Hugging Face generate and "
                    "assisted generation, llama.cpp when installed -- included), one record per step and per prompt, "
                    "then print summary tables with 95%% intervals (also written next to the results file as .md and "
                    ".csv). An interrupted run continues with --resume. Speeds are ratios within the run, paired per "
                    "prompt. 'default' is what 'verispec generate' does with no options.")
    b.add_argument("--quick", action="store_true",
                   help="a small preset that exercises every part on the default model in under 3 minutes on 2 CPU "
                        "cores (the other options then default to the preset's)")
    extra = {"drafts": " (" + draft_help() + ")", "datasets": ": " + DATASETS_HELP,
             "methods": ": " + METHODS_HELP + "; or a peer: " + "; ".join(f"{p.name} ({p.note})" for p in PEERS.values())}
    for f in dataclasses.fields(BenchConfig):
        default = getattr(d, f.name)
        flag = "--" + f.name.replace("_", "-")
        text = f"{BENCH_HELP[f.name]}{extra.get(f.name, '')} (default {default})"
        if isinstance(default, bool):
            b.add_argument(flag, action="store_true", default=None, help=text)
        elif isinstance(default, list):
            kind = {"temperatures": float, "seeds": int, "concurrency": int}.get(f.name, str)
            b.add_argument(flag, nargs="+" if f.name != "shadow" else "*", type=kind, default=None, help=text)
        else:
            ints = ("limit", "audit_cases", "max_new_tokens", "shadow_seeds", "rounds")
            b.add_argument(flag, type=int if f.name in ints else str, default=None, help=text)
    b.add_argument("--out", default="results/bench.jsonl", help="results file (JSONL)")
    b.add_argument("--resume", action="store_true", help="continue an interrupted run of the same configuration")
    b.add_argument("--overwrite", action="store_true", help="start again even if the results file exists")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    _threads(b)
    b.set_defaults(func=cmd_bench)


def _writable_file(path: str, what: str) -> Path:
    p = Path(path)
    if p.exists() and p.is_dir():
        raise VerispecError(f"{what} {path} is a folder, not a file")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise VerispecError(f"{what} {path}: {parent} is a file, not a folder")
            break
    return p


def cmd_bench(args) -> int:
    base = QUICK if args.quick else BenchConfig()
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig) if getattr(args, f.name) is not None}
    config = dataclasses.replace(base, **given)
    config.validate()
    for draft in config.drafts:
        DraftSpec.parse(draft)
    out = _writable_file(args.out, "--out")
    if out.name.endswith(".gz"):
        raise VerispecError(f"--out {args.out}: a run writes its records plain, line by line (give NAME.jsonl; "
                            "gzip them once the run is done, as scripts/make_results.py does)")
    if out.exists() and not (args.resume or args.overwrite):
        raise VerispecError(f"{out} exists: pass --resume to continue it, or --overwrite to start again")
    _set_threads(args)
    out = run_bench(config, out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                    log=lambda msg: print(msg, file=sys.stderr), command=args.command_line)
    res = Results.load(out)
    text = report(res)
    stem = out.with_suffix("")
    stem.with_name(stem.name + ".summary.md").write_text(text + "\n", encoding="utf-8")
    csv_text = loops_csv(loop_summary(res)) if res.cells else rows_csv(summarize(res))
    stem.with_name(stem.name + ".summary.csv").write_text(csv_text, encoding="utf-8")
    print(text)
    print(f"\nrecords: {out}; tables: {stem.name}.summary.md / .csv", file=sys.stderr)
    return 0


def _add_report(sub):
    r = sub.add_parser("report", help="summary tables of results files",
                       description="Print the summary tables (Markdown, or CSV with --csv) derived from the records "
                                   "of results files written by 'verispec bench'. A folder means every results file "
                                   "in it.")
    r.add_argument("results", nargs="*", default=["results"], help="results files (JSONL, or gzipped JSONL) or folders "
                   "(default results/)")
    r.add_argument("--csv", action="store_true", help="print the per-method rows as CSV instead")
    r.add_argument("--by-category", action="store_true", help="with --csv: one row per task category too")
    r.set_defaults(func=cmd_report)


def _results_files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted([*p.glob("*.jsonl"), *p.glob("*.jsonl.gz")])
            if not found:
                raise VerispecError(f"{p} holds no results files (*.jsonl, *.jsonl.gz)")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise VerispecError(f"results file not found: {p}")
    return out


def cmd_report(args) -> int:
    warn = lambda msg: print(f"verispec: warning: {msg}", file=sys.stderr)  # noqa: E731
    files = _results_files(args.results)
    for i, path in enumerate(files):
        res = Results.load(path, warn)
        if len(files) > 1:
            print(("\n" if i else "") + f"# {path}\n")
        print(rows_csv(summarize(res, by_category=args.by_category)) if args.csv else report(res))
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
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise VerispecError(f"--out {args.out} is a file; give a folder for the figures")
    paths = plot_all(args.results, out, args.prefix)
    if not paths:
        print("no figure has data in this results file", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


# ---------------------------------------------------------------- draft heads and trees

def _add_train_draft(sub):
    t = sub.add_parser(
        "train-draft", help="train an EAGLE-style draft head for a target (self-written data, resumable)",
        description="Train a one-layer EAGLE-style draft head for TARGET by distillation on text the target writes "
                    "itself in the shapes of common tasks (chat, documents with summaries, questions and "
                    "translations, edits, instructions, trivia, word problems, code; never the evaluation sets). "
                    "Stages: the corpus (its text in OUT/text/, one small file per round, fit to commit; the target's "
                    "features and labels in OUT/features/, written by the forwards that write the text, or computed "
                    "again by teacher forcing where missing), training with checkpoints "
                    "(OUT/checkpoint.pt, OUT/log.jsonl), then OUT/head.pt (the checkpoint best on the held-out "
                    "rounds). Run the same command again to resume; a larger --rounds extends the corpus. Use the "
                    "head with --draft eagle:OUT/head.pt; 'verispec eval-draft' measures it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--target", default="smollm2-135m", help="target model")
    t.add_argument("--out", default=None, help="run folder (default runs/eagle-<target>)")
    for f in dataclasses.fields(TrainConfig):
        t.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, help=TRAIN_HELP[f.name])
    t.add_argument("--until", choices=("corpus",), default=None,
                   help="stop after this stage (e.g. write the corpus now, train later)")
    t.add_argument("--store-layers", default=None,
                   help="keep target features of these layers in the corpus (a superset of --feature-layers), so that "
                        "heads reading other subsets train on it")
    t.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="what the target writes the corpus in, and computes the features a corpus lacks in (auto: "
                        "bfloat16 where the CPU has bfloat16 arithmetic; about 1.25x the float32 rate there); training "
                        "reads the float32 target's tables")
    t.add_argument("--corpus", default=None, metavar="DIR",
                   help="train on the corpus of another run folder (read only), e.g. heads of other options or data "
                        "sizes on one corpus; --rounds must not exceed its complete rounds")
    t.add_argument("--device", default="cpu",
                   help="where the corpus is written, the features it lacks computed and the head trained: cpu, or "
                        "a GPU (cuda, cuda:1, ...; the target then runs in float32 with the stock transformers "
                        "forward, and new rounds are text sampled with Hugging Face generate, many rounds together, "
                        "their features computed afterwards). scripts/gpu_head.sh runs it on a lent GPU")
    t.add_argument("--max-minutes", type=float, default=None,
                   help="stop training at the first checkpoint after this many minutes of the command and write "
                        "head.pt from the best checkpoint so far; with --until corpus, begin no corpus round after "
                        "them (the same command resumes either)")
    t.add_argument("--no-resume", action="store_true", help="refuse to continue a run folder that exists")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    _threads(t)
    t.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args) -> int:
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    config.validate()
    store = TrainConfig(feature_layers=args.store_layers).layers() if args.store_layers else None
    out = Path(args.out or f"runs/eagle-{Path(args.target).stem}")
    if args.no_resume and out.exists() and any(out.iterdir()):
        raise VerispecError(f"{out} exists and is not empty (--no-resume)")
    _set_threads(args)
    options = dict(progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr), store_layers=store,
                   corpus_dir=args.corpus, max_minutes=args.max_minutes)
    if args.corpus is not None and args.until == "corpus":
        raise VerispecError("--until corpus writes a corpus; --corpus reads another folder's (use one or the other)")
    if args.device != "cpu":  # features and training on a GPU, in float32; the corpus's text is already there
        if args.dtype not in ("auto", "float32"):
            raise VerispecError(f"--device {args.device} computes in float32, not --dtype {args.dtype}")
        print(train(load(args.target, device=args.device), out, config, until=args.until, **options))
        return 0
    target = load(args.target, dtype=args.dtype)  # the corpus's writer (and its features' where they are missing)
    if target.dtype != torch.float32 and not (out / "head.pt").exists():  # the features this training reads
        path = train(target, out, config, until=args.until or "features", **options)
        if args.until == "corpus":
            print(path)
            return 0
        target = load(args.target)
    path = train(target, out, config, until=args.until, **options)
    print(path)
    return 0


AUDIT_PROMPTS = ("Name an animal.", "Continue the pattern: red, blue, red, blue, red,")  # spread first tokens


def _add_audit_engine(sub):
    from .audit.adapters import ENGINES  # noqa: PLC0415

    names = "; ".join(f"{e.name}: {e.help}" for e in ENGINES.values())
    a = sub.add_parser(
        "audit-engine", help="test an engine's speculative sampling against its target's law, by sampling",
        description="A black-box test of an engine's speculative sampling: the first K tokens of N seeded runs on each "
                    "prompt, at each temperature, against the exact law of those K tokens from the same target's "
                    "logits by teacher forcing (chi-square over cells expected 5 times or more, the rest merged; a law "
                    "differs at p < 0.001). Each row gives the total variation estimate with a bootstrap interval and "
                    "the smallest total variation the test detects at N (a known perturbation of the law, rejected "
                    "in 80 %% of simulations). --controls adds samplers wrong on purpose, which must be flagged. Exit "
                    "status 1 if a law differs or a control is not flagged. Engines: " + names + "; verispec-serve: "
                    "a running 'verispec serve' at --url, the law from --target loaded here. docs/audit-engine.md: "
                    "auditing another engine (vLLM, SGLang) with an adapter.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a.add_argument("engines", nargs="*", metavar="ENGINE", help="engines to audit (" + ", ".join(
        [*(n for n, e in ENGINES.items() if not e.control), "verispec-serve"]) + ")")
    a.add_argument("--controls", action="store_true", help="also run the negative controls: "
                   + ", ".join(n for n, e in ENGINES.items() if e.control))
    a.add_argument("--samples", type=int, default=2000, help="seeded runs per engine, prompt and setting")
    a.add_argument("--k", type=int, default=2, help="tokens of each run compared (1-3)")
    a.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0], help="temperatures (> 0)")
    a.add_argument("--top-k", type=int, default=0, help="top-k filtering of every run and of the law (0: off)")
    a.add_argument("--top-p", type=float, default=1.0, help="nucleus filtering of every run and of the law (1: off)")
    a.add_argument("--prompt", action="append", default=None,
                   help="a user message (repeatable; default, unless --text is given: "
                        + " / ".join(repr(p) for p in AUDIT_PROMPTS) + ")")
    a.add_argument("--text", action="append", default=None,
                   help="a plain text prompt, without the chat template, after the --prompt ones (repeatable; prompt "
                        "lookup drafts most where the text repeats)")
    a.add_argument("--target", default="smollm2-135m", help="the target model")
    a.add_argument("--dtype", default="float32", help="what the target computes in (float32, bfloat16, auto); for "
                   "verispec-serve, the server's own --dtype: the law must come from the target it serves")
    a.add_argument("--url", default=None, help="verispec-serve: the server's base URL (loopback)")
    a.add_argument("--floor", type=float, default=1e-5, help="prefixes below this probability are merged in the law")
    a.add_argument("--out", default=None, help="also write the rows as JSON lines to this file")
    a.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    _threads(a)
    a.set_defaults(func=cmd_audit_engine)


def cmd_audit_engine(args) -> int:
    from .audit.adapters import ENGINES, ServeAdapter  # noqa: PLC0415
    from .audit.engines import check_engine, format_checks  # noqa: PLC0415

    known = [*ENGINES, "verispec-serve"]
    wanted = list(dict.fromkeys(args.engines + ([n for n, e in ENGINES.items() if e.control] if args.controls else [])))
    if not wanted:
        raise VerispecError("name at least one engine (" + ", ".join(known) + ") or pass --controls")
    bad = [n for n in wanted if n not in known]
    if bad:
        raise VerispecError(f"unknown engine {bad[0]!r}; choose from {', '.join(known)}")
    if args.samples < 10 or not 1 <= args.k <= 3 or args.floor <= 0 or args.floor >= 1:
        raise VerispecError("--samples must be >= 10, --k in 1..3, --floor in (0, 1)")
    if any(not 0 < t <= 2 for t in args.temperatures):
        raise VerispecError("--temperatures must be in (0, 2]: at T = 0 there is no law to sample")
    if "verispec-serve" in wanted:
        if not args.url:
            raise VerispecError("verispec-serve needs --url (a running 'verispec serve', e.g. http://127.0.0.1:8000)")
        host = urllib.parse.urlparse(args.url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise VerispecError(f"--url must be a loopback address (127.0.0.1), not {host!r}")
    sampling = [Sampling(t, args.top_k, args.top_p) for t in args.temperatures]  # checks top-k and top-p
    out = _writable_file(args.out, "--out") if args.out else None
    if out is not None:
        out.write_text("")
    _set_threads(args)
    target = load(args.target, dtype=args.dtype)
    chats = args.prompt or ([] if args.text else list(AUDIT_PROMPTS))
    prompts = [target.encode_prompt(p) for p in chats] + [target.encode_prompt(t, chat=False) for t in args.text or []]
    info = _info(args)
    rows = []
    for name in wanted:
        entry = ENGINES.get(name)
        adapter = ServeAdapter(args.url, target) if entry is None else entry.make(target)
        try:
            for s in sampling:
                reason = entry.skip(s.temperature) if entry is not None else None
                if reason:
                    info(f"{name} at T = {s.temperature:g} left out: {reason}")
                    continue
                for i, ids in enumerate(prompts):
                    bar = None if args.json else _progress(args.samples, f"{name} T={s.temperature:g} prompt {i}")
                    row = check_engine(adapter, ids, args.k, args.samples, s, prompt_index=i, floor=args.floor,
                                       control=entry is not None and entry.control,
                                       progress=None if bar is None else bar.update)
                    if bar is not None:
                        bar.close()
                    rows.append(row)
                    if out is not None:
                        with open(out, "a") as f:
                            f.write(json.dumps({**row.as_dict(), "command": args.command_line, "git": git_revision(),
                                                "machine": machine()}) + "\n")
                    if args.json:
                        print(json.dumps(row.as_dict()), flush=True)
        finally:
            adapter.close()  # a server it started stops here
    if not args.json:
        print(format_checks(rows))
    wrong = [r for r in rows if r.differs != r.control]
    for r in wrong:
        info(f"{r.engine} (prompt {r.prompt}, T = {r.temperature:g}): {r.verdict}")
    return 1 if wrong else 0


def _add_eval_draft(sub):
    e = sub.add_parser(
        "eval-draft", help="how often a draft head agrees with its target, per depth (held-out text)",
        description="Per drafted depth 1..DEPTHS, on response tokens only: the head's top-1 agreement with the target "
                    "and the greedy chain acceptance (depth d among positions whose depths 1..d-1 all agreed), with "
                    "the head reading its own outputs from depth 2 on, exactly as in the decoding loop. Measured on "
                    "held-out Spec-Bench questions (each category's last ones, answered greedily by the target) and, "
                    "with --corpus, on the held-out rounds of a train-draft corpus. --check also runs the decoding "
                    "loop and compares its acceptance with the teacher-forced one at the same positions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("--target", default="smollm2-135m", help="target model")
    e.add_argument("--draft", default="eagle", help="an EAGLE head: 'eagle' (the shipped one) or 'eagle:PATH'")
    e.add_argument("--depths", type=int, default=4, help="drafted depths to measure")
    e.add_argument("--per-group", type=int, default=2, help="held-out Spec-Bench questions per category")
    e.add_argument("--max-new-tokens", type=int, default=96, help="answer length on Spec-Bench questions")
    e.add_argument("--corpus", default=None,
                   help="a train-draft corpus folder: also measure on the rounds the head held out (the split of the "
                        "rounds it trained with, read from its file, however far the corpus has grown since)")
    e.add_argument("--check", type=int, default=0, metavar="PROMPTS",
                   help="also run the loop (greedy chain of --depths) on PROMPTS held-out questions and compare")
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    _threads(e)
    e.set_defaults(func=cmd_eval_draft)


def cmd_eval_draft(args) -> int:
    spec = DraftSpec.parse(args.draft)
    if spec.kind != "eagle":
        raise VerispecError(f"eval-draft measures EAGLE heads ('eagle' or 'eagle:PATH'), not {args.draft!r}")
    if args.depths < 1 or args.per_group < 1 or args.max_new_tokens < 1 or args.check < 0:
        raise VerispecError("--depths, --per-group and --max-new-tokens must be >= 1, --check >= 0")
    if args.corpus and not is_corpus(args.corpus):
        raise VerispecError(f"{args.corpus} holds no corpus (its text/ folder; a 'verispec train-draft' run folder)")
    _set_threads(args)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    target = load(args.target)
    head = build_drafter(spec, target).head
    bar = None if args.json else _progress(6 * args.per_group + args.check, "evaluating")
    report = agreement_report(target, head, depths=args.depths, per_group=args.per_group,
                              max_new_tokens=args.max_new_tokens, corpus=args.corpus, check=args.check,
                              progress=None if bar is None else (lambda n=1: bar.update(n)))
    if bar is not None:
        bar.close()
    # where the figures came from: the command, revision, machine and date
    report.update(command=args.command_line, git=git_revision(), machine=machine(), started=started)
    print(json.dumps(report) if args.json else format_agreement(report))
    return 0


def _add_tune_tree(sub):
    t = sub.add_parser(
        "tune-tree", help="search the draft tree shape that maximises tokens per second for a target and draft",
        description="Measure, on this machine, the target's forward time as a function of the number of tree tokens "
                    "(after choosing its linear kernels per row count), the draft's time per depth, and the draft's "
                    "per-candidate acceptance on held-out Spec-Bench prompts; then solve Sequoia's dynamic programme "
                    "for the tree with the most expected accepted tokens per second. Prints the best shape in --tree "
                    "syntax and writes a JSON report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--target", default="smollm2-135m", help="target model")
    t.add_argument("--backend", default="hf", choices=("hf", "llama"),
                   help="engine computing the target: Hugging Face transformers, or llama.cpp on the GGUF file")
    t.add_argument("--draft", default="eagle", help="the draft: " + draft_help())
    t.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the acceptance runs")
    t.add_argument("--children", default="iid", choices=tuple(VERIFIER_FOR), help="how children are drawn")
    t.add_argument("--prompts", type=int, default=6,
                   help="Spec-Bench prompts to measure acceptance on (each category's last questions, so that the "
                        "first ones, which the benchmarks use, stay unseen)")
    t.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt")
    t.add_argument("--width", type=int, default=4, help="candidates per node measured (and allowed)")
    t.add_argument("--max-nodes", type=int, default=48, help="largest tree considered")
    t.add_argument("--max-depth", type=int, default=8, help="deepest tree considered")
    t.add_argument("--out", default=None, help="JSON report (default: print only)")
    _threads(t)
    t.set_defaults(func=cmd_tune_tree)


def cmd_tune_tree(args) -> int:
    spec = DraftSpec.parse(args.draft)
    if not 0 <= args.temperature < math.inf or args.prompts < 1 or args.width < 1 or args.max_nodes < 1 \
            or args.max_depth < 1 or args.max_new_tokens < 1:
        raise VerispecError("need a finite --temperature >= 0 and --prompts, --width, --max-nodes, --max-depth, "
                            "--max-new-tokens >= 1")
    out = _writable_file(args.out, "--out") if args.out else None
    _set_threads(args)
    target = load(args.target, backend=args.backend, threads=args.threads)
    drafter = build_drafter(spec, target)
    report = tune_tree(target, drafter, temperature=args.temperature, children=args.children, prompts=args.prompts,
                       max_new_tokens=args.max_new_tokens, width=args.width, max_nodes=args.max_nodes,
                       max_depth=args.max_depth, log=lambda m: print(m, file=sys.stderr))
    report.update(command=args.command_line, git=git_revision(), machine=machine())  # where the figures came from
    if out is not None:
        out.write_text(json.dumps(report, indent=1))
    print(report["best"]["tree"])
    return 0


# ---------------------------------------------------------------- kernels

def _add_kernels(sub):
    k = sub.add_parser(
        "kernels", help="build the native CPU kernels now (scripts/install.sh does)",
        description="Build the native CPU kernels the default model's forward uses on this machine, side by side, "
                    "and say which are here. Builds live in one folder per user (~/.cache/verispec/kernels, or "
                    "$VERISPEC_KERNELS), keyed by their sources, flags, torch, compiler and CPU: every checkout "
                    "shares them, and a build is made once. Without a C++ compiler and ninja verispec runs pure "
                    "torch (so does VERISPEC_NO_NATIVE=1).")
    k.set_defaults(func=cmd_kernels)


def cmd_kernels(args) -> int:
    from .backends import native  # noqa: PLC0415

    t = time.perf_counter()
    built = native.build_all()
    where = native.kernels_home()
    for what, ok in built.items():
        print(f"{what:18} {'ready' if ok else 'not built here (the pure-torch path runs)'}")
    print(f"({time.perf_counter() - t:.0f} s; builds in {where})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verispec",
        description="Speculative decoding whose verification you can trust. "
                    "Run 'verispec COMMAND --help' for the options of a command.")
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_generate, _add_serve, _add_audit, _add_bench, _add_report, _add_plot, _add_train_draft,
                _add_eval_draft, _add_audit_engine, _add_tune_tree, _add_kernels):
        add(sub)
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
    except BrokenPipeError:  # e.g. `verispec report FILE | head`: the reader left; say nothing more
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so that the interpreter's final flush is quiet
        except OSError:
            pass
        return 0
    except KeyboardInterrupt:
        print("\nverispec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
