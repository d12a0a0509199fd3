#!/usr/bin/env bash
# One device call (under 10 minutes on a bare machine): the block-sparse and mixed GPU tests, then bench_block_sparse.py
# and bench_mixed.py with FlashInfer in the same process (its JIT modules built in the background during the tests).
#     bash scripts/gpu_composable_call.sh   (repository root, on the GPU machine; carry .kvpack and .peers)
set -u
OUT=${OUT:-/tmp/kvattn-out}; mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 KVATTN_CACHE_DIR=${KVATTN_CACHE_DIR:-/tmp/kvc}
T0=$(date +%s)
left() { echo $(( ${1:-585} - ($(date +%s) - T0) )); }
source scripts/_unpack_cache.sh
source scripts/_peers_env.sh
( python3 scripts/bench_block_sparse.py --warm-peers > "$OUT/warm_bs.log" 2>&1; python3 scripts/bench_mixed.py --warm-peers > "$OUT/warm_mixed.log" 2>&1 ) &
warm=$!
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_block_sparse_gpu.py tests/test_mixed_gpu.py > "$OUT/t.log" 2>&1
echo "tests: rc $? | $(tail -1 "$OUT/t.log")"; grep -E "^(FAILED|ERROR)" "$OUT/t.log" | head -5
wait $warm; tail -1 "$OUT/warm_bs.log"; tail -1 "$OUT/warm_mixed.log"; echo "warm done at $(( $(date +%s) - T0 )) s"
timeout "$(left 420)" python3 scripts/bench_block_sparse.py --json "$OUT/bs.jsonl" > "$OUT/bs.log" 2>&1; echo "bs rc $?"; tail -12 "$OUT/bs.log"
timeout "$(left)" python3 scripts/bench_mixed.py > "$OUT/mixed.log" 2>&1; echo "mixed rc $?"; tail -8 "$OUT/mixed.log"
echo "elapsed $(( $(date +%s) - T0 )) s"
