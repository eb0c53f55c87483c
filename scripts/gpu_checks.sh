#!/usr/bin/env bash
# Issue 26's GPU measurements still to be taken, in priority order, each under its own timeout and all
# within BUDGET seconds (default 480), for one call of the device tool. Install first, as
# ../shared/gpu/run.sh says (a copy in .gpu/, wheels in .whl/), then run with carry [".whl", ".gpu"]:
#   bash .gpu/run.sh bash scripts/gpu_checks.sh 480
# Logs, results.json and groups.json files come back under $OUT; docs/benchmarks.md says what each
# step measures and where its figures go.
set -uo pipefail
BUDGET=${1:-480}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
T0=$SECONDS
left() { local l=$((BUDGET - (SECONDS - T0))); ((l > $1)) && echo "$1" || echo "$((l > 5 ? l : 5))"; }
step() { echo; echo "=== $(date +%T) +$((SECONDS - T0))s: $*"; }

step "the GPU tests (the streams and compile tests run here for the first time)"
timeout "$(left 170)" python3 -m pytest -m gpu -q -p no:cacheprovider -p no:warnings -rA 2>&1 \
  | tee "$OUT/pytest-gpu.log" | tail -14

step "slot groups at 64 px, k = 4, 8, 20: packed on CUDA streams against the rest, and what auto picks"
timeout "$(left 220)" python3 scripts/bench_groups.py --device cuda --arch resnet --depth 18 --width 64 \
  --ks 4 8 20 --image-sizes 64 --steps 10 --warmup 3 --precision bf16 \
  --modes separate packed+graphs packed+graphs+streams fused+graphs auto --out "$OUT/groups" 2>&1 | tail -20

step "the default command (grouping=auto measures streams on the GPU)"
timeout "$(left 120)" python3 -m pipeline +ensemble=caltech256 hydra.run.dir="$OUT/default" \
  > "$OUT/default.log" 2>&1; echo "rc $?"
python3 - "$OUT/default/results.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as error:
    sys.exit(f"no results: {error}")
print("wall_s", r["wall_s"], "grouping", r.get("grouping"))
print({m["name"]: round(m["images_per_s"]) for m in r["models"]})
PY

step "the epoch boundary's host copy on the GPU"
timeout "$(left 90)" python3 scripts/bench_boundary.py --device cuda --members 20 --narrow 1 2>&1 | tail -12
step "done"
