#!/usr/bin/env bash
# The GPU test files in parallel pytest processes sharing one kernel cache (a bare machine compiles every kernel
# on first use: one process took over 330 s for the first ~60 tests; 8 processes ran the whole suite in 399 s on a
# bare H200, run 43a; the decode file in three groups since runs 44a and 50a). Logs under $OUT/t_<group>.log;
# exit status non-zero when any group failed.
#     bash scripts/gpu_tests.sh [pytest args...]        (run from the repository root; LIMIT=seconds per group;
#                                                       ONLY="decode2 prefill2": only those groups)
set -u
OUT=${OUT:-/tmp/kvattn-out}; mkdir -p "$OUT"
export KVATTN_COMPILE_LOG=${KVATTN_COMPILE_LOG:-$OUT/compiles.log}   # cache misses (kvattn/cache.py)
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export KVATTN_CACHE_DIR=${KVATTN_CACHE_DIR:-.kvcache}
LIMIT=${LIMIT:-1800}
source scripts/_unpack_cache.sh
PF="reference or every_query or fused or narrow"   # (prefill2 ran 362 s of its 430 in run 51b)
DF="ab_builds or head_dim_256 or large_groups or wg_split"   # the decode tests that build their own variants
declare -A SETS=(
  [decode1]="tests/test_decode_gpu.py -k '$DF'"
  [decode2]="tests/test_decode_gpu.py -k 'not ($DF or decode_matches_reference)'"
  [decode3]="tests/test_decode_gpu.py -k 'decode_matches_reference'"   # (178 s of float64 reference alone, run 50a)
  [prefill1]="tests/test_prefill_gpu.py -k '$PF'"
  [prefill2]="tests/test_prefill_gpu.py -k 'not ($PF)'"
  [variants]="tests/test_variants_gpu.py"
  [composable]="tests/test_cascade_gpu.py tests/test_block_sparse_gpu.py tests/test_mixed_gpu.py"
  [fp8_page]="tests/test_fp8_gpu.py tests/test_page_gpu.py"
  [runtime]="tests/test_interop_gpu.py tests/test_gpu_runtime.py tests/test_device.py tests/test_cp_gpu.py"
)
ONLY=${ONLY:-${!SETS[*]}}
pids=()
for g in $ONLY; do
  # -v: a group cut by LIMIT still names the test it was in (run 49a cut two groups mid-test); durations: where
  # the time of the groups that finish went
  eval "timeout $LIMIT python3 -m pytest -v --durations=12 -p no:cacheprovider ${SETS[$g]} \"\$@\"" > "$OUT/t_$g.log" 2>&1 &
  pids+=("$!:$g")
done
rc=0
for pg in "${pids[@]}"; do
  wait "${pg%%:*}" || { rc=1; echo "FAILED group ${pg#*:}"; }
done
for g in $ONLY; do
  echo "== $g: $(tail -1 "$OUT/t_$g.log")"
  tail -1 "$OUT/t_$g.log" | grep -qE " in [0-9.]+s" || echo "   cut in: $(grep -E '::' "$OUT/t_$g.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/t_$g.log" | head -5
done
[ -s "$KVATTN_COMPILE_LOG" ] && echo "compiled here (not in the packed cache): $(wc -l < "$KVATTN_COMPILE_LOG") kernels, \
$(awk '{s += $1} END {print s}' "$KVATTN_COMPILE_LOG") s; slowest: $(sort -rn "$KVATTN_COMPILE_LOG" | head -1)"
exit $rc
