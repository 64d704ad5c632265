#!/usr/bin/env bash
# The default model's draft head against the data it is trained on (issue 27), on this CPU, resumably: one head per
# data size of one recipe (the first N response tokens of the committed corpus's training rounds, data/corpus/
# smollm2-135m, one epoch each, about one step of 4 sequences a second: 0.5M, 1M and 2M first, 1012, 1924 and 3852
# steps, measured 18 min, about 30 min and about 1 h, so that the curve's slope is known before the longest run; then
# every round, the candidate to ship, about 9,000 steps, ~2.5 h), then each head's agreement on held-out Spec-Bench
# questions and the corpus's held-out rounds
# (`verispec eval-draft --json`, into results/head_curve_5m/). Each training first computes the features of the
# rounds it reads where missing (teacher forcing, about 950 tokens a second: the small heads read 19-55 of the 119
# rounds, the last all of them, ~3.2 h from a fresh checkout). Every stage skips what is done and resumes what was
# stopped (features a round at a time, training from its last checkpoint), so run it again after a stop:
#
#   nohup bash scripts/head_curve.sh > runs/head_curve.log 2>&1 &
#
# Progress bars (with an ETA) and each stage's start go to the log. It keeps the machine's two cores busy: never
# beside a benchmark. SIZES overrides the data sizes (response tokens, 0: every training round).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CORPUS=data/corpus/smollm2-135m
ROUNDS=$(find "$CORPUS/text" -name '*.jsonl.gz' | wc -l)
SIZES=${SIZES:-500000 1000000 2000000 0}
OUT=results/head_curve_5m
RECIPE=(--corpus "$CORPUS" --rounds "$ROUNDS" --gen-batch 128 --feature-layers 3,15,27 --depths 3 --epochs 1
        --precision bfloat16 --patience 4 --checkpoint-every 150)
say() { echo "[$(date -u '+%F %T')] $*"; }

mkdir -p "$OUT"
for n in $SIZES; do
    name=$([[ $n == 0 ]] && echo all || echo "$n")
    run=runs/curve5-$name
    if [[ ! -f $run/head.pt ]]; then
        say "training the head on $([[ $n == 0 ]] && echo 'every training round' || echo "$n response tokens")"
        "$PY" -m verispec train-draft "${RECIPE[@]}" --max-tokens "$n" --out "$run"
    fi
    if [[ ! -s $OUT/$name.json ]]; then
        say "measuring $run/head.pt"
        "$PY" -m verispec eval-draft --draft "eagle:$run/head.pt" --per-group 10 --depths 3 --corpus "$CORPUS" \
            --json > "$OUT/$name.json.tmp"
        mv "$OUT/$name.json.tmp" "$OUT/$name.json"
    fi
done
say "done: $OUT"
