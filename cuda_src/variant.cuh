// Attention variants as hook structs. A kernel takes one variant type V and calls its hooks at fixed points of
// its mainloop; VariantBase's hooks are the identity (scores untouched, every pair kept), so a variant that does
// not override a hook costs nothing (the calls inline away). NVRTC-safe: no host headers.
//
// Hooks (P: the kernel's parameter struct: DecodeParams or PrefillParams; MergeParams for output()):
//   V::logits(p, x)                  x: a score in the log2 domain (q.k * p.score_scale) -> the transformed score
//   V::row_init(p, head, req)        (kPositional) a per-row constant, computed once per query row (e.g. a slope);
//                                    req: the row's request
//   V::logits_at(p, x, j, diag, rc)  (kPositional) a position-dependent transform of the score of kv index j for
//                                    the row whose diagonal is diag; rc: that row's row_init
//   V::keep(p, j, diag)              whether the variant keeps kv index j for the query row whose diagonal
//                                    (bottom-right aligned causal limit) is diag; called when kKeep, and ANDed
//                                    with the kernel's own tests (ok = ok && V::keep(...))
//   V::tile_may_mask(p, t0, diag_hi) whether a kv tile starting at t0 may hold a pair keep() rejects for rows
//                                    whose diagonals are at most diag_hi (prefill's unmasked fast path)
//   V::prob(p, x)                    (!kSoftmax) the weight of a kept score x (log2 domain) instead of softmax's
//                                    exp(x - max): the kernel accumulates o = sum_j w_j v_j and l = sum_j w_j and
//                                    writes the state (o / l, lse = log l), so split-KV merges stay exact; masked
//                                    pairs weigh 0, and a row whose weights sum to 0 is empty (o = 0, lse = -inf)
//   V::qk<D>(p, st, lo, hi, pos, req, key)
//                                    (kQK) transforms a query (key = false) or key (key = true) row before the
//                                    dot product, 16 dims at a time: lo = dims [d0, d0 + 8), hi = dims
//                                    [d0 + D/2, d0 + D/2 + 8) (the pairs of NeoX RoPE); pos: the row's position
//                                    (a key: its kv index j; a query: its diagonal kv - qo + r), req: its request;
//                                    st = V::qk_init<D>(p, d0), a V::QKState computed once per thread (a thread
//                                    always transforms the same 16 dims)
//   V::output(p, head, lse)          (kOutput) runs once per finished output row (after every split of the row is
//                                    merged: in the attention kernel, or in the merge kernel, where p is a
//                                    MergeParams): returns the factor the row's normalised o is multiplied by and
//                                    may change lse (natural log, -inf for an empty row) in place. It may read
//                                    p.variant_data only (the one field every parameter struct has).
// Parameters: p.variant_data points at the plan's float32 variant data; user variants read their declared
// parameters through param_f32 / param_i32 / param_ptr (kvattn.Variant generates named accessors).
// Mask modes the kernels implement themselves, switched on by traits (the mask data or bounds are plan
// parameters, and in-kernel code keeps their machine code exactly as tuned): kWindow (sliding window:
// j >= diag - p.window_left when p.window_left >= 0) and kCustomMask (the plan's bit-packed mask; every tile takes
// the masked path). Causal is a run-time flag of the prefill kernel.
// Traits: kLogits (logits is not the identity), kPositional (row_init / logits_at are used), kKeep (keep can
//   reject), kWindow, kCustomMask, kSoftmax (false: prob() weights), kOutput (output() is not the identity),
//   kQK (qk() is not the identity; the kernels rotate their shared-memory tiles in place);
//   VariantTraits: kMasks (kKeep || kWindow || kCustomMask), kAny.
#pragma once
#include "mma.cuh"

namespace kvattn {

struct VariantBase {
  static constexpr bool kLogits = false;
  static constexpr bool kPositional = false;
  static constexpr bool kKeep = false;
  static constexpr bool kWindow = false;
  static constexpr bool kCustomMask = false;
  static constexpr bool kSoftmax = true;
  static constexpr bool kOutput = false;
  static constexpr bool kQK = false;
  static constexpr int kRope = 0;   // built-in RoPE (1 NeoX, 2 GPT-J): key tiles rotate by rope_key_run
  template <class P> __device__ __forceinline__ static float logits(const P&, float x) { return x; }
  struct QKState {};
  template <int D, class P> __device__ __forceinline__ static QKState qk_init(const P&, int /*d0*/) { return {}; }
  template <int D, class P>
  __device__ __forceinline__ static void qk(const P&, const QKState&, float (&)[8], float (&)[8], int, int, bool) {}
  template <class P> __device__ __forceinline__ static float row_init(const P&, int /*head*/, int /*req*/) {
    return 0.f;
  }
  template <class P>
  __device__ __forceinline__ static float logits_at(const P&, float x, int /*j*/, int /*diag*/, float /*rc*/) {
    return x;
  }
  template <class P> __device__ __forceinline__ static bool keep(const P&, int, int) { return true; }
  // A variant with a keep() hook sends every tile down the masked path unless it says which tiles are safe.
  template <class P> __device__ __forceinline__ static bool tile_may_mask(const P&, int, int) { return true; }
  template <class P> __device__ __forceinline__ static float prob(const P&, float x) { return fast_exp2(x); }
  template <class P> __device__ __forceinline__ static float output(const P&, int /*head*/, float& /*lse*/) {
    return 1.f;
  }
};

// A user variant's declared parameters: entry i of the plan's variant data is scalar i itself, or (an array)
// the float32-word offset of its data from p.variant_data.
template <class P> __device__ __forceinline__ float param_f32(const P& p, int i) { return __ldg(p.variant_data + i); }
template <class P> __device__ __forceinline__ int param_i32(const P& p, int i) {
  return __float_as_int(__ldg(p.variant_data + i));
}
template <class T, class P> __device__ __forceinline__ const T* param_ptr(const P& p, int i) {
  return reinterpret_cast<const T*>(p.variant_data + param_i32(p, i));
}

// Rotary embedding of 16 dims (lo: [d0, d0 + 8), hi: the same dims + D/2) of a row at position pos: angle_i =
// pos * rcp_scale * theta^(-2 i / D) (log2_theta = log2(theta)), as kvattn.reference.apply_rope. NeoX: pair
// (i, i + D/2); INTERLEAVE (GPT-J): pairs (2i, 2i + 1) inside lo and inside hi. The angle is reduced to
// [-pi, pi] by a two-constant 2 pi before the fast sine / cosine (their error is ~4e-7 there).
__device__ __forceinline__ void rope_sincos(float angle, float& s, float& c) {
  const float k = rintf(angle * 0.15915494309189535f);
  float r = fmaf(-k, 6.28318548202514648f, angle);
  r = fmaf(k, 1.7484555314695172e-7f, r);   // 2 pi = 6.28318548202514648 - 1.748e-7
  __sincosf(r, &s, &c);
}

// The inverse frequency theta^(-2 i / D) of pair i.
template <int D> __device__ __forceinline__ float rope_freq(int i, float log2_theta) {
  return exp2f(-(float)i * (2.f / D) * log2_theta);
}

// The inverse frequencies of the 8 pairs the dims [d0, d0 + 8) and [d0 + D/2, +8) hold.
template <bool INTERLEAVE, int D>
__device__ __forceinline__ void rope_inv_freq(float (&inv)[8], int d0, float log2_theta) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    // NeoX: pair d0 + e; interleaved: pairs (d0 + 2e') / 2 of lo (e < 4), then of hi
    inv[e] = rope_freq<D>(INTERLEAVE ? (d0 + (e < 4 ? 0 : D / 2) + 2 * (e & 3)) / 2 : d0 + e, log2_theta);
  }
}

template <bool INTERLEAVE>
__device__ __forceinline__ void rope_rotate(float (&lo)[8], float (&hi)[8], const float (&inv)[8], float pos) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float sn, cs;
    rope_sincos(pos * inv[e], sn, cs);
    float& a = INTERLEAVE ? (e < 4 ? lo[2 * e] : hi[2 * (e - 4)]) : lo[e];
    float& b = INTERLEAVE ? (e < 4 ? lo[2 * e + 1] : hi[2 * (e - 4) + 1]) : hi[e];
    const float x = a, y = b;
    a = x * cs - y * sn;
    b = y * cs + x * sn;
  }
}

// Decode's key rotation (rope_key_run), compile switches for the A/B of scripts/ab_rope_decode.py (run 28a,
// BENCHMARKS.md): KVATTN_ROPE_F32 1 rotates in float32 (unpacked, rotated, rounded once: the kernel before), 0 in
// T's packed two-element arithmetic (the sines and cosines rounded to T, u = x c - round(y s) rounded once more, as
// Hugging Face's bf16 RoPE rounds: 0.883 of plain against 0.841 at b64_L4096); KVATTN_ROPE_BATCH: the rows a lane
// loads before rotating them (8: 0.883, 4: 0.855); KVATTN_ROPE_CHEB 1: the next row's angle by Chebyshev's
// recurrence (2 FMA a pair, not 4; at 4 rows 0.873 against 0.855, but with 8 rows it spills at 168 registers).
#ifndef KVATTN_ROPE_F32
#define KVATTN_ROPE_F32 0
#endif
#ifndef KVATTN_ROPE_BATCH
#define KVATTN_ROPE_BATCH 8
#endif
#ifndef KVATTN_ROPE_CHEB
#define KVATTN_ROPE_CHEB 0
#endif

template <typename T> struct Packed2;   // T's two-element vector
template <> struct Packed2<half> { using type = half2; };
template <> struct Packed2<__nv_bfloat16> { using type = __nv_bfloat162; };

// Words xw, yw (two elements each: pairs (x_k, y_k), k = 0, 1) rotated by the words cw = (cos_0, cos_1), sw =
// (sin_0, sin_1): x <- x cos - y sin, y <- y cos + x sin, in T's packed arithmetic (4 instructions for 2 pairs).
template <typename T>
__device__ __forceinline__ void rotate_packed(unsigned& xw, unsigned& yw, unsigned cw, unsigned sw) {
  using P2 = typename Packed2<T>::type;
  const P2 x = *reinterpret_cast<const P2*>(&xw), y = *reinterpret_cast<const P2*>(&yw);
  const P2 c = *reinterpret_cast<const P2*>(&cw), s = *reinterpret_cast<const P2*>(&sw);
  const P2 u = __hfma2(x, c, __hneg2(__hmul2(y, s)));
  const P2 v = __hfma2(y, c, __hmul2(x, s));
  xw = *reinterpret_cast<const unsigned*>(&u);
  yw = *reinterpret_cast<const unsigned*>(&v);
}

// Word w = (x, y), one pair, rotated by the words cc = (cos, cos), ns = (-sin, sin): (x cos - y sin, y cos + x sin).
template <typename T> __device__ __forceinline__ unsigned rotate_pair_packed(unsigned w, unsigned cc, unsigned ns) {
  using P2 = typename Packed2<T>::type;
  const P2 x = *reinterpret_cast<const P2*>(&w);
  const P2 r = __hfma2(x, *reinterpret_cast<const P2*>(&cc),
                       __hmul2(__lowhigh2highlow(x), *reinterpret_cast<const P2*>(&ns)));
  return *reinterpret_cast<const unsigned*>(&r);
}

template <typename T> __device__ __forceinline__ float2 unpack2(unsigned w);
template <> __device__ __forceinline__ float2 unpack2<half>(unsigned w) {
  return __half22float2(*reinterpret_cast<const half2*>(&w));
}
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(unsigned w) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}

// RoPE of the key rows [r0, r0 + N) of a [rows][D] tile (swizzle: swz<D>) at positions pos0 + r, by one warp:
// each lane takes 4 pairs (NeoX: dims 4q..4q+3 and their + D/2 partners; GPT-J: the 8 dims of chunk q) of the
// rows r0 + lane / (D / 8) + k * RP. Only its first row's angles take sine / cosine; each next row's come from
// the previous by one rotation through the step angle RP * rcp_scale * freq (8 sine / cosine per lane and tile
// instead of 32), and the rows are unrolled so that their shared-memory loads issue together (that, more than
// the sines, is what made it faster: BENCHMARKS.md). The angles stay within the per-row path's (rope_rotate) own
// fp32 error. rd: RoPE's variant data (log2 theta, 1 / scale, the per-request offsets); inv8: the calling thread's
// RopeState::inv (the inverse frequencies of its query-transform pairs).
template <bool INTERLEAVE, int D, int N, typename T>
__device__ __forceinline__ void rope_key_run(T* tile, int r0, int lane, const float* rd, int pos0, int req,
                                             const float (&inv8)[8]) {
  constexpr int LPR = D / 8;       // lanes per row
  static_assert(32 % LPR == 0, "whole key rows per warp: D 64, 128 or 256");
  constexpr int RP = 32 / LPR;     // rows in flight per warp
  static_assert(N % RP == 0, "whole row sets");
  // (packed) the lane's 4 pairs are half (h) of the 8 whose inverse frequencies its QKState holds (inv8, for the
  // dims 8 m.. of qk_dims), so none is recomputed per tile: NeoX pairs 4 q.. with q = 2 m + h, GPT-J chunk q = m
  // + h D / 16; (float32) pairs 4 q.. with q = lane % LPR, as before.
  const int m = lane % (D / 16), h = lane / (D / 16) % 2;
  const int q = KVATTN_ROPE_F32 ? lane % LPR : INTERLEAVE ? m + h * (D / 16) : 2 * m + h, rfirst = r0 + lane / LPR;
  const float log2_theta = __ldg(rd), rcp = __ldg(rd + 1);
  const float p_first = (float)(pos0 + rfirst + __float_as_int(__ldg(rd + 2 + req))) * rcp;
  const float p_step = (float)RP * rcp;
  float cs[4], sn[4], cd[4], sd[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float inv = KVATTN_ROPE_F32 ? rope_freq<D>(4 * q + e, log2_theta) : h ? inv8[4 + e] : inv8[e];
    rope_sincos(p_first * inv, sn[e], cs[e]);
    rope_sincos(p_step * inv, sd[e], cd[e]);
  }
  if constexpr (!KVATTN_ROPE_F32) {   // packed: no unpacking, 2 instructions a pair
    // KVATTN_ROPE_CHEB: the next row's angle by Chebyshev's recurrence, cos(a + d) = 2 cos(d) cos(a) - cos(a - d)
    // (likewise sine): 2 FMA a pair instead of a rotation's 4, the previous angle kept.
    float cp[4], sp[4], tcd[4];   // (CHEB) the previous row's cosine / sine; 2 cos(step)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      cp[e] = cs[e] * cd[e] + sn[e] * sd[e];
      sp[e] = sn[e] * cd[e] - cs[e] * sd[e];
      tcd[e] = 2.f * cd[e];
    }
    constexpr int K = N / RP < KVATTN_ROPE_BATCH ? N / RP : KVATTN_ROPE_BATCH;   // rows loaded together
    // row r's words: NeoX dims 4q.. (a) and 4q + D/2.. (b); GPT-J chunk q (a, its two halves as one uint4)
    auto word_a = [&](int r) { return tile + (INTERLEAVE ? swz<D>(r, q) : swz<D>(r, q / 2) + 4 * (q % 2)); };
    auto word_b = [&](int r) { return tile + swz<D>(r, D / 16 + q / 2) + 4 * (q % 2); };
#pragma unroll 1
    for (int k0 = 0; k0 < N / RP; k0 += K) {
      uint2 wa[K], wb[K];   // NeoX: dims 4q.. and 4q + D/2..; GPT-J: the two halves of chunk q
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int r = rfirst + (k0 + k) * RP;
        if (INTERLEAVE) {
          const uint4 w = *reinterpret_cast<const uint4*>(word_a(r));
          wa[k] = make_uint2(w.x, w.y);
          wb[k] = make_uint2(w.z, w.w);
        } else {
          wa[k] = *reinterpret_cast<const uint2*>(word_a(r));
          wb[k] = *reinterpret_cast<const uint2*>(word_b(r));
        }
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int r = rfirst + (k0 + k) * RP;
        if (INTERLEAVE) {   // word e: pair e, (cos, cos) and (-sin, sin)
          uint4 w;
          w.x = rotate_pair_packed<T>(wa[k].x, Mma<T>::pack(cs[0], cs[0]), Mma<T>::pack(-sn[0], sn[0]));
          w.y = rotate_pair_packed<T>(wa[k].y, Mma<T>::pack(cs[1], cs[1]), Mma<T>::pack(-sn[1], sn[1]));
          w.z = rotate_pair_packed<T>(wb[k].x, Mma<T>::pack(cs[2], cs[2]), Mma<T>::pack(-sn[2], sn[2]));
          w.w = rotate_pair_packed<T>(wb[k].y, Mma<T>::pack(cs[3], cs[3]), Mma<T>::pack(-sn[3], sn[3]));
          *reinterpret_cast<uint4*>(word_a(r)) = w;
        } else {
          rotate_packed<T>(wa[k].x, wb[k].x, Mma<T>::pack(cs[0], cs[1]), Mma<T>::pack(sn[0], sn[1]));
          rotate_packed<T>(wa[k].y, wb[k].y, Mma<T>::pack(cs[2], cs[3]), Mma<T>::pack(sn[2], sn[3]));
          *reinterpret_cast<uint2*>(word_a(r)) = wa[k];
          *reinterpret_cast<uint2*>(word_b(r)) = wb[k];
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {   // the next row's angle
          if (KVATTN_ROPE_CHEB) {
            const float c2 = fmaf(tcd[e], cs[e], -cp[e]), s2 = fmaf(tcd[e], sn[e], -sp[e]);
            cp[e] = cs[e];
            sp[e] = sn[e];
            cs[e] = c2;
            sn[e] = s2;
          } else {
            const float c2 = cs[e] * cd[e] - sn[e] * sd[e];
            sn[e] = sn[e] * cd[e] + cs[e] * sd[e];
            cs[e] = c2;
          }
        }
      }
    }
  } else {   // float32
#pragma unroll   // (unrolled: every row's shared-memory loads issue together, not one row's latency at a time)
    for (int k = 0; k < N / RP; ++k) {
      const int r = rfirst + k * RP;
      unsigned* a;   // NeoX: dims 4q.. (2 words) and 4q + D/2.. (2 words); GPT-J: the pairs of chunk q (4 words)
      unsigned* b;
      if (INTERLEAVE) {
        a = b = reinterpret_cast<unsigned*>(tile + swz<D>(r, q));
      } else {
        a = reinterpret_cast<unsigned*>(tile + swz<D>(r, q / 2) + 4 * (q % 2));
        b = reinterpret_cast<unsigned*>(tile + swz<D>(r, D / 16 + q / 2) + 4 * (q % 2));
      }
      float x[4], y[4];   // pair e: (x, y) -> (x cos - y sin, y cos + x sin)
      if (INTERLEAVE) {
        const uint4 w = *reinterpret_cast<const uint4*>(a);
        const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) { const float2 f = unpack2<T>(ws[e]); x[e] = f.x; y[e] = f.y; }
      } else {
        const uint2 wa = *reinterpret_cast<const uint2*>(a), wb = *reinterpret_cast<const uint2*>(b);
        const float2 a0 = unpack2<T>(wa.x), a1 = unpack2<T>(wa.y), b0 = unpack2<T>(wb.x), b1 = unpack2<T>(wb.y);
        x[0] = a0.x; x[1] = a0.y; x[2] = a1.x; x[3] = a1.y;
        y[0] = b0.x; y[1] = b0.y; y[2] = b1.x; y[3] = b1.y;
      }
      float u[4], v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        u[e] = x[e] * cs[e] - y[e] * sn[e];
        v[e] = y[e] * cs[e] + x[e] * sn[e];
        const float c2 = cs[e] * cd[e] - sn[e] * sd[e];   // the next row's angle
        sn[e] = sn[e] * cd[e] + cs[e] * sd[e];
        cs[e] = c2;
      }
      if (INTERLEAVE) {
        *reinterpret_cast<uint4*>(a) = make_uint4(Mma<T>::pack(u[0], v[0]), Mma<T>::pack(u[1], v[1]),
                                                  Mma<T>::pack(u[2], v[2]), Mma<T>::pack(u[3], v[3]));
      } else {
        *reinterpret_cast<uint2*>(a) = make_uint2(Mma<T>::pack(u[0], u[1]), Mma<T>::pack(u[2], u[3]));
        *reinterpret_cast<uint2*>(b) = make_uint2(Mma<T>::pack(v[0], v[1]), Mma<T>::pack(v[2], v[3]));
      }
    }
  }
}

// V's query / key transform over rows of a [rows][D] shared-memory tile (swizzle: swz<D>), each row's position
// pos_of(row): the calling threads (t of nt) split the rows' 16-dim groups between them.
// Thread t (of nt, a multiple of D / 16) always takes the same 16 dims, those of V::qk_init<D>(p, qk_dims<D>(t)).
template <int D> __device__ __forceinline__ int qk_dims(int t) { return (t % (D / 16)) * 8; }

// place(r, c): the element offset of 16-byte chunk c of row r in the tile (its swizzle).
template <class V, int D, typename T, class P, class Pos, class Place>
__device__ __forceinline__ void transform_rows_at(const P& p, const typename V::QKState& st, T* tile, Place place,
                                                  int r0, int n, int t, int nt, int req, bool key, Pos pos_of) {
  constexpr int HC = D / 16;   // chunk pairs per row
  const int c = t % HC;
  for (int r = r0 + t / HC; r < r0 + n; r += nt / HC) {
    T* a = tile + place(r, c);
    T* b = tile + place(r, c + HC);
    Raw8<T> ra, rb;
    ra.w[0] = *reinterpret_cast<const uint4*>(a);
    rb.w[0] = *reinterpret_cast<const uint4*>(b);
    float lo[8], hi[8];
    ra.to_float(lo);
    rb.to_float(hi);
    V::template qk<D>(p, st, lo, hi, pos_of(r), req, key);
    Vec8<T>::store(a, lo);
    Vec8<T>::store(b, hi);
  }
}

template <class V, int D, typename T, class P, class Pos>
__device__ __forceinline__ void transform_rows(const P& p, const typename V::QKState& st, T* tile, int r0, int n,
                                               int t, int nt, int req, bool key, Pos pos_of) {
  transform_rows_at<V, D>(p, st, tile, [](int r, int c) { return swz<D>(r, c); }, r0, n, t, nt, req, key, pos_of);
}

// A thread's RoPE constants (empty when RoPE is off, so that nothing is computed or kept).
template <bool ON> struct RopeState { float inv[8]; };
template <> struct RopeState<false> {};

// The weight of score x (log2 domain, -inf when masked) of a non-softmax variant: masked pairs weigh 0.
template <class V, class P> __device__ __forceinline__ float variant_prob(const P& p, float x) {
  return x == KVATTN_NEG_INF ? 0.f : V::prob(p, x);
}

// Row r's scores (elements 2r, 2r + 1 of each 8-column block of an mma C layout) -> in place, their weights (a
// non-softmax variant: m is 0 once the row saw a tile) or online-softmax probabilities against the row's running
// max m (mx: the tile's max; FOLD: of the raw scores, the score scale p.score_scale folded into the exponent,
// which needs the scale > 0 so max commutes with it); l updated. Returns the factor the row's output must be
// multiplied by (1 for weights). LAZY: online_max's. POLY (FOLD only: the unmasked tiles, whose scores are finite):
// the blocks nb with nb % 8 < POLY take poly_exp2 instead of the MUFU's exp2. Decode and both prefill kernels.
template <class V, bool FOLD, int LAZY = 0, int POLY = 0, int N8, class P>
__device__ __forceinline__ float row_probs(const P& p, float (&s)[N8][4], int r, float mx, float& m, float& l) {
  float sum = 0.f;
  if constexpr (!V::kSoftmax) {
#pragma unroll
    for (int nb = 0; nb < N8; ++nb)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        float& x = s[nb][2 * r + e2];
        x = variant_prob<V>(p, x);
        sum += x;
      }
    m = 0.f;
    l += sum;
    return 1.f;
  }
  float base;
  const float scale = online_max<LAZY>(m, FOLD ? mx * p.score_scale : mx, base);
#pragma unroll
  for (int nb = 0; nb < N8; ++nb)
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      float& x = s[nb][2 * r + e2];
      const float e = FOLD ? fmaf(x, p.score_scale, -base) : x - base;
      x = FOLD && nb % 8 < POLY ? poly_exp2(e) : fast_exp2(e);   // (nb unrolled: chosen at compile time)
      sum += x;
    }
  l = l * scale + sum;
  return scale;
}

// The mask traits every kernel reads.
template <class V> struct VariantTraits {
  static constexpr bool kMasks = V::kKeep || V::kWindow || V::kCustomMask;
  static constexpr bool kNeedsDiag = kMasks || V::kPositional || V::kQK;   // decode computes the row's diagonal
  static constexpr bool kAny = V::kLogits || V::kPositional || kMasks;
};

// tanh for the logits soft cap. KVATTN_TANH (A/B of scripts/ab_sm90.py --tanh): 0 = tanhf (libdevice),
// 1 = 1 - 2 / (2^(2x log2 e) + 1) with ex2.approx and a fast reciprocal (two MUFU ops, absolute error ~1e-7,
// exact limits +-1), 2 = tanh.approx.f32 (one MUFU op, relative error up to 2^-11, so up to cap * 2^-11 in
// a logit). The default is 2: on the H200 (BENCHMARKS.md) it keeps the soft-capped prefill at 0.94 of the
// plain kernel (tanhf 0.65, ex2 + rcp 0.78) with a smaller measured error than tanhf's against the reference.
#ifndef KVATTN_TANH
#define KVATTN_TANH 2
#endif
__device__ __forceinline__ float softcap_tanh(float x) {
#if KVATTN_TANH == 0
  return tanhf(x);
#elif KVATTN_TANH == 1
  return 1.f - __fdividef(2.f, fast_exp2(x * (2.f * kLog2e)) + 1.f);
#else
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// The built-in variants: logits soft cap (s = cap * tanh(s / cap)), ALiBi (s += slope[head] * (j - diag),
// natural-log units), attention sinks (one logit per head, sink[head], added to the softmax's denominator:
// o *= 1 / (1 + exp(sink - lse)), lse = logaddexp(lse, sink)), sliding window and a bit-packed custom mask
// (prefill), and fused RoPE on q and k (ROPE 1: NeoX halves, 2: GPT-J interleaved pairs; positions offset by
// a per-request offset), each selected at compile time. p.variant_data: sinks [Hq] (SINK), then slopes [Hq]
// (ALIBI), then RoPE's log2(theta), 1 / scale and the per-request offsets (int32 [batch]).
template <bool SOFT_CAP, bool WINDOW, bool CUSTOM, bool ALIBI = false, bool SINK = false, int ROPE = 0>
struct Builtin : VariantBase {
  static constexpr bool kLogits = SOFT_CAP;
  static constexpr bool kPositional = ALIBI;
  static constexpr bool kWindow = WINDOW;
  static constexpr bool kCustomMask = CUSTOM;
  static constexpr bool kOutput = SINK;
  static constexpr bool kQK = ROPE != 0;
  static constexpr int kRope = ROPE;

  template <class P> __device__ __forceinline__ static float logits(const P& p, float x) {
    if (SOFT_CAP) x = p.cap_log2 * softcap_tanh(x);
    return x;
  }
  template <class P> __device__ __forceinline__ static float row_init(const P& p, int head, int /*req*/) {
    // the row's slope, in log2 units
    return ALIBI ? __ldg(p.variant_data + (SINK ? p.num_qo_heads : 0) + head) * kLog2e : 0.f;
  }
  template <class P>
  __device__ __forceinline__ static float logits_at(const P&, float x, int j, int diag, float rc) {
    return ALIBI ? fmaf(rc, (float)(j - diag), x) : x;
  }
  using QKState = RopeState<ROPE != 0>;   // RoPE: the inverse frequencies of this thread's 8 pairs
  template <class P> __device__ __forceinline__ static const float* rope_data(const P& p) {
    return p.variant_data + (SINK ? p.num_qo_heads : 0) + (ALIBI ? p.num_qo_heads : 0);
  }
  template <int D, class P> __device__ __forceinline__ static QKState qk_init(const P& p, int d0) {
    QKState st;
    if constexpr (ROPE != 0) rope_inv_freq<ROPE == 2, D>(st.inv, d0, __ldg(rope_data(p)));
    return st;
  }
  template <int D, class P>
  __device__ __forceinline__ static void qk(const P& p, const QKState& st, float (&lo)[8], float (&hi)[8], int pos,
                                            int req, bool /*key*/) {
    if (ROPE == 0) return;
    const float* r = rope_data(p);
    rope_rotate<ROPE == 2>(lo, hi, st.inv, (float)(pos + __float_as_int(__ldg(r + 2 + req))) * __ldg(r + 1));
  }
  template <class P> __device__ __forceinline__ static float output(const P& p, int head, float& lse) {
    if (!SINK) return 1.f;
    const float sink = __ldg(p.variant_data + head);
    // once per row: the accurate functions; lse may be -inf (an empty row: o = 0, lse = sink)
    const float total = fmaxf(lse, sink) + log1pf(expf(fminf(lse, sink) - fmaxf(lse, sink)));
    const float f = expf(lse - total);
    lse = total;
    return f;
  }
};

// One warp's N key rows [r0, r0 + N) of a [rows][D] tile at positions pos0 + r, lane of 32: built-in RoPE through
// rope_key_run, any other key transform row by row (transform_rows).
template <class V, int D, int N, typename T, class P>
__device__ __forceinline__ void transform_key_rows(const P& p, const typename V::QKState& st, T* tile, int r0,
                                                   int lane, int pos0, int req) {
  if constexpr (V::kRope != 0) {
    rope_key_run<V::kRope == 2, D, N>(tile, r0, lane, V::rope_data(p), pos0, req, st.inv);
  } else {
    transform_rows<V, D>(p, st, tile, r0, N, lane, 32, req, true, [&](int r) { return pos0 + r; });
  }
}

}  // namespace kvattn
