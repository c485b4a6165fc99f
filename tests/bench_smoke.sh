#!/bin/sh
# pinload-bench through every phase that needs no GPU, on a
# 24 MiB checkpoint: a crash, an error exit or a missing result fails.
#   tests/bench_smoke.sh PINLOAD_BENCH
set -eu
bench=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir/model.safetensors" <<'PY'
import json, os, struct, sys
tensors, offset = {}, 0
for i in range(3):
    n = 8 << 20
    tensors[f"layers.{i}.weight"] = {"dtype": "BF16", "shape": [n // 2], "data_offsets": [offset, offset + n]}
    offset += n
header = json.dumps(tensors).encode()
header += b" " * (-(8 + len(header)) % 4096)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + os.urandom(offset))
PY
"$bench" --repeat 1 --phases memcpy,buffered,cold,warm,pool --pool-settle 0 --memcpy-bytes 8M \
  --json "$dir/out.json" "$dir/model.safetensors"
python3 - "$dir/out.json" <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))["results"]
missing = [k for k in ("pool_reserve",) if k not in results]
assert not missing, f"pinload-bench results lack {missing}: {sorted(results)}"
PY
