#!/usr/bin/env bash
# One device call (under 10 minutes on a bare machine): the framework path with FlashInfer in the same process.
# FlashInfer's JIT modules build in the background (.peers/ holds its wheel: ../shared/peers/README.md) while the
# main job and the transformers example run; then the host probe and bench_interop.py. Logs and JSON under $OUT.
#     bash scripts/gpu_interop_call.sh            (repository root, on the GPU machine; carry .peers)
set -u
OUT=${OUT:-/tmp/kvattn-out}; mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export KVATTN_CACHE_DIR=${KVATTN_CACHE_DIR:-/tmp/kvc}
source scripts/_unpack_cache.sh
source scripts/_peers_env.sh
warm=
if [ -n "$peers" ]; then python3 scripts/bench_interop.py --warm-peers > "$OUT/warm_peers.log" 2>&1 & warm=$!; fi
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee "$OUT/commit.txt"
timeout 150 python3 -m kvattn > "$OUT/main.log" 2>&1; echo "python -m kvattn: rc $? | $(tail -1 "$OUT/main.log")"
timeout 150 python3 scripts/example_transformers.py > "$OUT/example.log" 2>&1
echo "example_transformers: rc $? | $(tail -1 "$OUT/example.log")"
[ -n "$warm" ] && { wait "$warm"; tail -2 "$OUT/warm_peers.log"; }
# (after FlashInfer's JIT build: run 51a's probe ran beside its compilers and read decode's run() at 14.3 us where
# bench_interop's host table, alone, read 8.7)
timeout 60 python3 scripts/probe_host.py > "$OUT/probe_host.log" 2>&1; tail -14 "$OUT/probe_host.log"
timeout 300 python3 scripts/bench_interop.py --json "$OUT/interop.jsonl" > "$OUT/interop.log" 2>&1
echo "bench_interop: rc $?"; tail -30 "$OUT/interop.log"
