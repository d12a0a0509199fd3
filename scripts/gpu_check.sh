#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, the main job, benchmarks, the transformers example; logs under $OUT,
# a short table last.   bash scripts/gpu_check.sh [pytest args...]      (run from the repository root)
set -u
OUT=${OUT:-/tmp/kvattn-out}; mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export KVATTN_CACHE_DIR=${KVATTN_CACHE_DIR:-.kvcache}
bash scripts/gpu_tests.sh "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -20   # (parallel groups: t_*.log)
python3 -m kvattn 2>&1 | tee "$OUT/main.log" | tail -12
python3 scripts/example_transformers.py 2>&1 | tee "$OUT/example.log" | tail -6
python3 scripts/example_variant.py 2>&1 | tee "$OUT/example_variant.log" | tail -6
python3 scripts/example_composable.py 2>&1 | tee "$OUT/example_composable.log" | tail -4
python3 scripts/bench_launch.py 2>&1 | tee "$OUT/launch.log" | tail -6
python3 scripts/bench_merge.py 2>&1 | tee "$OUT/merge.log" | tail -5
python3 scripts/bench_decode.py ${BENCH_ARGS:-} --json "$OUT/decode.jsonl" 2>&1 | tee "$OUT/decode.log" | tail -25
python3 scripts/bench_prefill.py 2>&1 | tee "$OUT/prefill.log" | tail -12
python3 scripts/bench_variants.py 2>&1 | tee "$OUT/variants.log" | tail -8
python3 scripts/bench_deterministic.py 2>&1 | tee "$OUT/deterministic.log" | tail -11
if [ -n "${AB_OLD:-}" ]; then   # AB_OLD=<an older tree with kvattn/ and cuda_src/>: the A/B against it
  python3 scripts/bench_ab.py --old "$AB_OLD" 2>&1 | tee "$OUT/ab.log" | tail -13
fi
python3 scripts/bench_append.py 2>&1 | tee "$OUT/append.log" | tail -4
python3 scripts/bench_cascade.py 2>&1 | tee "$OUT/cascade.log" | tail -5
python3 scripts/bench_block_sparse.py 2>&1 | tee "$OUT/block_sparse.log" | tail -6
python3 scripts/bench_mixed.py 2>&1 | tee "$OUT/mixed.log" | tail -3
python3 scripts/bench_interop.py ${INTEROP_ARGS:-} --json "$OUT/interop.jsonl" 2>&1 | tee "$OUT/interop.log" | tail -40
