#!/usr/bin/env bash
# Add the optional llama.cpp extra to ./.venv: llama-cpp-python built for the instruction sets this CPU runs, then a
# self-test (scripts/llama_build.py says how). Options go to that script, e.g. --without AVX512_BF16, --rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh
exec .venv/bin/python scripts/llama_build.py install "$@"
