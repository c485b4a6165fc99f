#!/usr/bin/env bash
# Quick start: set up, build, generate the default checkpoint (a scaled-down
# FLUX-style pipeline with real tensor names and shapes, random bytes) once,
# then inspect it and load it with pinload.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
MODELS=${PINLOAD_MODELS:-$HOME/.cache/pinload/models}
python3 scripts/gen_checkpoints.py --scale small --out "$MODELS"
MODEL="$MODELS/flux-dev-small"
echo "== pinload inspect $MODEL (summary)"
build/pinload inspect "$MODEL" | grep -E '^(/|total)'
echo "== pinload load -v $MODEL"
build/pinload load -v "$MODEL"
