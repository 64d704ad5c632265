"""AdaSD Tables 1-2 shape: adaptive draft length and the lossy rules against fixed-length speculative
decoding and the Hugging Face peers, on GSM8K and HumanEval, with accuracy and distortion.

    python scripts/adaptive_bench.py --temperatures 0 0.6 --gsm8k 5 --humaneval 5 --max-new-tokens 96

All methods run in one process on the same prompts, interleaved prompt by prompt so that machine load
hits them alike. A method's policy and learning state persist across its prompts (online learning).
Columns: tokens/s (tokens / wall time, prefill included, for every method alike), speedup over `fixed`,
#cand and #match (drafted and accepted draft tokens per verification), acceptance rate (#match / #cand),
accuracy (GSM8K exact match, HumanEval pass@1), distortion (mean per-position total variation of the
rule's exact law from the target's, on real (p, q) pairs of this target and draft at this temperature,
from Spec-Bench prompts; and the same TV at every position the run itself tested, with the learning
state of that moment),
and NLL (mean negative log-likelihood per generated token under the target's sampling law; T > 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verispec.audit.distortion import distortion, target_nll  # noqa: E402
from verispec.audit.real import real_pairs  # noqa: E402
from verispec.cli import build_drafter  # noqa: E402
from verispec.decode import generate  # noqa: E402
from verispec.drafters import NoDrafter  # noqa: E402
from verispec.methods import METHODS, get_method  # noqa: E402
from verispec.models import CausalLM  # noqa: E402
from verispec.peers import hf_generate  # noqa: E402
from verispec.tasks import gsm8k, humaneval, score  # noqa: E402
from verispec.verifiers import get_verifier  # noqa: E402
from verispec.verifiers.chain import chain_laws, position_law  # noqa: E402

GREEDY_SAME = {"adasd": "adasd-gen-only", "adasd-verify-only": "fixed", "adasd-hybrid": "hf", "fsd": "fixed",
               "typical": "fixed"}  # at T = 0 these produce exactly the output of the method named (tested)


def recording(spec, tvs: list):
    """``spec`` with the exact per-position TV of its law from p recorded at every position it tests
    (with the learning state as it is at that step): the distortion on the decoded positions themselves."""
    rule = spec.position_rule
    if rule is None:
        return spec

    def fn(draft, p, rng, *state):
        verdict = spec.fn(draft, p, rng, *state)
        g, tested = draft.num_drafted, len(verdict.tested)
        if g and tested:
            _, laws = chain_laws(draft)
            law = position_law(rule, p[:tested], laws[:tested], state[0] if state else None)
            tvs.extend((0.5 * (law - p[:tested].double()).abs().sum(-1)).tolist())
        return verdict

    return dataclasses.replace(spec, fn=fn)


def run_one(method, target, drafter, state, problem, prompt_ids, args, temperature, seed):
    if method.peer is not None:
        res = hf_generate(target, prompt_ids, args.max_new_tokens, temperature, seed=seed,
                          assistant=drafter.model if method.peer == "assisted" else None)
        return res.token_ids, res.wall_s, res.drafted, res.accepted, []
    spec, policy, vstate = state
    drafter_used = NoDrafter() if method.max_depth == 0 else drafter
    tvs = []
    out = generate(target, drafter_used, recording(spec, tvs), prompt_ids, tree=method.tree(),
                   max_new_tokens=args.max_new_tokens, temperature=temperature, policy=policy, verifier_state=vstate,
                   seed=seed)
    return out.token_ids, out.wall_s, [s.drafted for s in out.steps], [s.accepted_length - 1 for s in out.steps], tvs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="int8")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--gsm8k", type=int, default=5)
    ap.add_argument("--humaneval", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--distortion-prompts", type=int, default=4)
    ap.add_argument("--distortion-positions", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-greedy-duplicates", action="store_true",
                    help="at T = 0 skip the lossy rows whose output equals another row's (see GREEDY_SAME)")
    ap.add_argument("--out", default="results/adaptive.jsonl")
    args = ap.parse_args()

    methods = [get_method(m) for m in args.methods]
    target = CausalLM.load(args.target)
    drafter = build_drafter(args.draft, target)
    problems = gsm8k(args.gsm8k) + humaneval(args.humaneval)
    prompts = [target.encode_prompt(p.prompt, chat=p.chat) for p in problems]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    # warm-up (first forwards allocate)
    generate(target, drafter, get_verifier("chain"), prompts[0], max_new_tokens=8, temperature=0.6)
    hf_generate(target, prompts[0], 8, 0.6, assistant=drafter.model)

    tv = {}
    for temperature in args.temperatures:
        pairs = real_pairs(target, drafter, args.distortion_prompts, args.distortion_positions, temperature, args.seed)
        verifiers = sorted({m.verifier for m in methods if m.verifier})
        for row in distortion([get_verifier(v) for v in verifiers], pairs, temperature, args.seed):
            tv[(temperature, row.verifier)] = row.mean_tv

    with out_path.open("w") as f:
        f.write(json.dumps({"header": vars(args), "torch": torch.__version__, "time": time.ctime()}) + "\n")
        for temperature in args.temperatures:
            run_methods = [m for m in methods if not (temperature == 0 and args.skip_greedy_duplicates
                                                        and m.name in GREEDY_SAME)]
            states = {m.name: m.build() for m in run_methods}
            bar = tqdm(total=len(problems) * len(run_methods), desc=f"T={temperature}", file=sys.stderr)
            for i, (problem, prompt_ids) in enumerate(zip(problems, prompts)):
                for m in run_methods:
                    ids, wall, drafted, accepted, tvs = run_one(m, target, drafter, states[m.name], problem, prompt_ids,
                                                           args, temperature, args.seed + i)
                    text = target.decode([t for t in ids if t not in target.eos_token_ids])
                    rec = {"T": temperature, "method": m.name, "problem": problem.id, "task": problem.task,
                           "tokens": len(ids), "wall_s": wall, "drafted": drafted, "accepted": accepted,
                           "correct": score(problem, text), "nll": target_nll(target, prompt_ids, ids, temperature),
                           "tv_decoded": tvs,
                           "text": text}
                    records.append(rec)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    bar.set_postfix_str(f"{m.name} {len(ids) / wall:.1f} tok/s")
                    bar.update(1)
            bar.close()
    print(table(records, methods, args.temperatures, tv, drafter.name, args))


def table(records, methods, temperatures, tv, draft_name, args) -> str:
    lines = [f"target {args.target}, draft {draft_name}; {args.gsm8k} GSM8K + {args.humaneval} HumanEval problems, "
             f"max {args.max_new_tokens} new tokens",
             "",
             "| T | method | tokens/s | speedup vs fixed | vs HF generate | vs HF assisted | #cand | #match "
             "| acc. rate | GSM8K | HumanEval | distortion (TV) | TV on decoded positions | NLL/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for temperature in temperatures:
        rows = {}
        for m in methods:
            rs = [r for r in records if r["T"] == temperature and r["method"] == m.name]
            if not rs:
                continue
            tps = sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
            drafted = [d for r in rs for d in r["drafted"]]
            accepted = [a for r in rs for a in r["accepted"]]
            rows[m.name] = (m, rs, tps, drafted, accepted)
        base = {k: rows[k][2] for k in ("fixed", "hf-generate", "hf-assisted") if k in rows}
        for name, (m, rs, tps, drafted, accepted) in rows.items():
            cand = statistics.mean(drafted) if drafted else float("nan")
            match = statistics.mean(accepted) if accepted else float("nan")
            rate = sum(accepted) / sum(drafted) if drafted and sum(drafted) else float("nan")
            acc = {t: [r["correct"] for r in rs if r["task"] == t] for t in ("gsm8k", "humaneval")}
            nlls = [r["nll"] for r in rs if not math.isnan(r["nll"])]
            dist = tv.get((temperature, m.verifier)) if m.verifier else None
            decoded = [t for r in rs for t in r.get("tv_decoded", [])]

            def ratio(key):
                return f"{tps / base[key]:.2f}x" if key in base else "-"

            def fmt(x, spec=".2f"):
                return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

            lines.append(
                f"| {temperature:g} | {name} | {tps:.1f} | {ratio('fixed')} | {ratio('hf-generate')} | "
                f"{ratio('hf-assisted')} | {fmt(cand)} | {fmt(match)} | {fmt(rate)} | "
                f"{sum(acc['gsm8k'])}/{len(acc['gsm8k'])} | {sum(acc['humaneval'])}/{len(acc['humaneval'])} | "
                f"{'0 (exact)' if m.verifier in (None, 'chain') else fmt(dist, '.4f')} | "
                f"{fmt(statistics.mean(decoded), '.4f') if decoded else '-'} | "
                f"{fmt(statistics.mean(nlls) if nlls else None, '.3f')} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
