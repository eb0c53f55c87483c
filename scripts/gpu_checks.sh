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

step "the GPU tests (run here for the first time: the compile test's second form, AdamW and Adam members graphed,
the kept state cloned on the device and moved to the host on the writer's thread)"
# -n 0: one test process, so that no test's memory or timing meets another's on the one GPU
timeout "$(left 170)" python3 -m pytest -m gpu -n 0 -q -p no:cacheprovider -p no:warnings -rA 2>&1 \
  | tee "$OUT/pytest-gpu.log" | tail -14

step "the epoch boundary: the loop's wait with the states cloned on the device, against the copy per member"
timeout "$(left 90)" python3 scripts/bench_boundary.py --device cuda --members 20 --narrow 1 --rounds 3 2>&1 | tail -8

step "the paper ensemble at 64 px, bf16 (grouping=auto, which measures streams; 3 epochs)"
timeout "$(left 300)" python3 -m pipeline +ensemble=caltech256_paper pipeline.image_size=64 \
  pipeline.alt_image_size=64 trainer.precision=bf16 dataset.synthetic_classes=30 \
  dataset.synthetic_images_per_class=99 trainer.epochs=3 scheduler.checkpoint_every=10 \
  hydra.run.dir="$OUT/paper" > "$OUT/paper.log" 2>&1; echo "rc $?"
grep -E "measured|packed|fused|streams|epoch" "$OUT/paper.log" | head -30

step "slot groups still unmeasured with streams among the modes (what the budget leaves; a second call for the
rest): 64 px k = 8, 20, then 224 px k = 8"
for args in "--ks 8 20 --image-sizes 64" "--ks 8 --image-sizes 224"; do
  # shellcheck disable=SC2086  # $args is two options, split on purpose
  timeout "$(left 200)" python3 scripts/bench_groups.py --device cuda --arch resnet --depth 18 --width 64 \
    $args --steps 10 --warmup 3 --precision bf16 \
    --modes separate packed+graphs+streams fused+graphs auto --out "$OUT/groups" 2>&1 | tail -12
done
step "done"
