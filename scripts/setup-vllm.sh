#!/usr/bin/env bash
# Sets up .venv/ for the vLLM plugin tests (tests/serving/test_vllm_plugin.py; scripts/test.sh runs it):
# vllm 0.33 with --no-deps, plus only the small packages its model-loader
# modules import, in a venv over the system site-packages. vLLM pins a CUDA
# torch 2.14 and transformers<5.21; installing its dependencies would replace
# the machine's torch and transformers, so none of them is installed here.
# Idempotent: a venv where the loader imports is left alone. Never fails the
# caller: where vLLM cannot be installed or imported it says why and exits 0
# (the tests then skip with the reason).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${PINLOAD_VLLM_VENV:-.venv}
PY=${PYTHON:-python3}
VLLM_VERSION=${PINLOAD_VLLM_VERSION:-0.33.0}
# What `from vllm.model_executor.model_loader import get_model_loader` and
# weight_utils import on vllm 0.33.0, found by importing until nothing was missing.
SMALL=(pyzmq cbor2 aiohttp multidict yarl propcache aiohappyeyeballs aiosignal frozenlist openai_harmony
       openai pybase64 cachetools msgspec uvloop py-cpuinfo prometheus_client xgrammar apache-tvm-ffi
       fastapi starlette opentelemetry-api partial_json_parser llguidance einops)
CHECK='from vllm.model_executor.model_loader import register_model_loader, get_model_loader
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator'

STAMP=$VENV/.pinload-vllm-$VLLM_VERSION  # written once the loader imported (importing vLLM takes 10-60 s)
if [[ -f $STAMP && -x $VENV/bin/python ]]; then
  echo "setup-vllm: $VENV has vLLM $VLLM_VERSION's loader"
  exit 0
fi
if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1; then
  touch "$STAMP"; echo "setup-vllm: $VENV already imports vLLM's loader"; exit 0
fi
[[ -x $VENV/bin/python ]] || "$PY" -m venv --system-site-packages --without-pip "$VENV" || {
  echo "setup-vllm: cannot create $VENV; vLLM tests will skip"; exit 0; }
pip_install() { "$VENV/bin/python" -m pip install -q --no-deps "$@"; }
pip_install "vllm==$VLLM_VERSION" || { echo "setup-vllm: vllm==$VLLM_VERSION not installable; vLLM tests will skip"; exit 0; }
pip_install "${SMALL[@]}" || echo "setup-vllm: some of vLLM's small imports did not install"
if "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1; then
  echo "setup-vllm: vLLM $VLLM_VERSION's loader imports in $VENV"
  touch "$STAMP"
else
  echo "setup-vllm: vLLM's loader does not import in $VENV; vLLM tests will skip:"
  "$VENV/bin/python" -c "$CHECK" 2>&1 | tail -3
fi
exit 0
