#!/usr/bin/env bash
# The GPU check: on a bare GPU machine (CUDA toolkit, cmake, ninja, Python with
# torch; no network, no apt), build pinload with what is there, run the device
# and copy-engine suites on cuda:0 (they skip on machines without a GPU), the
# bandwidth measurements (CudaMeasure) and a torch reference, and write logs
# and JSON to OUTDIR. Bounded: about 8 minutes in all (GPU_CHECK_BUDGET_S).
#
# Usage: scripts/gpu-check.sh OUTDIR
#
# Dependencies: the CMake packages nlohmann_json, spdlog, OpenSSL and GTest
# (Google Benchmark optional) must be findable. Where $PWD/.deps/usr exists
# (scripts/fetch-gpu-deps.sh fills it on the dev machine; carry it along), it
# goes on CMAKE_PREFIX_PATH and LD_LIBRARY_PATH. Missing packages are named.
#
# OUTDIR receives at most 10 files:
#   results.json           the summary: steps, dependencies, test counts,
#                          measurements (CudaMeasure), the torch reference and
#                          pinload-bench's device ratios and targets
#   gpu-check.log          this script's progress and the machine's description
#   build.log              dependency probe, configure, build
#   tests.log              the test binaries' output (and ctest's, pytest's, the
#                          torch reference's)
#   gtest.json             the GoogleTest JSON reports of the CUDA suites
#   bench_device.json      pinload-bench --device cuda:0 on a generated 4.9 GB
#                          checkpoint (CLIP-L, VAE, a T5-XXL shard): the pinned
#                          cudaMemcpy limit, the copy engine alone, warm and cold
#                          loads to the GPU next to host-only loads, and the host
#                          cold/warm targets against fio (if present) and memcpy
#   bench.log              its progress (and fp8-bench --device cuda:0's table: FP8 -> bf16
#                          device loads against bf16 loads and a pinned copy; its JSON is
#                          results.json's fp8_device; and bench/fresh_bench.py --device cuda:0,
#                          a fresh process's device load beside the peers': results.json's
#                          fresh_device; and the CLI's device loads of cached files, copied
#                          from their mappings and, with --zero-copy off, staged)
#   pipeline_to.json, pipeline_device_map.json  bench/pipeline_bench.py's small SDXL pipeline on
#                          cuda:0, stock diffusers and pinload's hooks, .to("cuda") and device_map="cuda"
#   run_all.quick.json     bench/run_all.py --quick on cuda:0 (pinload and the peers on the
#                          small checkpoints), when at least 90 s of the budget are left
#
# Exit status: 0 all passed and the CUDA tests ran; 1 a build step or a test
# failed; 2 dependencies missing; 3 everything passed but no CUDA device was
# usable (the CUDA tests skipped).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD

OUT=${1:?usage: scripts/gpu-check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUILD=${BUILD_DIR:-build-gpu}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
MEASURE_MIB=${PINLOAD_MEASURE_MIB:-1024}
JOBS=$(nproc)
START=$(date +%s)
ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
PY_LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH
: >"$OUT/gpu-check.log"
: >"$OUT/build.log"
: >"$OUT/tests.log"

log() { echo "[gpu-check +$(($(date +%s) - START))s] $*" | tee -a "$OUT/gpu-check.log"; }
remaining() { echo $((BUDGET - ($(date +%s) - START))); }
declare -A RC=()
# run_step NAME LIMIT LOGFILE CMD...: runs CMD under a timeout no longer than
# what is left of the budget; records its exit status (124: timed out).
run_step() {
  local name=$1 limit=$2 logfile=$3
  shift 3
  local left
  left=$(remaining)
  if ((left < 15)); then
    log "$name: skipped, budget spent"
    RC[$name]=skipped
    return 1
  fi
  ((limit > left)) && limit=$left
  log "$name (limit ${limit}s)"
  echo "== $name: $*" >>"$logfile"
  timeout --kill-after=10 "$limit" "$@" >>"$logfile" 2>&1
  local rc=$?
  RC[$name]=$rc
  log "$name: exit $rc$( ((rc == 124)) && echo ' (timed out)')"
  return $rc
}

# ---- the machine
{
  echo "== machine"
  uname -a
  echo "cores: $JOBS"
  free -g 2>/dev/null | head -2
  timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  echo "nvcc: $( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -1)"
  echo "cmake: $(cmake --version 2>/dev/null | head -1)"
  echo "ninja: $(ninja --version 2>/dev/null || echo none)"
  echo "python3: $(python3 --version 2>&1)"
} >>"$OUT/gpu-check.log" 2>&1

# ---- dependencies
if [[ -d .deps/usr ]]; then
  export CMAKE_PREFIX_PATH="$ROOT/.deps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$ROOT/.deps/usr/lib/x86_64-linux-gnu:$ROOT/.deps/usr/lib:$ROOT/.deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "using .deps/usr ($(wc -l <.deps/MANIFEST 2>/dev/null || echo '?') packages)"
  # Python processes load torch too: the machine's libraries first, .deps/ only for what it lacks
  # (pinload's module finds libcurl's own libraries, libssh2 and the rest, only there).
  PY_LD_LIBRARY_PATH="${ORIG_LD_LIBRARY_PATH:+$ORIG_LD_LIBRARY_PATH:}$ROOT/.deps/usr/lib/x86_64-linux-gnu:$ROOT/.deps/lib/x86_64-linux-gnu"
else
  log "no .deps/ folder: relying on the machine's own CMake packages"
fi
if [[ -z $(command -v nvcc) && -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)

PROBE=$(mktemp -d)
trap 'rm -rf "$PROBE"' EXIT
cat >"$PROBE/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(pinload_probe LANGUAGES C CXX)
foreach(pkg nlohmann_json spdlog GTest benchmark CUDAToolkit CLI11 CURL hwy)
  find_package(${pkg} QUIET)
  message(STATUS "probe: ${pkg}=${${pkg}_FOUND}")
endforeach()
find_package(OpenSSL QUIET COMPONENTS Crypto)
message(STATUS "probe: OpenSSL=${OpenSSL_FOUND}")
EOF
run_step probe 60 "$OUT/build.log" cmake -S "$PROBE" -B "$PROBE/build" "${GENERATOR[@]}"
found() { grep -q "probe: $1=\(1\|TRUE\|ON\|YES\)$" "$OUT/build.log"; }
MISSING=()
for pkg in nlohmann_json spdlog OpenSSL GTest CLI11 CURL hwy; do found "$pkg" || MISSING+=("$pkg"); done
found CUDAToolkit || MISSING+=(CUDAToolkit)
BENCH=OFF
found benchmark && BENCH=ON
DEPS_JSON=$(for pkg in nlohmann_json spdlog OpenSSL GTest benchmark CUDAToolkit CLI11 CURL hwy; do
  found "$pkg" && printf '"%s": true, ' "$pkg" || printf '"%s": false, ' "$pkg"
done)

write_results() {
  local status=$1
  python3 - "$OUT" "$status" "$MEASURE_MIB" "{${DEPS_JSON%, }}" "$(declare -p RC)" <<'EOF' || echo '{"status": "'"$status"'"}' >"$OUT/results.json"
import json, os, re, sys
out, status, mib, deps, rc_decl = sys.argv[1:6]
steps = dict(re.findall(r'\[([^\]]+)\]="?([^" ]*)"?', rc_decl))
res = {"status": status, "steps": steps, "dependencies": json.loads(deps), "measure_mib": int(mib)}
with open(os.path.join(out, "gpu-check.log")) as f:
    res["machine"] = [l.rstrip() for l in f if not l.startswith("[gpu-check")][:12]
suites = {}
reports = {}
if os.path.exists(os.path.join(out, "gtest.json")):
    with open(os.path.join(out, "gtest.json")) as f:
        reports = json.load(f)
for name, report in reports.items():
    s = {"tests": 0, "failures": 0, "skipped": [], "failed": []}
    for suite in report.get("testsuites", []):
        for t in suite.get("testsuite", []):
            full = suite["name"] + "." + t["name"]
            s["tests"] += 1
            if t.get("failures"):
                s["failures"] += 1
                s["failed"].append(full)
            if t.get("result") == "SKIPPED":
                s["skipped"].append(full)
            if suite["name"] == "CudaMeasure":
                known = {"name", "file", "line", "status", "result", "timestamp", "time", "classname", "failures"}
                res.setdefault("measurements", {}).update({k: v for k, v in t.items() if k not in known})
    suites[name] = s
res["suites"] = suites
for line in open(os.path.join(out, "tests.log"), errors="replace"):
    if line.startswith("torch_reference: "):
        res["torch_reference"] = json.loads(line[len("torch_reference: "):])
fp8 = os.environ.get("FP8_JSON", "")
if fp8 and os.path.exists(fp8) and os.path.getsize(fp8) > 0:
    with open(fp8) as f:
        res["fp8_device"] = json.load(f)  # fp8-bench --device cuda:0: FP8 -> bf16 loads, bf16 loads, pinned copy
fresh = os.environ.get("FRESH_JSON")
if fresh and os.path.exists(fresh) and os.path.getsize(fresh) > 0:
    with open(fresh) as f:
        res["fresh_device"] = {k: v for k, v in json.load(f).items() if k in ("summary", "limits", "files", "device")}
bench = os.path.join(out, "bench_device.json")
if os.path.exists(bench):
    with open(bench) as f:
        b = json.load(f)
    res["bench_device"] = {k: b.get(k) for k in ("ratios", "targets")}
    res["bench_device"]["pinned_copy_gbps"] = b.get("results", {}).get("device", {}).get("pinned_copy_gbps")
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(res, f, indent=1, sort_keys=True)
print(json.dumps({k: res.get(k) for k in ("status", "steps", "measurements", "torch_reference", "bench_device")},
                 indent=1))
EOF
}

if ((${#MISSING[@]})); then
  log "MISSING CMake packages: ${MISSING[*]}"
  log "  on the dev machine run scripts/fetch-gpu-deps.sh and carry .deps/ with the tree"
  write_results missing_deps | tee -a "$OUT/gpu-check.log"
  exit 2
fi
log "dependencies found (benchmark: $BENCH)"

# ---- build
FAILED=0
# pybind11 from pip keeps its CMake package inside the Python package.
PYBIND11_ARGS=()
PYBIND11_DIR=$(python3 -m pybind11 --cmakedir 2>/dev/null) && PYBIND11_ARGS=(-Dpybind11_DIR="$PYBIND11_DIR")
run_step configure 120 "$OUT/build.log" cmake -S . -B "$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPINLOAD_WITH_CUDA=ON -DPINLOAD_WITH_PYTHON=AUTO -DPINLOAD_BUILD_BENCH="$BENCH" "${PYBIND11_ARGS[@]}" || FAILED=1
if ((FAILED == 0)); then
  run_step build_device_tests 300 "$OUT/build.log" cmake --build "$BUILD" -j "$JOBS" --target device_test copy_engine_test device_loader_test \
    $(grep -q '^build torch_adapter_test\|torch_adapter_test:' "$BUILD/build.ninja" "$BUILD/Makefile" 2>/dev/null && echo torch_adapter_test) ||
    FAILED=1
fi
if ((FAILED)); then
  log "build failed: see build.log"
  tail -30 "$OUT/build.log"
  write_results build_failed | tee -a "$OUT/gpu-check.log"
  exit 1
fi

# ---- the CUDA suites and the measurements
TESTS_FAILED=0
export PINLOAD_MEASURE_MIB=$MEASURE_MIB
GTEST_DIR=$(mktemp -d)
for t in device_test copy_engine_test device_loader_test torch_adapter_test; do
  [[ -x $BUILD/tests/$t ]] || continue
  if ! run_step "$t" 150 "$OUT/tests.log" "$BUILD/tests/$t" --gtest_output="json:$GTEST_DIR/$t.json"; then
    TESTS_FAILED=1
    # Where a test crashed, the stack of the crash (cuda-gdb runs programs without GPU code too).
    if command -v cuda-gdb >/dev/null && [[ ${RC[$t]} =~ ^[0-9]+$ ]] && ((RC[$t] > 128 && RC[$t] != 137)); then
      run_step "${t}_backtrace" 90 "$OUT/tests.log" cuda-gdb -batch -ex run -ex bt -ex 'info sharedlibrary' \
        --args "$BUILD/tests/$t"
    fi
  fi
done
python3 - "$GTEST_DIR" "$OUT/gtest.json" <<'EOF'
import glob, json, os, sys
merged = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    with open(path) as f:
        merged[os.path.basename(path)[:-5]] = json.load(f)
with open(sys.argv[2], "w") as f:
    json.dump(merged, f, indent=1)
EOF
rm -rf "$GTEST_DIR"
grep -E '^measure: ' "$OUT/tests.log" | tee -a "$OUT/gpu-check.log"

# ---- the torch reference: the same copy, through torch's pinned memory
run_step torch_reference 90 "$OUT/tests.log" env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" \
  python3 - "$MEASURE_MIB" <<'EOF'
import json, sys, time
res = {}
try:
    import torch
    res["torch"] = torch.__version__
    res["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        n = int(sys.argv[1]) << 20
        res["device"] = torch.cuda.get_device_name(0)
        t = time.perf_counter()
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        res["torch_pinned_alloc_s"] = time.perf_counter() - t
        host.fill_(1)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        def best(src, reps=5):
            dev[: src.numel()].copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            b = 1e30
            for _ in range(reps):
                t = time.perf_counter()
                dev[: src.numel()].copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                b = min(b, time.perf_counter() - t)
            return src.numel() / 1e9 / b
        res["torch_h2d_pinned_gbps"] = best(host)
        pageable = torch.ones(min(n, 256 << 20), dtype=torch.uint8)
        res["torch_h2d_pageable_gbps"] = best(pageable, 3)
except Exception as e:  # report, never crash the check
    res["error"] = repr(e)
print("torch_reference: " + json.dumps(res))
EOF

# ---- FP8 on the GPU: the conversion kernel against torch, bit for bit (test_fp8.py's cuda:0
# cases), then fp8-bench --device cuda:0: an FP8 -> bf16 device load (half the bytes over the
# link, converted by the kernel on a conversion stream while the next copies run) against the bf16 load, next to one pinned
# copy of the bf16 bytes. Its JSON goes into results.json as fp8_device.
export FP8_JSON=$(mktemp)
if (($(remaining) > 200)) && run_step build_fp8 150 "$OUT/build.log" cmake --build "$BUILD" -j "$JOBS" \
    --target convert_test pinload_fp8_bench pinload_python; then
  run_step convert_test 60 "$OUT/tests.log" "$BUILD/tests/convert_test" || TESTS_FAILED=1
  run_step fp8_exactness 90 "$OUT/tests.log" env PYTHONPATH="$BUILD/python:$ROOT/python" \
    python3 -m pytest -q -rs "$ROOT/tests/python/test_fp8.py" -k "cuda or load_fp8 or fp32_as_16bit" || TESTS_FAILED=1
  run_step fp8_bench_device 120 "$OUT/bench.log" "$BUILD/bench/fp8-bench" --device cuda:0 --size-mib 2048 \
    --rounds 3 --dir "${PINLOAD_MODELS:-/tmp/pinload-models}/fp8-bench" --json "$FP8_JSON"
fi

# ---- pinload-bench's device phase on a generated checkpoint (CLIP-L, VAE and a
# T5-XXL shard: 4.9 GB of real FLUX component shapes), with the physical limits
MODELS=${PINLOAD_MODELS:-/tmp/pinload-models}
if (($(remaining) > 200)) && run_step build_bench 120 "$OUT/build.log" cmake --build "$BUILD" -j "$JOBS" --target pinload_bench; then
  if run_step gen_checkpoint 90 "$OUT/bench.log" env PINLOAD_MODELS="$MODELS" \
      python3 scripts/gen_checkpoints.py --only clip-l,vae,t5-xxl --shards 2; then
    M=$MODELS/flux-dev
    run_step bench_device 150 "$OUT/bench.log" "$BUILD/bench/pinload-bench" --device cuda:0 --repeat 3 \
      --phases memcpy,fio,buffered,cold,warm,device --memcpy-bytes 1G --json "$OUT/bench_device.json" \
      "$M/text_encoder" "$M/vae" "$M/text_encoder_2/model-00002-of-00002.safetensors"
  fi
fi

# ---- a device load from the node store (docs/store.md): the daemon holds the checkpoint; a CLI
# load to cuda:0 copies from its shared pages (no staging copy), registered with the device or
# pageable. Compare their GB/s in store.log with bench_device's pinned cudaMemcpy (target: >= 0.9 x).
if (($(remaining) > 120)) && [[ -x "$BUILD/pinload" && -d "${M:-}" ]]; then
  STORE_DIR=$(mktemp -d)
  echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null || true
  "$BUILD/pinload" store serve --socket "$STORE_DIR/s.sock" --budget 8G --ready-file "$STORE_DIR/ready" \
    2>>"$OUT/store.log" &
  STORE_PID=$!
  for _ in $(seq 100); do [[ -f "$STORE_DIR/ready" ]] && break; sleep 0.1; done
  run_step store_warm 60 "$OUT/store.log" "$BUILD/pinload" store warm --socket "$STORE_DIR/s.sock" "$M/text_encoder" "$M/vae"
  # Registered (the default: Note [Store device loads]) and pageable, alternating.
  for i in 1 2 3; do
    run_step "store_device_registered_$i" 60 "$OUT/store.log" "$BUILD/pinload" load --store "$STORE_DIR/s.sock" \
      --store-required --device cuda:0 -v "$M/text_encoder" "$M/vae" || TESTS_FAILED=1
    run_step "store_device_pageable_$i" 60 "$OUT/store.log" env PINLOAD_STORE_REGISTER=0 "$BUILD/pinload" load \
      --store "$STORE_DIR/s.sock" --store-required --device cuda:0 -v "$M/text_encoder" "$M/vae" || TESTS_FAILED=1
  done
  "$BUILD/pinload" store status --socket "$STORE_DIR/s.sock" >>"$OUT/store.log" 2>&1 || true
  kill "$STORE_PID" 2>/dev/null; wait "$STORE_PID" 2>/dev/null || true
  rm -rf "$STORE_DIR"
else
  log "store_device: skipped ($(remaining)s left or no checkpoint)"
fi

# ---- copies from memory the process maps (Note [Copies from mapped memory] in src/load/device_mapped.h):
# a device load of files in the page cache copies from their mappings, registered with the device chunk
# by chunk (no staging copy); --zero-copy off reads them into pinned staging first, as before. Each a
# fresh CLI process (streaming mode), alternating; their GB/s in bench.log, beside bench_device's pinned
# cudaMemcpy (target >= 0.9 x) and CudaMeasure.RegistrationCost's h2d_mapped_* in results.json.
if (($(remaining) > 100)) && [[ -x "$BUILD/pinload" && -d "${M:-}" ]]; then
  cat "$M/text_encoder"/*.safetensors "$M/vae"/*.safetensors >/dev/null 2>&1 || true  # in the page cache
  for i in 1 2; do
    run_step "mapped_device_$i" 40 "$OUT/bench.log" env PINLOAD_LOG_LEVEL=debug "$BUILD/pinload" load --device cuda:0 -v \
      "$M/text_encoder" "$M/vae" || TESTS_FAILED=1
    run_step "staged_device_$i" 40 "$OUT/bench.log" "$BUILD/pinload" load --device cuda:0 -v --zero-copy off \
      "$M/text_encoder" "$M/vae" || TESTS_FAILED=1
  done
  # The comparison means something only if the mapped route ran (its debug line), not a silent fallback.
  if ! grep -q "copied to cuda:0 from its mapping" "$OUT/bench.log"; then
    log "mapped_device: the mapped route did not run (see bench.log for the fallback's reason)"
    TESTS_FAILED=1
  fi
else
  log "mapped_device: skipped ($(remaining)s left or no checkpoint)"
fi

# ---- a fresh process's device load (issue 16): bench/fresh_bench.py's set at scale 0.05 (0.39 GB),
# every system in a fresh worker per load to cuda:0, cold and warm, one round; pinload's default
# streams through pinned staging (Note [Device loads from Python]), so pinning only the staging is
# its fresh-memory cost. Its JSON goes into results.json as fresh_device.
export FRESH_JSON=$(mktemp)
if (($(remaining) > 240)) && ls "$BUILD"/python/pinload/_core*.so >/dev/null 2>&1; then
  run_step fresh_device 150 "$OUT/bench.log" env LD_LIBRARY_PATH="$PY_LD_LIBRARY_PATH" \
    python3 bench/fresh_bench.py --device cuda:0 --scale 0.05 --workloads set --rounds 1 --no-st09 \
    --pool-settle 0 --fio-runtime 5 --build "$BUILD" \
    --dir "$MODELS/fresh-bench-0.05" --out "$FRESH_JSON"
else
  log "fresh_device: skipped ($(remaining)s left or no Python module)"
fi

# ---- pipelines end to end on cuda:0 (issue 47): bench/pipeline_bench.py's scaled-down SDXL pipeline built
# by stock diffusers and through pinload's hooks, cold and restart, moved with .to("cuda") and built
# with device_map="cuda"; its JSON comes back as $OUT/pipeline_cuda.json and pipeline_device_map.json
if (($(remaining) > 240)) && ls "$BUILD"/python/pinload/_core*.so >/dev/null 2>&1 && python3 -c 'import diffusers' 2>/dev/null; then
  for placement in to device_map; do
    flag=(); [[ $placement == device_map ]] && flag=(--device-map)
    run_step "pipeline_$placement" 110 "$OUT/bench.log" env PYTHONPATH="$BUILD/python:$ROOT/python" \
      LD_LIBRARY_PATH="$PY_LD_LIBRARY_PATH" PINLOAD_MODELS="$MODELS" \
      python3 bench/pipeline_bench.py --scale small --rounds 1 --workloads sdxl --systems stock,pinload \
      --device cuda "${flag[@]}" --build "$BUILD" --fio-runtime 3 --out "$OUT/pipeline_$placement.json" || true
  done
else
  log "pipelines on cuda: skipped ($(remaining)s left, no Python module or no diffusers)"
fi

# ---- the vLLM plugin on cuda:0 (tests/serving/gpu_vllm_check.py): pinload's iterator against
# vLLM's default one, and a tiny Llama through --load-format pinload; skipped where vLLM is missing
if ls "$BUILD"/python/pinload/_core*.so >/dev/null 2>&1 && python3 -c 'import vllm' >/dev/null 2>&1; then
  run_step vllm_check 120 "$OUT/tests.log" env PYTHONPATH="$BUILD/python:$ROOT/python" \
    python3 "$ROOT/tests/serving/gpu_vllm_check.py" || TESTS_FAILED=1
else
  log "vllm_check: skipped (vLLM not importable or no Python module)"
fi

# ---- the rest of the unit suites, if time allows (not part of the verdict's CUDA half)
if (($(remaining) > 150)); then
  if run_step build_all 150 "$OUT/build.log" cmake --build "$BUILD" -j "$JOBS"; then
    run_step ctest_unit 120 "$OUT/tests.log" ctest --test-dir "$BUILD" -L unit -j "$JOBS" --output-on-failure ||
      TESTS_FAILED=1
    # The Python package's torch tests on cuda (built when pybind11 is there).
    if ls "$BUILD"/python/pinload/_core*.so >/dev/null 2>&1; then
      run_step python_tests 150 "$OUT/tests.log" env PYTHONPATH="$BUILD/python:$ROOT/python" \
        python3 -m pytest -q -rs "$ROOT/tests/python" || TESTS_FAILED=1
    fi
  elif [[ ${RC[build_all]} == 124 ]]; then
    log "the other unit suites did not build in time: not run (not a failure)"
  else
    TESTS_FAILED=1
  fi
else
  log "skipping the other unit suites: $(remaining)s left"
fi

# ---- LoRA switching on cuda:0 (issue 35): bench/lora_bench.py, pinload.lora's switch against diffusers'
# load_lora_weights + fuse_lora + unfuse_lora on the same UNet (SDXL's layer shapes, 2 of the 10
# transformer layers of the last level, to fit the budget), rank 32 and 128; its JSON comes back as
# $OUT/lora_bench.json (not part of the verdict)
if (($(remaining) > 200)) && ls "$BUILD"/python/pinload/_core*.so >/dev/null 2>&1; then
  run_step lora_bench 180 "$OUT/bench.log" env PYTHONPATH="$BUILD/python:$ROOT/python" LD_LIBRARY_PATH="$PY_LD_LIBRARY_PATH" \
    python3 bench/lora_bench.py --device cuda:0 --switches 10 --peer-switches 3 \
    --config "transformer_layers_per_block=[1,2,2]" --dir "$MODELS/lora-bench" --json "$OUT/lora_bench.json" || true
else
  log "lora_bench: skipped ($(remaining)s left or no Python module)"
fi

# ---- the benchmark driver's quick mode on cuda:0, with what is left of the budget
# (its figures are not part of the verdict; peers that are not installed are skipped
# with the reason in the JSON, and nothing is downloaded: --no-setup, then the small
# checkpoints are generated locally where they are missing)
if (($(remaining) > 90)) && ls "$BUILD"/python/pinload/_core*.so >/dev/null 2>&1; then
  PINLOAD_MODELS="$MODELS" python3 scripts/gen_checkpoints.py --scale small >>"$OUT/bench.log" 2>&1 ||
    PINLOAD_MODELS="$MODELS" python3 scripts/gen_checkpoints.py --scale small --only flux >>"$OUT/bench.log" 2>&1 || true
  run_step bench_quick $(($(remaining) - 20)) "$OUT/bench.log" env PINLOAD_MODELS="$MODELS" LD_LIBRARY_PATH="$PY_LD_LIBRARY_PATH" \
    python3 bench/run_all.py --quick --no-setup --device cuda:0 --scenarios limits,cold,warm,switch \
    --bin "$BUILD/bench/pinload-bench" --build "$BUILD" --out "$OUT/run_all.quick.json" || true
else
  log "bench_quick: skipped ($(remaining)s left or no Python module)"
fi

# ---- verdict
CUDA_RAN=1
if grep -q 'no CUDA device' "$OUT/tests.log"; then
  CUDA_RAN=0
  log "the CUDA tests SKIPPED: $(grep -m1 -o 'no CUDA device.*' "$OUT/tests.log")"
fi
if ((TESTS_FAILED)); then
  STATUS=tests_failed
  CODE=1
elif ((CUDA_RAN == 0)); then
  STATUS=no_cuda_device
  CODE=3
else
  STATUS=passed
  CODE=0
fi
log "status: $STATUS (total $(($(date +%s) - START))s)"
write_results "$STATUS" | tee -a "$OUT/gpu-check.log"
exit $CODE
