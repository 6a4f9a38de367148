#!/usr/bin/env bash
# TEMPORARY (tuning; deleted once the winners are kept): times every variant of the rmsnorm,
# softmax and cross_entropy CUDA kernels and runs their CUDA tests with each variant forced.
#   scripts/tune_gpu.sh BUILD_DIR [SETTING ...]     (default settings: 0 1 2 3 4 5 6 7, then 0 again)
# Setting i sets every MESHFUSE_VARIANT_* to i (an op without variant i runs its variant 0).
# Prints per setting the bench fractions of copy bandwidth, the test verdict, then one table
# (rows: op and direction; columns: settings). Logs go to $OUT (or /tmp/tune-gpu).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: scripts/tune_gpu.sh BUILD_DIR [SETTING ...]}
shift
settings=("$@")
((${#settings[@]})) || settings=(0 1 2 3 4 5 6 7 0)
out=${OUT:-/tmp/tune-gpu}
mkdir -p "$out"
cli=$build/apps/meshfuse/meshfuse
tests=$build/tests/meshfuse_tests
filter='*CudaRmsNorm*:*CudaSoftmax*:*CudaCrossEntropy*:*CudaFusedLinearCrossEntropy*'
vars=(RMSNORM_FWD RMSNORM_BWD SOFTMAX_FWD SOFTMAX_BWD CE_FWD CE_BWD)

cat <<'EOF'
variants (setting i = variant i of every op; an op without variant i runs variant 0):
 rmsnorm fwd (rmsnorm + fused): 0 original (1 block/row, 256 thr x 2 vec, 64-reg cap)
   1 warp/row 16 vec/lane, 4 rows/block | 2 64 thr/row 8 vec, 2 rows/block
   3 128 thr/row 4 vec, 1 row/block     | 4 256 thr/row 2 vec, launch bounds 256
   5 warp/row 16 vec/lane, 8 rows/block
 rmsnorm bwd: 0 original (512 thr, 1 vec, register prefetch 1 row, 256 blocks)
   1 256 thr x 2 vec, register prefetch 1 row, 512 blocks
   2 cp.async ring 3 rows, 512 thr x 1 vec | 3 ring 4 rows, 512 x 1
   4 ring 3 rows, 256 thr x 2 vec         | 5 ring 4 rows, 256 x 2   (2-5: 256 blocks)
   (all: 1 barrier per row except 0; dweight reduce: 32 lanes, 8 loads in flight)
 softmax fwd: 0 resident smem 64 KB parts (cluster 4), 512 thr | 1 resident 32 KB (cluster 8)
   2 resident 32 KB, 256 thr | 3 resident 96 KB (cluster 3)
   4 streamed, cluster 4 (2nd read from L2) | 5 streamed, cluster 8 | 6 streamed, 1 block/row
   7 registers: 512 thr x 4 vec in registers, cluster 8 at V = 128256, one exp per value
 softmax bwd: 0 resident 64 KB parts (cluster 8) | 1 resident 96 KB (cluster 6)
   2 resident 64 KB, 256 thr | 3 streamed cluster 4 | 4 streamed cluster 8 | 5 streamed 1 block/row
   6 registers: y and dy of 512 thr x 4 vec in registers, cluster 8 at V = 128256
 cross_entropy fwd / bwd: 0 original (check kernel, host wait, then the row kernel)
   1 queued check (no host round trip between kernels), 1 block/row
   2 / 3 / 4: queued check, 2 / 4 / 8 blocks per row (fwd: a cluster; bwd: independent blocks)
EOF

rm -f "$out/.tested"
run=0
for s in "${settings[@]}"; do
  run=$((run + 1))
  tag="$run-s$s"
  for v in "${vars[@]}"; do export "MESHFUSE_VARIANT_$v=$s"; done
  echo "== setting $s (run $run) =="
  start=$(date +%s)
  "$cli" bench --device cuda --model "$root/configs/models/llama-3.1-8b.json" --tokens 16384 \
    --dtype bf16 --ops rmsnorm,fused_residual_add_rmsnorm,softmax,cross_entropy --format csv \
    --repeats 30 > "$out/bench-$tag.csv" 2> "$out/bench-$tag.log" \
    || echo "bench exited with $? (see $out/bench-$tag.log)"
  mid=$(date +%s)
  # The tests once per setting (the repeated setting 0 only times).
  if ! grep -qx "$s" "$out/.tested" 2>/dev/null; then
    echo "$s" >> "$out/.tested"
    if "$tests" --gtest_filter="$filter" --gtest_brief=1 > "$out/tests-s$s.log" 2>&1; then
      echo "tests: pass: $(grep -m1 -E '\[  PASSED  \]' "$out/tests-s$s.log")" \
        "$(grep -m1 -E '\[  SKIPPED \]' "$out/tests-s$s.log")"
    else
      echo "tests: FAIL"
      grep -E '^\[  FAILED  \]|Failure|error' "$out/tests-s$s.log" | head -n 20
    fi
  fi
  echo "(bench $((mid - start)) s, tests $(($(date +%s) - mid)) s)"
  python3 - "$out/bench-$tag.csv" <<'EOF'
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    f = float(r["fraction_of_peak"] or 0)
    print(f"  {r['op']:28} {r['direction']:8} {float(r['median_ms']):8.4f} ms  {100 * f:5.1f}%  {r['status']}")
EOF
done
rm -f "$out/.tested"

echo "== fraction of copy bandwidth (%), rows x settings (columns in run order) =="
python3 - "$out" "${settings[@]}" <<'EOF'
import csv, sys
out, settings = sys.argv[1], sys.argv[2:]
table, order = {}, []
for run, s in enumerate(settings, 1):
    try:
        rows = list(csv.DictReader(open(f"{out}/bench-{run}-s{s}.csv")))
    except OSError:
        rows = []
    for r in rows:
        key = (r["op"], r["direction"])
        if key not in table:
            table[key] = {}
            order.append(key)
        mark = "" if r["status"].lower().startswith("pass") else "!"
        table[key][run] = f"{100 * float(r['fraction_of_peak'] or 0):.1f}{mark}"
print(f"{'op':28} {'dir':8} " + " ".join(f"{'s' + s:>6}" for s in settings))
for key in order:
    print(f"{key[0]:28} {key[1]:8} " +
          " ".join(f"{table[key].get(run, '-'):>6}" for run in range(1, len(settings) + 1)))
print("('!' = the bench's reference check failed)")
EOF
