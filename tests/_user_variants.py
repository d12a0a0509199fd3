"""Two user variants written only through the public API (kvattn.Variant.from_cuda), for the tests."""
import os
import sys

import kvattn

# Logits at half the scale: the same as sm_scale / 2 (a logits hook).
HALF_LOGITS = kvattn.Variant.from_cuda("HalfLogits", """
struct HalfLogits : kvattn::VariantBase {
  static constexpr bool kLogits = true;
  template <class P> __device__ __forceinline__ static float logits(const P&, float x) { return 0.5f * x; }
};
""")

# Attend to even kv positions only (a keep hook; every tile takes the masked path).
EVEN_KEYS = kvattn.Variant.from_cuda("EvenKeys", """
struct EvenKeys : kvattn::VariantBase {
  static constexpr bool kKeep = true;
  template <class P> __device__ __forceinline__ static bool keep(const P&, int j, int) { return (j & 1) == 0; }
};
""")


# Sigmoid attention and a per-head logits scale (user variants with declared parameters): the ones
# scripts/example_variant.py shows, so the tests check the example's own code.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from example_variant import HEAD_SCALE, SIGMOID, sigmoid_reference  # noqa: E402,F401
