#!/bin/sh
# pinload-bench through every phase that needs no GPU, on a
# 24 MiB checkpoint: a crash, an error exit or a missing result fails.
#   tests/bench_smoke.sh PINLOAD_BENCH
set -eu
bench=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir/model.safetensors" <<'PY'
import sys
import numpy as np
from safetensors.numpy import save_file
rng = np.random.default_rng(0)
save_file({f"layers.{i}.weight": rng.integers(0, 1 << 16, 4 << 20, dtype=np.uint16) for i in range(3)}, sys.argv[1])
PY
"$bench" --repeat 1 --phases memcpy,buffered,cold,warm,verify,pool --pool-settle 0 --memcpy-bytes 8M \
  --json "$dir/out.json" "$dir/model.safetensors"
python3 - "$dir/out.json" <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))["results"]
assert "pool_reserve" in results, f"pinload-bench results lack pool_reserve: {sorted(results)}"
assert len(results["verify"]["verified"]["runs"]) == 1, f"pinload-bench's verify phase: {results.get('verify')}"
PY
