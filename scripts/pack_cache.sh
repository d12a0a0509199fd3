#!/usr/bin/env bash
# Fill a kernel cache on the CPU machine and pack it for the device tool (a bare GPU machine otherwise compiles every
# kernel its tests use: run 44a's decode test file alone ran past 480 s). The cache (1138 kernels on 2026-12-07: run
# 50a's 44 misses, the NARROW and loads-first builds added) exceeds the tool's 64 MiB carry; xz packs it to ~25 MB. 7-16 minutes on the CPU machine.
#     PYTHON=.venv/bin/python bash scripts/pack_cache.sh   (repository root; then carry .kvpack: scripts/gpu_*.sh
#                                                           unpack it into an empty KVATTN_CACHE_DIR)
set -euo pipefail
export KVATTN_CACHE_DIR=${KVATTN_CACHE_DIR:-$PWD/.kvcache}
mkdir -p .kvpack
# only the current kernels' entries (the folder keeps those of earlier sources: session 43's first repack doubled
# to 62 MB, near the carry limit)
${PYTHON:-python3} scripts/fill_cache.py --entries .kvpack/entries.txt
tar -C "$KVATTN_CACHE_DIR" -cf - -T .kvpack/entries.txt | xz -T0 -6 > .kvpack/kvcache.tar.xz.part
mv .kvpack/kvcache.tar.xz.part .kvpack/kvcache.tar.xz
echo "packed $(wc -l < .kvpack/entries.txt) files into $(du -h .kvpack/kvcache.tar.xz | cut -f1)"
