#!/usr/bin/env bash
# One device call for a new kernel experiment (under 10 minutes on a bare machine): its GPU tests alone with a
# timeout first (a wrong barrier protocol hangs rather than fails), then its A/B in alternating rounds, then the
# time left on another A/B. Logs under $OUT; the kernel cache unpacked from .kvpack (scripts/pack_cache.sh).
#     bash scripts/gpu_ab_call.sh TEST_FILTER AB_FLAG [MORE_AB_FLAGS...]   e.g. bash scripts/gpu_ab_call.sh running_max --lazymax --lazymax --sustained
# (repository root, on the GPU machine; carry .kvpack). TEST_FILTER: pytest -k of tests/test_prefill_gpu.py.
set -u
OUT=${OUT:-/tmp/kvattn-out}; mkdir -p "$OUT"
export KVATTN_COMPILE_LOG=${KVATTN_COMPILE_LOG:-$OUT/compiles.log}   # cache misses (kvattn/cache.py)
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 KVATTN_CACHE_DIR=${KVATTN_CACHE_DIR:-/tmp/kvc}
T0=$(date +%s)
BUDGET=${BUDGET:-585}   # seconds this script may take (the device call's limit, less a margin)
left() { echo $(( ${1:-$BUDGET} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv,noheader
source scripts/_unpack_cache.sh
timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_prefill_gpu.py -k "$1" > "$OUT/t_ab.log" 2>&1
echo "tests -k '$1': rc $? | $(tail -1 "$OUT/t_ab.log")"; grep -E "^(FAILED|ERROR)" "$OUT/t_ab.log" | head -5
tail -1 "$OUT/t_ab.log" | grep -qE " in [0-9.]+s" || echo "  cut in: $(grep -E '::' "$OUT/t_ab.log" | tail -1)"
ab() {   # LOG SECONDS FLAGS...: one ab_sm90.py call; its progress (stderr) in LOG.err, its last line shown if cut
  local log=$1 secs=$2; shift 2
  timeout "$secs" python3 scripts/ab_sm90.py "$@" > "$OUT/$log.log" 2> "$OUT/$log.err"; local rc=$?
  echo "ab_sm90 $*: rc $rc"; cat "$OUT/$log.log"
  [ $rc -eq 0 ] || tail -6 "$OUT/$log.err"   # (the build it was in when cut, or the traceback)
}
ab ab "$(left $(( BUDGET * 2 / 3 )))" "$2"
if [ -n "${3:-}" ] && [ "$(left)" -gt 60 ]; then   # the rest of the arguments: one more ab_sm90.py call's flags
  ab ab2 "$(left)" "${@:3}"
fi
[ -s "$KVATTN_COMPILE_LOG" ] && echo "compiled here (not in the packed cache): $(wc -l < "$KVATTN_COMPILE_LOG") kernels, \
$(awk '{s += $1} END {print s}' "$KVATTN_COMPILE_LOG") s; slowest: $(sort -rn "$KVATTN_COMPILE_LOG" | head -1)"
echo "elapsed $(( $(date +%s) - T0 )) s"
