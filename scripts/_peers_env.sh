# Sourced by scripts/gpu_*.sh: FlashInfer's wheel from .peers/ (../shared/peers/README.md) installed and its JIT build
# settings exported; peers=1 if it is there, else peers= and the scripts leave FlashInfer's columns out.
if ls .peers/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fi FLASHINFER_CUDA_ARCH_LIST=9.0a \
         TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=12
  peers=1
else
  echo "no .peers/: FlashInfer not measured"; peers=
fi
