#!/usr/bin/env bash
# One device call: the open issues' figures with FlashInfer in the same process, in the order STEPS names them, each
# bench under the time the call has left (BUDGET seconds from the start, default 560); a step that no longer fits
# is named and skipped. FlashInfer builds its JIT modules inside the first bench that needs each one (a machine
# that ran gpu_interop_call.sh already has the D128 decode / prefill modules).
#     STEPS="prefill decode_shapes" bash scripts/gpu_figures_call.sh   (repository root, on the GPU machine; carry
#                                                                       .kvpack and .peers; logs under $OUT)
# Steps: prefill (issue 13's anchors, fa2 / fa3 / cuDNN), prefill_extra (non-causal, head dims 64 / 256), decode_shapes
# (issue 12's shapes; FlashInfer beside all but GQA 16 / 32: its decode plan segfaults on
# both, run 52c), variants (issue 10: RoPE, ALiBi, sinks
# against plain decode), fp8, block_sparse, cascade (with the EMPTY_SLOTS_AT_PLAN A/B), mixed, sustained (prefill
# under the power cap).
set -u
OUT=${OUT:-/tmp/kvattn-out}; mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export KVATTN_CACHE_DIR=${KVATTN_CACHE_DIR:-/tmp/kvc}
T0=$(date +%s); BUDGET=${BUDGET:-560}
source scripts/_unpack_cache.sh
source scripts/_peers_env.sh
declare -A CMD=(
  [prefill]="scripts/bench_prefill.py --peers fa2,fa3"
  [prefill_extra]="scripts/bench_prefill.py --extra --peers fa3"
  [decode_shapes]="scripts/bench_decode.py --extra --only D64,D256,GQA32,GQA16,page1 --peers-on D64,D256,page1 --tune --tunings default"
  [variants]="scripts/bench_variants.py --decode"
  [fp8]="scripts/bench_fp8.py"
  [block_sparse]="scripts/bench_block_sparse.py"
  [cascade]="scripts/bench_cascade.py --empty-at-plan"
  [mixed]="scripts/bench_mixed.py"
  [sustained]="scripts/bench_sustained.py"
)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee "$OUT/commit.txt"
for step in ${STEPS:-prefill decode_shapes variants}; do
  [ -n "${CMD[$step]:-}" ] || { echo "unknown step $step (steps: ${!CMD[*]})"; continue; }
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 30 ]; then echo "== $step: not run ($left s left)"; continue; fi
  timeout "$left" python3 ${CMD[$step]} > "$OUT/$step.log" 2>&1
  rc=$?
  echo "== $step: rc $rc$([ $rc = 124 ] && echo ' (cut by the budget)'), $(( $(date +%s) - T0 )) s in"
  tail -14 "$OUT/$step.log"
done
