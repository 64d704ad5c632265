"""Ship a trained draft head with the package: copy RUN/head.pt to verispec/heads/<target>.pt and write
verispec/heads/<target>.json, its sidecar: how it was made (the exact command, corpus size, training time), how
often it agrees with the target per drafted depth (``verispec eval-draft``), its acceptance on a fixed prompt (which
the test suite checks again after loading the shipped file), and the tree and step costs ``verispec tune-tree``
measured for it (what ``--tree auto`` and the ``auto`` policy use).

    python scripts/ship_head.py runs/eagle3 --command "verispec train-draft ..." --tune results/tune_eagle.json \\
        --agreement results/agreement_eagle.json
    python scripts/ship_head.py --retune results/tune_eagle.json   # the shipped head's tree and step costs only
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verispec import load  # noqa: E402
from verispec.bench.agreement import FIXED_PROMPT, FIXED_TOKENS, fixed_prompt_acceptance  # noqa: E402
from verispec.eagle import HEADS_DIR, EagleHead  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", nargs="?", help="folder of a finished 'verispec train-draft' run")
    ap.add_argument("--target", default="smollm2-135m", help="the target alias the head ships for")
    ap.add_argument("--command", help="the exact command that produced the run")
    ap.add_argument("--tune", default=None, help="the JSON report of 'verispec tune-tree' for this head")
    ap.add_argument("--agreement", default=None, help="the JSON report of 'verispec eval-draft --json' for this head")
    ap.add_argument("--retune", default=None, metavar="TUNE",
                    help="only replace the shipped head's tree and step costs by those of this 'verispec tune-tree' "
                         "report (when the target's forward got faster or slower; the head file is unchanged)")
    args = ap.parse_args()
    if args.retune:
        sidecar = HEADS_DIR / f"{args.target}.json"
        info = json.loads(sidecar.read_text())
        tune = json.loads(Path(args.retune).read_text())
        info.update(default_tree=default_tree(tune), step_costs=tune["step_costs"], default_tree_from=args.retune)
        sidecar.write_text(json.dumps(info, indent=1) + "\n")
        print(f"{sidecar}: default tree {info['default_tree']}, step costs {info['step_costs']}")
        return
    if not args.run or not args.command:
        ap.error("a run folder and --command are needed (or --retune TUNE alone)")
    run = Path(args.run)
    target = load(args.target)
    dest = HEADS_DIR / f"{args.target}.pt"
    HEADS_DIR.mkdir(exist_ok=True)
    shutil.copyfile(run / "head.pt", dest)
    head = EagleHead.load(dest, target)
    log = [json.loads(line) for line in (run / "log.jsonl").open()]
    log = log[max(i for i, r in enumerate(log) if r["step"] == 1):]  # the last training from scratch in this folder
    elapsed, prev = 0.0, 0.0  # the log's clock restarts at each resumed segment
    for r in log:
        if r["elapsed_s"] < prev:
            elapsed += prev
        prev = r["elapsed_s"]
    elapsed += prev
    n_head = sum(p.numel() for p in head.head_state().values())
    n_target = sum(p.numel() for p in target.hf.parameters())
    meta = head.meta
    info = {
        "command": args.command,
        "shipped_with": "python scripts/ship_head.py " + " ".join(sys.argv[1:2]) + " --command '...'",
        "target": args.target,
        "file_bytes": dest.stat().st_size,
        "head_parameters": n_head,
        "target_parameters": n_target,
        "feature_layers": list(head.feature_layers),
        "draft_vocabulary": head.shape()["draft_vocab"],
        "extra_numel": head.extra_numel(),
        "extra_memory_fraction": head.extra_numel() / n_target,
        "training": {"steps": log[-1]["step"], "training_s": elapsed, "pipeline_s": meta.get("session_s"),
                     "sequences": meta.get("sequences"), "corpus_tokens": meta.get("corpus_tokens"),
                     "config": meta.get("config"), "validation": meta.get("validation")},
        "fixed_prompt": {"prompt": FIXED_PROMPT, "max_new_tokens": FIXED_TOKENS, "tree": "chain:5", "temperature": 0,
                         "mean_accepted_length": fixed_prompt_acceptance(target, head)},
    }
    if args.agreement:
        info["agreement"] = json.loads(Path(args.agreement).read_text())
        info["agreement_from"] = args.agreement
    if args.tune:
        tune = json.loads(Path(args.tune).read_text())
        info["default_tree"] = default_tree(tune)
        info["step_costs"] = tune["step_costs"]
        info["default_tree_from"] = args.tune
    (HEADS_DIR / f"{args.target}.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "agreement"}, indent=1))


def default_tree(tune: dict) -> str:
    """The tree ``--tree auto`` drafts: the best chain of a ``tune-tree`` report (the methods that draft the tuned tree,
    ``default`` and ``auto-gate``, verify a chain), or its best tree where the report predates ``best_chain``."""
    return tune.get("best_chain", tune["best"])["tree"]


if __name__ == "__main__":
    main()
