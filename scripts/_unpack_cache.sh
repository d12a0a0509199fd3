# Sourced by scripts/gpu_*.sh: a kernel cache packed on the CPU machine (scripts/pack_cache.sh, carried as .kvpack)
# is unpacked into an empty KVATTN_CACHE_DIR, so a bare GPU machine skips NVRTC for the kernels it holds.
if [ -f .kvpack/kvcache.tar.xz ] && [ -z "$(ls -A "$KVATTN_CACHE_DIR" 2>/dev/null)" ]; then
  mkdir -p "$KVATTN_CACHE_DIR" && tar -C "$KVATTN_CACHE_DIR" -xJf .kvpack/kvcache.tar.xz \
    && echo "kernel cache: $(find "$KVATTN_CACHE_DIR" -type f | wc -l) files unpacked from .kvpack"
fi
