"""Ship a trained draft head with the package: copy RUN/head.pt to verispec/heads/<target>.pt and write
verispec/heads/<target>.json with how it was made (command, training log summary, sizes) and its
acceptance on a fixed prompt, which the test suite checks again after loading the shipped file.

    python scripts/ship_head.py runs/eagle-smollm2-135m --command "verispec train-draft ..."
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verispec import CausalLM  # noqa: E402
from verispec.eagle import FIXED_PROMPT, FIXED_TOKENS, HEADS_DIR, EagleHead, fixed_prompt_acceptance  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="folder of a finished 'verispec train-draft' run")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--command", required=True, help="the exact command that produced the run")
    args = ap.parse_args()
    run = Path(args.run)
    target = CausalLM.load(args.target)
    dest = HEADS_DIR / f"{args.target}.pt"
    HEADS_DIR.mkdir(exist_ok=True)
    shutil.copyfile(run / "head.pt", dest)
    head = EagleHead.load(dest, target)
    log = [json.loads(line) for line in (run / "log.jsonl").open()]
    log = log[max(i for i, r in enumerate(log) if r["step"] == 1):]  # the last training from scratch in this folder
    last_val = [r for r in log if "val_ce" in r][-1]
    elapsed, prev = 0.0, 0.0  # the log's clock restarts at each resumed segment
    for r in log:
        if r["elapsed_s"] < prev:
            elapsed += prev
        prev = r["elapsed_s"]
    elapsed += prev
    n_head = sum(p.numel() for p in head.head_state().values())
    n_target = sum(p.numel() for p in target.hf.parameters())
    info = {
        "command": args.command,
        "shipped_with": f"python scripts/ship_head.py {args.run} --command '...'",
        "target": args.target,
        "file_bytes": dest.stat().st_size,
        "head_parameters": n_head,
        "target_parameters": n_target,
        "draft_vocabulary": head.shape()["draft_vocab"],
        "extra_numel": head.extra_numel(),
        "extra_memory_fraction": head.extra_numel() / n_target,
        "training": {"steps": log[-1]["step"], "elapsed_s": elapsed,
                     "sequences": head.meta.get("sequences"), "final_train": {k: log[-1][k] for k in ("ce", "feat", "top1")},
                     "validation": head.meta.get("validation"), "last_checkpoint_validation":
                         {k[4:]: v for k, v in last_val.items() if k.startswith("val_")}},
        "fixed_prompt": {"prompt": FIXED_PROMPT, "max_new_tokens": FIXED_TOKENS, "tree": "chain:5", "temperature": 0,
                         "mean_accepted_length": fixed_prompt_acceptance(target, head)},
    }
    tune = ROOT / "results" / "tune_eagle.json"  # verispec tune-tree --draft eagle ... --out results/tune_eagle.json
    if tune.exists():
        info["default_tree"] = json.loads(tune.read_text())["best"]["tree"]
        info["default_tree_from"] = "results/tune_eagle.json"
    (HEADS_DIR / f"{args.target}.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
