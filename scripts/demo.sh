#!/usr/bin/env bash
# Quick start: install and build only what the demo runs (scripts/setup.sh --demo: the library,
# the `pinload` program and the Python module; no tests, benches or vLLM), generate the default
# checkpoints once (scaled-down FLUX and SDXL pipelines with real tensor names and shapes and
# weight-like values), then show what pinload is for (scripts/demo.py): cold loads beside
# safetensors' on the same files, warm loads, and a switch back to a model through
# pinload.ModelCache. Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --demo
MODELS=${PINLOAD_MODELS:-$HOME/.cache/pinload/models}
python3 scripts/gen_checkpoints.py --scale small --out "$MODELS" >/dev/null
echo "== pinload inspect $MODELS/flux-dev-small (summary)"
build/pinload inspect "$MODELS/flux-dev-small" | grep -E '^(/|total)'
echo "== scripts/demo.py: FLUX and SDXL, cold, warm, and a switch back"
PYTHONPATH="build/python:python${PYTHONPATH:+:$PYTHONPATH}" \
  python3 scripts/demo.py "$MODELS/flux-dev-small" "$MODELS/sdxl-base-small"
