#!/usr/bin/env bash
# Quick start: install and build only what the demo runs (scripts/setup.sh --demo: the library,
# the `pinload` program and the Python module; no tests, benches or vLLM), generate the default
# models once (scaled-down FLUX and SDXL pipelines with real tensor names and shapes and
# weight-like values), then show what pinload is for (scripts/demo.py): a diffusers pipeline's
# cold start, restart and switch back, stock beside pinload (demo.py generates the full-size SDXL
# where the disk and memory have room). Idempotent: a second run installs nothing and rebuilds
# only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --demo
MODELS=${PINLOAD_MODELS:-$HOME/.cache/pinload/models}
python3 scripts/gen_checkpoints.py --scale small --out "$MODELS" >/dev/null
echo "== pinload inspect $MODELS/flux-dev-small (summary)"
build/pinload inspect "$MODELS/flux-dev-small" | grep -E '^(/|total)'
echo "== scripts/demo.py: an SDXL pipeline's cold start, restart and a switch back, diffusers beside pinload"
PYTHONPATH="build/python:python${PYTHONPATH:+:$PYTHONPATH}" python3 scripts/demo.py --models "$MODELS"
