// A mixed batch in one launch: prefill (and chunked-prefill append) requests on the tensor cores beside
// single-token decodes streaming their KV, so the memory-bound decodes run while the compute-bound prefills do.
//
// The grid's first prefill_ctas CTAs are the persistent wgmma prefill kernel (prefill_sm90.cuh; they walk its units
// as its own grid would); every later CTA holds SUBS decode CTAs (decode.cuh), one per 128-thread warpgroup, each
// with its own shared memory (DecodeKernel::SMEM_BYTES apart) and named barrier. One CTA of either kind fills an SM
// (shared memory), so the host's split of the SMs between the two (kvattn.mixed) sets how many SMs stream decode
// KV while the others run the prefill tiles. Each part reads its own parameters, exactly as its own launch would:
// the host plans the two parts with their own schedulers and packs their parameter structs side by side.
#pragma once
#include "decode.cuh"
#include "prefill_sm90.cuh"

namespace kvattn {

// Mirrored by kvattn.mixed.MIXED_PARAMS (a test checks size and offsets).
struct MixedParams {
  int prefill_ctas;   // CTAs [0, prefill_ctas) run the prefill
  int decode_ctas;    // decode CTAs (of the decode part's grid, x fastest) in the later CTAs, SUBS per CTA
  int decode_grid_x;  // the decode grid's x extent (chunks * z_split); y: the KV heads
};

// PA / PV: the prefill part's types and variant; DA / DV, M_TILES, STAGES: the decode part's; SUBS decode CTAs
// (warpgroups) per CTA.
template <class PA, class PV, class DA, int M_TILES, int STAGES, class DV, int SUBS>
__global__ void __launch_bounds__(384, 1) mixed_kernel(const __grid_constant__ PrefillParams pp,
                                                       const __grid_constant__ DecodeParams dp,
                                                       const __grid_constant__ MixedParams mp) {
  using Pre = PrefillSm90<PA, PV>;
  using Dec = DecodeKernel<DA, M_TILES, STAGES, DV, true>;
  static_assert(Pre::kPersist, "the prefill part is the persistent wgmma kernel");
  static_assert(SUBS >= 1 && SUBS * Dec::THREADS <= Pre::THREADS, "decode warpgroups per CTA");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  allow_dependent_launch();   // the split-KV merge kernels may launch now and wait for this grid's end on the GPU
  if ((int)blockIdx.x < mp.prefill_ctas) {
    Pre::template run<true>(pp, reinterpret_cast<typename PA::Q*>(smem_raw), mp.prefill_ctas);
    return;
  }
  const int wg = threadIdx.x / Dec::THREADS;
  const int sub = ((int)blockIdx.x - mp.prefill_ctas) * SUBS + wg;
  if (wg >= SUBS || sub >= mp.decode_ctas) return;   // (a whole warpgroup: the others' barriers are their own)
  const int x = sub % mp.decode_grid_x, h = sub / mp.decode_grid_x;
  const int chunk = x / dp.z_split, z = x - chunk * dp.z_split;
  Dec k(dp, h, z);
  k.run(chunk, smem_raw + wg * Dec::SMEM_BYTES);
}

}  // namespace kvattn
