// CPU_FUSED: absorbed MLA decode over a paged latent cache, each cached row read once, straight from its page.
//
// One work item is (request, group of lanes, range of cached rows); a lane is one (query token, head) pair of
// the request. For every tile of rows (32 or 64) the item computes the scores of all its lanes (small GEMM
// tiles, register-blocked), updates the online softmax (running max and sum per lane), and adds
// P x latent into fp32 accumulators [lanes, kv_lora_rank], while the tile is still in cache. Rows are read in
// their stored width (fp32 rows straight from the page, bf16 / fp16 / fp8 rows widened in registers into a
// small tile buffer, a few rows at a time just before their scores). An item of many rows takes its scores in
// GEMM form (queries transposed once, a row value broadcast against lane vectors); a short item in dot form
// (rows and queries both along the latent, no transposition to pay for). Items that cover only part of a
// request's rows (KV splits) leave a partial result
// (unnormalised accumulator, max, sum) that a merge pass combines with the others by their LSE.
//
// The work list comes from Python (mla_backends/cpu_fused/plan.py, made once per step from host data); this
// file only runs it, on at::parallel_for's threads (torch.get_num_threads()), items taken from a shared
// counter so that a core slowed by another process does not hold the others up.
//
// Vector width: GCC/Clang vector extensions of VW floats, VW chosen by the compiler's target (-march=native:
// 16 with AVX-512F, 8 with AVX, 4 otherwise: SSE, NEON, or scalar code from the compiler). A few
// reductions and conversions use x86 intrinsics under #ifdef, with a plain fallback.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#endif

namespace mla_cpu_fused {

#if defined(__AVX512F__)
constexpr int VW = 16;
#elif defined(__AVX__)
constexpr int VW = 8;
#else
constexpr int VW = 4;
#endif

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint8_t vb __attribute__((vector_size(VW * sizeof(uint8_t))));

// ---- tiling ------------------------------------------------------------------------------------------------
// rows per tile: the softmax and the value sum run once per tile, so each lane's accumulator row is loaded
// and stored once per tile. 32 fp32 rows (72 KiB, read in place) or 64 rows of a narrower cache (72 KiB as
// stored, 144 KiB widened): about the same bytes to fetch per tile either way. Measured here (B = 8, 16 heads,
// one thread): 64-row tiles are 4-12 % faster than 32 for bf16 rows and 4-8 % slower for fp32 rows, whose
// next tile then no longer arrives in time.
template <typename KT>
constexpr int tile_rows() {
  return sizeof(KT) >= sizeof(float) ? 32 : 64;
}
constexpr int MAX_TILE_ROWS = 64;
// rows per score sub-tile (dot form): these rows and one lane block's queries stay in L1 while all lane
// blocks pass; also how many rows are widened at a time (bf16 / fp16 / fp8 caches) before their scores
constexpr int SUB_ROWS = 6;
// cache lines of the next tile requested (into L2) before each value-sum micro-kernel call (and each dot-form
// score call): at 16 heads a tile has 88 value-sum calls, 12 lines each cover 32 fp32 rows' 1,152 lines, 16
// lines 64 bf16 rows' 1,152, so the rows arrive while this tile is computed (measured here: 1.3x faster than no
// software prefetch from 8 x 4,096 rows; the hardware prefetcher alone restarts at every page; for fp32 8, 11,
// 14 and 16 lines were no faster, for bf16 at 64-row tiles 8 and 12 slower, 26 and 40 slower still)
template <typename KT>
constexpr int prefetch_lines() {
  return sizeof(KT) >= sizeof(float) ? 12 : 16;
}
// an item takes the GEMM-form scores from this many cached rows: below, transposing its queries (about 2 us
// for 16 lanes) costs more than the faster scores save
constexpr int64_t GEMM_MIN_ROWS = 128;
// register blocks: dot-form scores SR rows x SL lanes (8 accumulators, 2 rows and 4 queries in registers: 6
// loads per 8 FMAs; 16 heads are 4 blocks of 4); GEMM-form scores GR rows x 2 lane vectors (12 accumulators,
// 2 query vectors and a broadcast row value: 8 loads per 12 FMAs, no horizontal sums), GR1 rows where one lane
// vector is left; value sum PL lanes x PD vectors of the latent (12 accumulators, 3 latent vectors and a
// broadcast weight: 7 loads per 12 FMAs); 16 vector registers in each
constexpr int SR = 2;
constexpr int SL = 4;
constexpr int GR = 6;
constexpr int GR1 = 8;
constexpr int PL = 4;
constexpr int PD = 3;
// the running max is moved (and the accumulators rescaled) only when a tile's max exceeds it by this much:
// weights stay below exp(8) and the result is exact either way (the final normalisation uses the same max)
constexpr float LAZY_RESCALE = 8.0f;
// the running max before any row: finite, so exp(max - new max) is 0, never NaN
constexpr float NO_MAX = -1e30f;
// the width every dimension must be a multiple of (the Python side refuses others)
constexpr int DIM_MULTIPLE = 16;

static inline vf loadu(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline vf splat(float s) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(s);
#elif defined(__AVX__)
  return _mm256_set1_ps(s);
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = s;
  return v;
#endif
}
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
// keeps v in a register: the compiler may not turn later uses into memory operands (each one a load)
static inline void in_register(vf& v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// exp(x) for every lane: x below -87.3 gives 0 (also -inf), NaN stays NaN. Cephes' polynomial on
// x - n ln2, n = round(x / ln2), relative error about 2 ulp.
static inline vf vexp(vf x) {
  const vf lo = splat(-87.3365447505531f), hi = splat(88.0f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  vf t = xc * splat(1.44269504088896341f) + magic;
  vf n = t - magic;
  vi ni = (vi)t - (vi)magic;
  vf r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3333519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  vf pow2 = (vf)((ni + 127) << 23);
  vf y = p * pow2;
  return x < lo ? vf{} : y;
}

static inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(__AVX__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
#else
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
#endif
}

// the sums of L accumulators, written to dst[0..L)
template <int L>
static inline void hsum_store(const vf* a, float* dst) {
  if constexpr (L == 3) {  // as four, the last one repeated, then three kept
    float t[4];
    const vf b[4] = {a[0], a[1], a[2], a[2]};
    hsum_store<4>(b, t);
    dst[0] = t[0], dst[1] = t[1], dst[2] = t[2];
    return;
  }
#if defined(__AVX__) && !defined(__AVX512F__)
  if constexpr (L == 4) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
    __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s = _mm256_hadd_ps(s01, s23);
    _mm_storeu_ps(dst, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    return;
  }
#elif defined(__AVX512F__)
  if constexpr (L == 4) {
    __m256 h[4];
    for (int i = 0; i < 4; ++i)
      h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    _mm_storeu_ps(dst, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    return;
  }
#endif
  for (int i = 0; i < L; ++i) dst[i] = hsum(a[i]);
}

// ---- element conversions -----------------------------------------------------------------------------------
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};


// fp8 bytes as exact fp32 values: the magnitude bits moved into fp32's exponent and mantissa fields and
// rebiased by a power of two (exact, subnormals included), the sign put back, NaN (and e5m2's inf) restored;
// then multiplied by the scale in fp32, as LatentKVCache.dequantize does: float(stored) * scale
static inline vf fp8_e4m3_vec(vb b, float scale) {
  vu w = __builtin_convertvector(b, vu);
  vu mag = w & 0x7Fu;
  vf v = (vf)(mag << 20) * splat(0x1p120f) * splat(scale);
  vu bits = (vu)v | ((w & 0x80u) << 24);
  bits |= (vu)(mag == 0x7Fu) & 0x7FC00000u;  // S.1111.111: NaN
  return (vf)bits;
}
static inline vf fp8_e5m2_vec(vb b, float scale) {
  vu w = __builtin_convertvector(b, vu);
  vu mag = w & 0x7Fu;
  vf v = (vf)(mag << 21) * splat(0x1p112f) * splat(scale);
  vu bits = (vu)v;
  vu special = (vu)((mag & 0x7Cu) == 0x7Cu);  // exponent all ones: inf (mantissa 0) or NaN
  vu inf_nan = 0x7F800000u | ((mag & 3u) << 21);
  bits = (bits & ~special) | (inf_nan & special);
  bits |= (w & 0x80u) << 24;
  return (vf)bits;
}
static inline float fp8_e4m3_scalar(uint8_t b, float scale) {
  vb v{};
  v[0] = b;
  return fp8_e4m3_vec(v, scale)[0];
}
static inline float fp8_e5m2_scalar(uint8_t b, float scale) {
  vb v{};
  v[0] = b;
  return fp8_e5m2_vec(v, scale)[0];
}

// VW values of a 16- or 32-bit float type -> fp32
template <typename T>
static inline vf load_vec(const T* src);

template <>
inline vf load_vec<float>(const float* src) {
  return loadu(src);
}

// (through the zero-extending load where there is one: GCC 12 lowers the generic conversion of 8 uint16 to two
// 4-wide extensions and an insert, 5 instructions a vector where 1 + 1 do)
template <>
inline vf load_vec<c10::BFloat16>(const c10::BFloat16* src) {
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
#elif defined(__AVX2__)
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16));
#else
  vh h;
  std::memcpy(&h, src, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

template <>
inline vf load_vec<c10::Half>(const c10::Half* src) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#elif defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#else
  vf v;
  for (int k = 0; k < VW; ++k) v[k] = static_cast<float>(src[k]);
  return v;
#endif
}

// one cached row [n] in its stored type -> fp32 (n a multiple of VW); fp32 rows are never converted
template <typename KT>
static inline void widen_row(const KT* src, float* dst, int64_t n, float scale);

template <>
inline void widen_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n, float) {
  for (int64_t d = 0; d < n; d += VW) storeu(dst + d, load_vec(src + d));
}

template <>
inline void widen_row<c10::Half>(const c10::Half* src, float* dst, int64_t n, float) {
  for (int64_t d = 0; d < n; d += VW) storeu(dst + d, load_vec(src + d));
}

// one row of fp8 bytes through DECODE (fp8_e4m3_vec / fp8_e5m2_vec), VW bytes at a time
template <vf (*DECODE)(vb, float)>
static inline void widen_fp8_row(const void* src, float* dst, int64_t n, float scale) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  for (int64_t d = 0; d < n; d += VW) {
    vb b;
    std::memcpy(&b, s + d, sizeof b);
    storeu(dst + d, DECODE(b, scale));
  }
}

template <>
inline void widen_row<Fp8E4M3>(const Fp8E4M3* src, float* dst, int64_t n, float scale) {
  widen_fp8_row<fp8_e4m3_vec>(src, dst, n, scale);
}

template <>
inline void widen_row<Fp8E5M2>(const Fp8E5M2* src, float* dst, int64_t n, float scale) {
  widen_fp8_row<fp8_e5m2_vec>(src, dst, n, scale);
}

// n query values (element stride `stride`) -> fp32 times `scale` (vectorised for a unit stride; n a multiple of
// VW). fp32 queries are copied first and scaled in place: measured here, 5 % faster at short contexts than one
// pass of loads, multiplies and stores (the queries come from L3); narrower ones are widened and scaled in one
// pass (2-4 % faster than widening first)
template <typename QT>
static inline void load_scaled(const QT* src, int64_t stride, int64_t n, float scale, float* dst) {
  if (stride != 1) {
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d * stride]) * scale;
    return;
  }
  const vf sv = splat(scale);
  if constexpr (std::is_same<QT, float>::value) {
    std::memcpy(dst, src, n * sizeof(float));
    for (int64_t d = 0; d < n; d += VW) storeu(dst + d, loadu(dst + d) * sv);
  } else {
    for (int64_t d = 0; d < n; d += VW) storeu(dst + d, load_vec(src + d) * sv);
  }
}

// one vector of fp32 values stored in the output type, rounded as torch rounds (to nearest even; NaN stays NaN)
template <typename QT>
static inline void store_vec(QT* dst, vf v) {
  if constexpr (std::is_same<QT, float>::value) {
    storeu(dst, v);
  } else if constexpr (std::is_same<QT, c10::BFloat16>::value) {
    vu b = (vu)v;
    vu rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    rounded = v != v ? vu{} + 0x7FC0u : rounded;  // NaN (unordered with itself) stays NaN
#if defined(__AVX2__) && !defined(__AVX512F__)
    const __m256i packed = _mm256_packus_epi32((__m256i)rounded, (__m256i)rounded);  // values < 2^16: exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
#else
    vh h = __builtin_convertvector(rounded, vh);
    std::memcpy(dst, &h, sizeof h);
#endif
  } else {
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int k = 0; k < VW; ++k) dst[k] = static_cast<QT>(v[k]);
#endif
  }
}

// dst[d * stride] = src[d] * mul for n values in the output type (store_vec's rounding), vectorised for a unit
// stride (n a multiple of VW)
template <typename QT>
static inline void store_scaled(const float* src, float mul, QT* dst, int64_t stride, int64_t n) {
  const vf mv = splat(mul);
  if (stride == 1) {
    for (int64_t d = 0; d < n; d += VW) store_vec<QT>(dst + d, loadu(src + d) * mv);
    return;
  }
  for (int64_t d = 0; d < n; ++d) dst[d * stride] = static_cast<QT>(src[d] * mul);
}

// ---- micro-kernels -----------------------------------------------------------------------------------------
// Kept out of line: inlined into run_item, GCC 12 allocated the scores loop's registers worse (measured 50
// against 66 GFLOP/s at 8 x 4,096 rows, 16 heads, one thread). Tried and slower in place (same measurement): the
// scores with lanes in vectors and broadcast row values (73 GFLOP/s alone, 58-64 in place), and pre-broadcast
// value-sum weights (no change).
// scores s[r * s_stride + i] = rows[r] . q[i] over W columns, R rows x L lanes in registers
template <int R, int L>
__attribute__((noinline)) static void scores_micro(const float* const* rows, const float* q, int64_t W, float* s, int64_t s_stride) {
  vf acc[R][L];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < L; ++i) acc[r][i] = vf{};
  const float* rp[R];
  for (int r = 0; r < R; ++r) rp[r] = rows[r];
  for (int64_t d = 0; d < W; d += VW) {
    vf k[R], qv[L];
    for (int r = 0; r < R; ++r) {
      k[r] = loadu(rp[r] + d);
      in_register(k[r]);
    }
    for (int i = 0; i < L; ++i) {
      qv[i] = loadu(q + i * W + d);
      in_register(qv[i]);  // loaded once, used R times (not folded into each FMA as a memory operand)
    }
    for (int i = 0; i < L; ++i)
      for (int r = 0; r < R; ++r) acc[r][i] += k[r] * qv[i];
  }
  for (int r = 0; r < R; ++r) hsum_store<L>(acc[r], s + r * s_stride);
}

template <int R>
static inline void scores_lanes(const float* const* rows, const float* q, int64_t W, float* s, int64_t s_stride,
                                int lanes) {
  switch (lanes) {
    case 1: scores_micro<R, 1>(rows, q, W, s, s_stride); break;
    case 2: scores_micro<R, 2>(rows, q, W, s, s_stride); break;
    case 3: scores_micro<R, 3>(rows, q, W, s, s_stride); break;
    default: scores_micro<R, 4>(rows, q, W, s, s_stride); break;
  }
}

static inline void scores_block(const float* const* rows, int nrows, const float* q, int64_t W, float* s,
                                int64_t s_stride, int lanes) {
  switch (nrows) {
    case 1: scores_lanes<1>(rows, q, W, s, s_stride, lanes); break;
    default: scores_lanes<2>(rows, q, W, s, s_stride, lanes); break;
  }
}

// scores in GEMM form: s[r * s_stride + v * VW + k] = rows[r] . qt[:, v * VW + k] for R rows x LV lane vectors,
// queries transposed (qt[d * q_stride + lane]); each row value is broadcast against the lane vectors
template <int R, int LV>
__attribute__((noinline)) static void scores_gemm_micro(const float* const* rows, const float* qt, int64_t q_stride,
                                                        int64_t W, float* s, int64_t s_stride) {
  vf acc[R][LV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < LV; ++v) acc[r][v] = vf{};
  const float* rp[R];
  for (int r = 0; r < R; ++r) rp[r] = rows[r];
  for (int64_t d = 0; d < W; ++d) {
    vf qv[LV];
    for (int v = 0; v < LV; ++v) {
      qv[v] = loadu(qt + d * q_stride + v * VW);
      in_register(qv[v]);  // loaded once, used R times
    }
    for (int r = 0; r < R; ++r) {
      const vf k = splat(rp[r][d]);
      for (int v = 0; v < LV; ++v) acc[r][v] += k * qv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < LV; ++v) storeu(s + r * s_stride + v * VW, acc[r][v]);
}

// nrows at most GR (two lane vectors) or GR1 (one)
template <int LV>
static inline void scores_gemm_rows(const float* const* rows, int nrows, const float* qt, int64_t q_stride,
                                    int64_t W, float* s, int64_t s_stride) {
  static_assert(GR == 6 && GR1 == 8, "the cases below list 1 .. GR1 rows");
  if constexpr (LV == 1) {
    if (nrows == 8) return scores_gemm_micro<8, 1>(rows, qt, q_stride, W, s, s_stride);
    if (nrows == 7) return scores_gemm_micro<7, 1>(rows, qt, q_stride, W, s, s_stride);
  }
  switch (nrows) {
    case 1: scores_gemm_micro<1, LV>(rows, qt, q_stride, W, s, s_stride); break;
    case 2: scores_gemm_micro<2, LV>(rows, qt, q_stride, W, s, s_stride); break;
    case 3: scores_gemm_micro<3, LV>(rows, qt, q_stride, W, s, s_stride); break;
    case 4: scores_gemm_micro<4, LV>(rows, qt, q_stride, W, s, s_stride); break;
    case 5: scores_gemm_micro<5, LV>(rows, qt, q_stride, W, s, s_stride); break;
    default: scores_gemm_micro<6, LV>(rows, qt, q_stride, W, s, s_stride); break;
  }
}

// dst[d * dst_stride + i] = src[i * src_stride + d] for i < n, d < W (W a multiple of 8): 8 x 8 blocks through
// registers where AVX is present
static void transpose_rows(const float* src, int64_t src_stride, int64_t n, int64_t W, float* dst,
                           int64_t dst_stride) {
  int64_t i0 = 0;
#if defined(__AVX__)
  for (; i0 + 8 <= n; i0 += 8)
    for (int64_t d0 = 0; d0 < W; d0 += 8) {
      __m256 a[8], t[8];
      for (int k = 0; k < 8; ++k) a[k] = _mm256_loadu_ps(src + (i0 + k) * src_stride + d0);
      for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_ps(a[k], a[k + 1]);
        t[k + 1] = _mm256_unpackhi_ps(a[k], a[k + 1]);
      }
      for (int k = 0; k < 8; k += 4) {
        a[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
        a[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
        a[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
        a[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int k = 0; k < 4; ++k) {
        _mm256_storeu_ps(dst + (d0 + k) * dst_stride + i0, _mm256_permute2f128_ps(a[k], a[k + 4], 0x20));
        _mm256_storeu_ps(dst + (d0 + k + 4) * dst_stride + i0, _mm256_permute2f128_ps(a[k], a[k + 4], 0x31));
      }
    }
#endif
  for (; i0 < n; ++i0)
    for (int64_t d = 0; d < W; ++d) dst[d * dst_stride + i0] = src[i0 * src_stride + d];
}

// acc[i][d0 .. d0 + D * VW) += sum over the tile's rows of p[r][i] * rows[r][d0 ..], L lanes x D vectors
template <int L, int D, bool FIRST>
__attribute__((noinline)) static void pv_micro(const float* const* rows, int nrows, const float* p, int64_t p_stride, float* acc,
                            int64_t acc_stride, int64_t d0) {
  vf a[L][D];
  for (int i = 0; i < L; ++i)
    for (int j = 0; j < D; ++j) a[i][j] = FIRST ? vf{} : loadu(acc + i * acc_stride + d0 + j * VW);
  for (int r = 0; r < nrows; ++r) {
    const float* row = rows[r] + d0;
    vf v[D];
    for (int j = 0; j < D; ++j) v[j] = loadu(row + j * VW);
    const float* pr = p + r * p_stride;
    for (int i = 0; i < L; ++i) {
      vf pb = splat(pr[i]);
      for (int j = 0; j < D; ++j) a[i][j] += pb * v[j];
    }
  }
  for (int i = 0; i < L; ++i)
    for (int j = 0; j < D; ++j) storeu(acc + i * acc_stride + d0 + j * VW, a[i][j]);
}

template <int L, bool FIRST>
static inline void pv_vectors(const float* const* rows, int nrows, const float* p, int64_t p_stride, float* acc,
                              int64_t acc_stride, int64_t d0, int vecs) {
  switch (vecs) {
    case 1: pv_micro<L, 1, FIRST>(rows, nrows, p, p_stride, acc, acc_stride, d0); break;
    case 2: pv_micro<L, 2, FIRST>(rows, nrows, p, p_stride, acc, acc_stride, d0); break;
    default: pv_micro<L, 3, FIRST>(rows, nrows, p, p_stride, acc, acc_stride, d0); break;
  }
}

template <bool FIRST>
static inline void pv_lanes(const float* const* rows, int nrows, const float* p, int64_t p_stride, float* acc,
                            int64_t acc_stride, int64_t d0, int lanes, int vecs) {
  switch (lanes) {
    case 1: pv_vectors<1, FIRST>(rows, nrows, p, p_stride, acc, acc_stride, d0, vecs); break;
    case 2: pv_vectors<2, FIRST>(rows, nrows, p, p_stride, acc, acc_stride, d0, vecs); break;
    case 3: pv_vectors<3, FIRST>(rows, nrows, p, p_stride, acc, acc_stride, d0, vecs); break;
    default: pv_vectors<4, FIRST>(rows, nrows, p, p_stride, acc, acc_stride, d0, vecs); break;
  }
}

// `first`: the accumulators hold nothing yet (this tile writes them)
static inline void pv_block(const float* const* rows, int nrows, const float* p, int64_t p_stride, float* acc,
                            int64_t acc_stride, int64_t d0, int lanes, int vecs, bool first) {
  if (first)
    pv_lanes<true>(rows, nrows, p, p_stride, acc, acc_stride, d0, lanes, vecs);
  else
    pv_lanes<false>(rows, nrows, p, p_stride, acc, acc_stride, d0, lanes, vecs);
}

// ---- per-thread scratch --------------------------------------------------------------------------------------
struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

// one thread's working memory, kept between calls (grown when a call needs more; bounded by the largest lane
// group and tile, never by the context length)
struct Scratch {
  std::unique_ptr<float[], FreeDeleter> mem;
  size_t cap = 0;
  float* get(size_t floats) {
    if (floats > cap) {
      size_t bytes = ((floats * sizeof(float) + 63) / 64) * 64;
      float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
      TORCH_CHECK(p != nullptr, "CPU_FUSED: could not allocate ", bytes, " bytes of scratch");
      mem.reset(p);
      cap = floats;
    }
    return mem.get();
  }
};

static Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- the call's description ------------------------------------------------------------------------------
template <typename QT, typename KT>
struct Call {
  // queries [T, H, r] / [T, H, rope] and outputs [T, H, r] / lse [T, H], strides in elements
  const QT* ql;
  const QT* qr;
  int64_t ql_s0, ql_s1, ql_s2, qr_s0, qr_s1, qr_s2;
  QT* out;
  int64_t o_s0, o_s1, o_s2;
  float* lse;
  int64_t l_s0, l_s1;
  // cache [blocks, block_size, W], row elements contiguous
  const KT* cache;
  int64_t c_s0, c_s1, block_size;
  // block table [B, max_pages] (int32 or int64)
  const void* table;
  bool table64;
  int64_t t_s0, t_s1;
  int64_t H, r, rope, W;
  float scale, kv_scale;
  // requests [R, 4]: first token, tokens, context length, block-table row
  const int64_t* reqs;
  // partials: slot s at partials + s * slot_floats: acc [slot_lanes, r], then max [slot_lanes], sum [slot_lanes]
  float* partials;
  int64_t slot_lanes, slot_floats;

  inline int64_t page_of(int64_t row_of_table, int64_t p) const {
    int64_t k = p / block_size;
    return table64 ? static_cast<const int64_t*>(table)[row_of_table * t_s0 + k * t_s1]
                   : static_cast<const int32_t*>(table)[row_of_table * t_s0 + k * t_s1];
  }
  inline const KT* row_ptr(int64_t row_of_table, int64_t p) const {
    return cache + page_of(row_of_table, p) * c_s0 + (p % block_size) * c_s1;
  }
};

// brings the cache lines of a range of rows into L2 a few at a time (hints: no fault, nothing waits), so that
// the next tile arrives while this one is computed instead of stalling the first loads of it
struct Prefetcher {
  const char* rows[MAX_TILE_ROWS];
  int64_t nrows = 0, row_bytes = 0, row = 0, off = 0;
  template <typename QT, typename KT>
  void start(const Call<QT, KT>& c, int64_t trow, int64_t p0, int64_t p1) {
    nrows = std::max<int64_t>(0, p1 - p0);
    row_bytes = c.W * static_cast<int64_t>(sizeof(KT));
    for (int64_t k = 0; k < nrows; ++k) rows[k] = reinterpret_cast<const char*>(c.row_ptr(trow, p0 + k));
    row = 0, off = 0;
  }
  inline void step(int lines) {
    for (; lines > 0 && row < nrows; --lines) {
      __builtin_prefetch(rows[row] + off, 0, 2);
      off += 64;
      if (off >= row_bytes) off = 0, ++row;
    }
  }
};

// write lanes' results: out[t, h, :] = acc[i, :] / sum[i], lse[t, h] = max[i] + log(sum[i])
template <typename QT, typename KT>
static void write_out(const Call<QT, KT>& c, const int64_t* rq, int64_t lane0, int64_t nlanes, const float* acc,
                      int64_t acc_stride, const float* m, const float* l) {
  for (int64_t i = 0; i < nlanes; ++i) {
    int64_t g = lane0 + i, t = rq[0] + g / c.H, h = g % c.H;
    float inv = 1.0f / l[i];
    store_scaled(acc + i * acc_stride, inv, c.out + t * c.o_s0 + h * c.o_s1, c.o_s2, c.r);
    c.lse[t * c.l_s0 + h * c.l_s1] = m[i] + std::log(l[i]);
  }
}

// one work item: lanes [lane0, lane0 + nlanes) of request rq over cached rows [row0, row1)
template <typename QT, typename KT>
static void run_item(const Call<QT, KT>& c, const int64_t* it) {
  const int64_t* rq = c.reqs + it[0] * 4;
  const int64_t lane0 = it[1], G = it[2], row0 = it[3], slot = it[5];
  const int64_t tok0 = rq[0], ctx = rq[2], trow = rq[3];
  const int64_t W = c.W, r = c.r;
  const int64_t Gp = round_up(G, VW);
  const int64_t j_min = lane0 / c.H, j_max = (lane0 + G - 1) / c.H;
  const int64_t row1 = std::min(it[4], ctx + j_max + 1);  // no lane sees past its own position
  const int64_t all_see = ctx + j_min;                    // rows up to here are visible to every lane
  constexpr bool direct = std::is_same<KT, float>::value;
  constexpr int TILE_ROWS = tile_rows<KT>(), PF_LINES = prefetch_lines<KT>();
  const bool gemm = row1 - row0 >= GEMM_MIN_ROWS;

  Scratch& sc = thread_scratch();
  // q: the lanes' queries [G, W]; in GEMM form followed by their transpose qt [W, Gp] (padding lanes zero)
  const int64_t q_floats = G * W + (gemm ? W * Gp : 0), acc_floats = G * r, s_floats = TILE_ROWS * Gp;
  const int64_t kt_floats = direct ? 0 : TILE_ROWS * W;
  float* q = sc.get(q_floats + acc_floats + s_floats + kt_floats + 3 * Gp);
  float* acc = q + q_floats;
  float* s = acc + acc_floats;
  float* kt = s + s_floats;
  float* m = kt + kt_floats;
  float* l = m + Gp;
  float* limit = l + Gp;  // last visible position of each lane, as a float (exact below 2^24 rows per tile)

  // the lanes' queries, scaled, in fp32: q[i] = [q_latent[t, h] | q_rope[t, h]] * scale
  for (int64_t i = 0; i < G; ++i) {
    int64_t g = lane0 + i, j = g / c.H, h = g % c.H, t = tok0 + j;
    const QT* a = c.ql + t * c.ql_s0 + h * c.ql_s1;
    const QT* b = c.qr + t * c.qr_s0 + h * c.qr_s1;
    float* qi = q + i * W;
    load_scaled(a, c.ql_s2, r, c.scale, qi);
    load_scaled(b, c.qr_s2, c.rope, c.scale, qi + r);
    limit[i] = static_cast<float>(j);
  }
  float* qt = q + G * W;
  if (gemm) {
    transpose_rows(q, W, G, W, qt, Gp);
    for (int64_t d = 0; d < W; ++d)
      for (int64_t i = G; i < Gp; ++i) qt[d * Gp + i] = 0.f;
  }
  bool first = true;  // the first tile writes the accumulators instead of adding to them (no zeroing pass)
  for (int64_t i = 0; i < Gp; ++i) {
    m[i] = NO_MAX;
    l[i] = 0.f;
  }
  // padding lanes of the score tile: never visible (the GEMM form writes them, and resets them after each tile)
  auto hide_padding = [&](int64_t nrows) {
    for (int64_t rr = 0; rr < nrows; ++rr)
      for (int64_t i = G; i < Gp; ++i) s[rr * Gp + i] = -INFINITY;
  };
  if (Gp > G) hide_padding(TILE_ROWS);

  const float* rows[TILE_ROWS];
  const KT* stored[TILE_ROWS];  // the tile's rows as stored, widened a score block at a time
  auto widen = [&](int rb, int re) {
    if constexpr (!direct)
      for (int rr = rb; rr < re; ++rr) widen_row<KT>(stored[rr], kt + rr * W, W, c.kv_scale);
  };
  const int64_t rvecs = r / VW;
  Prefetcher pf;
  pf.start(c, trow, row0, std::min(row1, row0 + TILE_ROWS));
  pf.step(1 << 30);  // the first tile: all of it now
  for (int64_t p0 = row0; p0 < row1; p0 += TILE_ROWS) {
    const int nr = static_cast<int>(std::min<int64_t>(TILE_ROWS, row1 - p0));
    for (int rr = 0; rr < nr; ++rr) {
      const KT* src = c.row_ptr(trow, p0 + rr);
      if constexpr (direct) {
        rows[rr] = reinterpret_cast<const float*>(src);
      } else {
        stored[rr] = src;
        rows[rr] = kt + rr * W;
      }
    }
    // meanwhile the next tile's rows are fetched into L2, a few cache lines before each micro-kernel call
    pf.start(c, trow, p0 + TILE_ROWS, std::min(row1, p0 + 2 * TILE_ROWS));
    if (gemm) {
      // scores in GEMM form: blocks of GR rows (widened now, in L1 while every lane block passes over them)
      const int block_rows = Gp >= 2 * VW ? GR : GR1;
      for (int rb = 0; rb < nr;) {
        const int nrb = std::min(nr - rb, block_rows);
        widen(rb, rb + nrb);
        int64_t v0 = 0;
        for (; v0 + 2 * VW <= Gp; v0 += 2 * VW)
          scores_gemm_rows<2>(rows + rb, nrb, qt + v0, Gp, W, s + rb * Gp + v0, Gp);
        if (v0 < Gp)  // an odd number of lane vectors: the last one alone over the same rows
          scores_gemm_rows<1>(rows + rb, nrb, qt + v0, Gp, W, s + rb * Gp + v0, Gp);
        rb += nrb;
      }
      if (Gp > G) hide_padding(nr);
    }
    // scores in dot form: sub-tiles of SUB_ROWS rows stay in L1 while every lane block passes over them
    for (int r0 = 0; r0 < nr && !gemm; r0 += SUB_ROWS) {
      const int r1 = std::min(nr, r0 + SUB_ROWS);
      widen(r0, r1);
      for (int64_t i0 = 0; i0 < G; i0 += SL) {
        const int lanes = static_cast<int>(std::min<int64_t>(SL, G - i0));
        for (int rb = r0; rb < r1; rb += SR) {
          pf.step(PF_LINES);
          scores_block(rows + rb, std::min(SR, r1 - rb), q + i0 * W, W, s + rb * Gp + i0, Gp, lanes);
        }
      }
    }
    // the causal edge of multi-token decode: lane i sees rows up to ctx + its token index
    if (p0 + nr - 1 > all_see)
      for (int rr = 0; rr < nr; ++rr) {
        const float rel = static_cast<float>(p0 + rr - ctx);
        if (p0 + rr > all_see)
          for (int64_t i = 0; i < G; ++i)
            if (rel > limit[i]) s[rr * Gp + i] = -INFINITY;
      }
    // online softmax, lanes in vectors
    for (int64_t i = 0; i < Gp; i += VW) {
      vf tmax = loadu(s + i);
      for (int rr = 1; rr < nr; ++rr) tmax = vmax(tmax, loadu(s + rr * Gp + i));
      vf mo = loadu(m + i);
      vi grow = tmax > mo + splat(LAZY_RESCALE);
      bool any = false;
      for (int k = 0; k < VW; ++k) any |= grow[k] != 0;
      if (any) {
        vf mn = vmax(mo, tmax);
        vf alpha = vexp(mo - mn);
        storeu(m + i, mn);
        storeu(l + i, loadu(l + i) * alpha);
        for (int k = 0; k < VW && i + k < G && !first; ++k) {
          if (alpha[k] == 1.0f) continue;
          float* a = acc + (i + k) * r;
          vf av = splat(alpha[k]);
          for (int64_t d = 0; d < r; d += VW) storeu(a + d, loadu(a + d) * av);
        }
      }
      vf mv = loadu(m + i), lsum = loadu(l + i);
      for (int rr = 0; rr < nr; ++rr) {
        vf pv = vexp(loadu(s + rr * Gp + i) - mv);
        storeu(s + rr * Gp + i, pv);
        lsum += pv;
      }
      storeu(l + i, lsum);
    }
    // acc[i, :] += sum_r p[r, i] * latent[r, :], latent blocks outermost so each stays in L1 across lanes
    for (int64_t v0 = 0, vecs = 0; v0 < rvecs; v0 += vecs) {
      vecs = rvecs - v0 == PD + 1 ? 2 : std::min<int64_t>(PD, rvecs - v0);  // 4 left: 2 + 2, not 3 + 1
      for (int64_t i0 = 0; i0 < G; i0 += PL) {
        pf.step(PF_LINES);
        pv_block(rows, nr, s + i0, Gp, acc + i0 * r, r, v0 * VW, static_cast<int>(std::min<int64_t>(PL, G - i0)),
                 static_cast<int>(vecs), first);
      }
    }
    first = false;
  }
  if (first) std::memset(acc, 0, sizeof(float) * acc_floats);  // no rows (never planned): an empty partial

  if (slot < 0) {
    write_out(c, rq, lane0, G, acc, r, m, l);
    return;
  }
  float* part = c.partials + slot * c.slot_floats;
  std::memcpy(part, acc, sizeof(float) * G * r);
  std::memcpy(part + c.slot_lanes * r, m, sizeof(float) * G);
  std::memcpy(part + c.slot_lanes * r + c.slot_lanes, l, sizeof(float) * G);
}

// one merge: the splits [slot0, slot0 + n) of lanes [lane0, lane0 + nlanes) combined by their LSE
template <typename QT, typename KT>
static void run_merge(const Call<QT, KT>& c, const int64_t* mg) {
  const int64_t* rq = c.reqs + mg[0] * 4;
  const int64_t lane0 = mg[1], G = mg[2], slot0 = mg[3], n = mg[4], r = c.r;
  Scratch& sc = thread_scratch();
  const int64_t Gp = round_up(G, VW);
  float* acc = sc.get(G * r + 2 * Gp);
  float* m = acc + G * r;
  float* l = m + Gp;
  auto part = [&](int64_t k) { return c.partials + (slot0 + k) * c.slot_floats; };
  for (int64_t i = 0; i < G; ++i) {
    float mx = NO_MAX;
    for (int64_t k = 0; k < n; ++k) mx = std::max(mx, part(k)[c.slot_lanes * r + i]);
    float sum = 0.f;
    float* a = acc + i * r;
    for (int64_t d = 0; d < r; ++d) a[d] = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      const float* pk = part(k);
      float w = std::exp(pk[c.slot_lanes * r + i] - mx);
      sum += w * pk[c.slot_lanes * r + c.slot_lanes + i];
      vf wv = splat(w);
      const float* src = pk + i * r;
      for (int64_t d = 0; d < r; d += VW) storeu(a + d, loadu(a + d) + wv * loadu(src + d));
    }
    m[i] = mx;
    l[i] = sum;
  }
  write_out(c, rq, lane0, G, acc, r, m, l);
}

// run `count` tasks on torch's intra-op threads, each thread taking the next task from a shared counter
template <typename F>
static void run_tasks(int64_t count, int64_t max_threads, const F& task) {
  if (count <= 0) return;
  const int64_t threads = std::min<int64_t>(std::min<int64_t>(at::get_num_threads(), max_threads), count);
  if (threads <= 1) {
    for (int64_t k = 0; k < count; ++k) task(k);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t k = next.fetch_add(1); k < count; k = next.fetch_add(1)) task(k);
  });
}

template <typename QT, typename KT>
static void decode_typed(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
                         const at::Tensor& table, const at::Tensor& reqs, const at::Tensor& items,
                         const at::Tensor& merges, double scale, double kv_scale, int64_t num_slots,
                         int64_t slot_lanes, int64_t threads, at::Tensor& out, at::Tensor& lse) {
  Call<QT, KT> c;
  c.ql = q_latent.const_data_ptr<QT>();
  c.qr = q_rope.const_data_ptr<QT>();
  c.ql_s0 = q_latent.stride(0), c.ql_s1 = q_latent.stride(1), c.ql_s2 = q_latent.stride(2);
  c.qr_s0 = q_rope.stride(0), c.qr_s1 = q_rope.stride(1), c.qr_s2 = q_rope.stride(2);
  c.out = out.mutable_data_ptr<QT>();
  c.o_s0 = out.stride(0), c.o_s1 = out.stride(1), c.o_s2 = out.stride(2);
  c.lse = lse.mutable_data_ptr<float>();
  c.l_s0 = lse.stride(0), c.l_s1 = lse.stride(1);
  c.cache = reinterpret_cast<const KT*>(cache.const_data_ptr());
  c.c_s0 = cache.stride(0), c.c_s1 = cache.stride(1), c.block_size = cache.size(1);
  c.table = table.const_data_ptr();
  c.table64 = table.scalar_type() == at::kLong;
  c.t_s0 = table.stride(0), c.t_s1 = table.stride(1);
  c.H = q_latent.size(1), c.r = q_latent.size(2), c.rope = q_rope.size(2), c.W = c.r + c.rope;
  c.scale = static_cast<float>(scale), c.kv_scale = static_cast<float>(kv_scale);
  c.reqs = reqs.const_data_ptr<int64_t>();
  at::Tensor partials;
  c.slot_lanes = slot_lanes;
  c.slot_floats = slot_lanes * (c.r + 2);
  if (num_slots > 0) {
    partials = at::empty({num_slots * c.slot_floats}, q_latent.options().dtype(at::kFloat));
    c.partials = partials.mutable_data_ptr<float>();
  } else {
    c.partials = nullptr;
  }
  const int64_t* it = items.const_data_ptr<int64_t>();
  const int64_t* mg = merges.const_data_ptr<int64_t>();
  run_tasks(items.size(0), threads, [&](int64_t k) { run_item(c, it + k * 6); });
  run_tasks(merges.size(0), threads, [&](int64_t k) { run_merge(c, mg + k * 5); });
}

static void check_int_table(const at::Tensor& t, const char* name, int64_t width) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 2 && t.size(1) == width &&
                  t.is_contiguous(),
              name, ": expected a contiguous CPU int64 tensor [n, ", width, "]");
}

void decode(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache, const at::Tensor& table,
            const at::Tensor& reqs, const at::Tensor& items, const at::Tensor& merges, double scale,
            double kv_scale, int64_t num_slots, int64_t slot_lanes, int64_t threads, at::Tensor out,
            at::Tensor lse) {
  TORCH_CHECK(q_latent.device().is_cpu() && q_rope.device().is_cpu() && cache.device().is_cpu() &&
                  out.device().is_cpu() && lse.device().is_cpu() && table.device().is_cpu(),
              "CPU_FUSED: every tensor must be on the CPU");
  TORCH_CHECK(q_latent.dim() == 3 && q_rope.dim() == 3 && out.dim() == 3 && lse.dim() == 2 && cache.dim() == 3 &&
                  table.dim() == 2,
              "CPU_FUSED: bad ranks");
  TORCH_CHECK(cache.stride(2) == 1 && cache.size(2) == q_latent.size(2) + q_rope.size(2),
              "CPU_FUSED: cache rows must be contiguous and [kv_lora_rank + rope] wide");
  TORCH_CHECK(q_latent.size(2) % DIM_MULTIPLE == 0 && q_rope.size(2) % DIM_MULTIPLE == 0,
              "CPU_FUSED: kv_lora_rank and rope must be multiples of ", DIM_MULTIPLE);
  TORCH_CHECK(q_rope.scalar_type() == q_latent.scalar_type() && out.scalar_type() == q_latent.scalar_type() &&
                  lse.scalar_type() == at::kFloat,
              "CPU_FUSED: q_rope and out in the query dtype, lse float32");
  TORCH_CHECK(table.scalar_type() == at::kInt || table.scalar_type() == at::kLong, "CPU_FUSED: int block table");
  check_int_table(reqs, "requests", 4);
  check_int_table(items, "items", 6);
  check_int_table(merges, "merges", 5);
  TORCH_CHECK(slot_lanes >= 0 && num_slots >= 0 && threads >= 1, "CPU_FUSED: bad partial slots or threads");

#define MLA_CPU_CACHE_CASES(QT)                                                                            \
  switch (cache.scalar_type()) {                                                                          \
    case at::kFloat:                                                                                      \
      return decode_typed<QT, float>(q_latent, q_rope, cache, table, reqs, items, merges, scale, kv_scale, \
                                     num_slots, slot_lanes, threads, out, lse);                                    \
    case at::kBFloat16:                                                                                   \
      return decode_typed<QT, c10::BFloat16>(q_latent, q_rope, cache, table, reqs, items, merges, scale,   \
                                             kv_scale, num_slots, slot_lanes, threads, out, lse);                  \
    case at::kHalf:                                                                                       \
      return decode_typed<QT, c10::Half>(q_latent, q_rope, cache, table, reqs, items, merges, scale,       \
                                         kv_scale, num_slots, slot_lanes, threads, out, lse);                      \
    case at::kFloat8_e4m3fn:                                                                              \
      return decode_typed<QT, Fp8E4M3>(q_latent, q_rope, cache, table, reqs, items, merges, scale,         \
                                       kv_scale, num_slots, slot_lanes, threads, out, lse);                        \
    case at::kFloat8_e5m2:                                                                                \
      return decode_typed<QT, Fp8E5M2>(q_latent, q_rope, cache, table, reqs, items, merges, scale,         \
                                       kv_scale, num_slots, slot_lanes, threads, out, lse);                        \
    default:                                                                                              \
      TORCH_CHECK(false, "CPU_FUSED: unsupported cache dtype ", cache.scalar_type());                      \
  }

  switch (q_latent.scalar_type()) {
    case at::kFloat: MLA_CPU_CACHE_CASES(float)
    case at::kBFloat16: MLA_CPU_CACHE_CASES(c10::BFloat16)
    case at::kHalf: MLA_CPU_CACHE_CASES(c10::Half)
    default: TORCH_CHECK(false, "CPU_FUSED: unsupported query dtype ", q_latent.scalar_type());
  }
#undef MLA_CPU_CACHE_CASES
}

// what this build was compiled for: "vector_width=<floats>;isa=<names>"
std::string build_info() {
  std::string isa;
#if defined(__AVX512F__)
  isa += "avx512f,";
#endif
#if defined(__AVX2__)
  isa += "avx2,";
#endif
#if defined(__FMA__)
  isa += "fma,";
#endif
#if defined(__F16C__)
  isa += "f16c,";
#endif
#if defined(__ARM_NEON)
  isa += "neon,";
#endif
  if (!isa.empty()) isa.pop_back();
  return "vector_width=" + std::to_string(VW) + ";isa=" + (isa.empty() ? std::string("generic") : isa);
}

}  // namespace mla_cpu_fused

TORCH_LIBRARY(mla_backends_cpu_fused, m) {
  m.def(
      "decode(Tensor q_latent, Tensor q_rope, Tensor cache, Tensor block_table, Tensor requests, Tensor items, "
      "Tensor merges, float scale, float kv_scale, int num_slots, int slot_lanes, int threads, "
      "Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("build_info() -> str", &mla_cpu_fused::build_info);
}

TORCH_LIBRARY_IMPL(mla_backends_cpu_fused, CPU, m) { m.impl("decode", &mla_cpu_fused::decode); }
