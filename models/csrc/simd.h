// What the kernel files share (linear.cpp, quant_linear.cpp, kvcache/csrc/paged_attention.cpp): the
// ISA preamble, vectors of one register, and each kernel's register tiles, fixed at compile time by
// the level a library is built for (models/native/toolchain.py builds one library per level). This
// text is part of every library's build hash.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif
#if defined(__AVX512BF16__)
#define ATTNSERVE_BF16_DOT 1  // bf16 pairs multiplied straight from memory (vdpbf16ps), fp32 accumulation
#else
#define ATTNSERVE_BF16_DOT 0
#endif

namespace {

// W: floats per vector, one register of the level. Register tiles: rows of x per tile, as many as
// let a tile's accumulators, its weight vectors and a broadcast fit the registers (32 at AVX-512; 16
// at AVX2 and the portable build, where more rows spill: 6 panel rows at AVX2 are 25% slower at prefill).
#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int PANEL_MAX_ROWS = 12;  // linear.cpp: R x 2 accumulators, 2 x 2 weight vectors, a broadcast
constexpr int QUANT_CODE_ROWS = 4;  // quant_linear.cpp's code tiles: R x NP accumulators, 2 x as many group sums, the codes
#elif defined(__AVX2__)
constexpr int W = 8;  // NOTE: one register per vector: a wider W spills the tile loops' accumulators
constexpr int PANEL_MAX_ROWS = 5;
constexpr int QUANT_CODE_ROWS = 2;
#else
constexpr int W = 4;  // SSE2 on x86-64, NEON on aarch64
constexpr int PANEL_MAX_ROWS = 5;
constexpr int QUANT_CODE_ROWS = 2;
#endif

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint8_t vb __attribute__((vector_size(W * sizeof(uint8_t))));
typedef int8_t vsb __attribute__((vector_size(W * sizeof(int8_t))));

// x in every lane: a broadcast (`vf{} + x` would be an add: 0 + -0 is +0, so it cannot be folded away)
inline vf splat(float x) { return __builtin_shuffle(vf{x}, vi{}); }

// a * b + c with one rounding where the level has FMA (x86-64-v3 and up, aarch64), else two. Spelled out
// where two kernels must round alike: a library built with -ffp-contract=off fuses only these.
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
  return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
  return a * b + c;
#endif
}

// v, loaded once into a register: GCC otherwise folds the load into each FMA that reads v, one load per row of
// a tile, and a tile of few rows is then bound by loads (AVX2, the exact quantized linear's widened codes: about 3/4
// of the speed)
inline vf in_register(vf v) {
#if defined(__x86_64__)
  asm("" : "+v"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}

// The largest lane, and the sum of the int lanes: a few shuffles, not a loop over W lanes
inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX2__)
  __m128 m = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
#else
  float m = v[0];
  for (int l = 1; l < W; ++l) m = m > v[l] ? m : v[l];
  return m;
#endif
}

inline int32_t hsum(vi v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_epi32((__m512i)v);
#elif defined(__AVX2__)
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
#else
  int32_t s = 0;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
#endif
}

// bf16 is fp32's upper half: W of them widened exactly
inline vf load_bf16(const void* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// fp32 -> bf16 bits, rounded to nearest even, NaN kept quiet: as c10::BFloat16(float) and Tensor.to round
inline vu to_bf16_bits(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu rounded = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
  return v != v ? vu{} + 0x7fc0u : rounded;
}

inline void store_bf16(void* p, vf v) {
  const vh h = __builtin_convertvector(to_bf16_bits(v), vh);
  std::memcpy(p, &h, sizeof h);
}

// W signed bytes widened to floats (exactly): the vector extensions' convert went lane by lane here
inline vf load_i8_f(const void* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p))));
#else
  vf v;
  for (int j = 0; j < W; ++j) v[j] = float(static_cast<const int8_t*>(p)[j]);
  return v;
#endif
}

inline vf load_f(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// W values of a kernel's element type (fp32 or bf16) as fp32, and back (bf16 rounded to nearest even)
inline vf load_vec(const float* p) { return load_f(p); }
inline vf load_vec(const c10::BFloat16* p) { return load_bf16(p); }
inline void store_vec(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline void store_vec(c10::BFloat16* p, vf v) { store_bf16(p, v); }

// e^y: 2^n * e^r with |r| <= ln2 / 2, e^r to degree 6 (relative error about 1e-7, against libm's 0.5 ulp);
// 0 below -87, inf above 88.7. Where libm's would round to a bf16 or a sum differently is rare and one ulp.
inline vf exp_vf(vf y) {
  const vf low = splat(-87.0f), high = splat(88.7f);
  const vi under = y < low, over = y > high;
  y = y < low ? low : y;
  y = y > high ? high : y;
  const vf shift = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = y * splat(1.44269504f) + shift;
  const vf n = t - shift;
  const vf r = (y - n * splat(0.693145752f)) - n * splat(1.42860677e-06f);
  vf p = splat(1.0f / 720);
  p = p * r + splat(1.0f / 120);
  p = p * r + splat(1.0f / 24);
  p = p * r + splat(1.0f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  vi bits;
  std::memcpy(&bits, &t, sizeof bits);
  const vi scale = (bits - 0x4B400000 + 127) << 23;  // 2^n: t's low mantissa bits hold n
  vf two_n;
  std::memcpy(&two_n, &scale, sizeof two_n);
  const vf e = p * two_n;
  return under ? vf{} : over ? splat(__builtin_inff()) : e;
}

// Byte vectors of one register (W lanes x 4 bytes) and their integer dot products: what the 8-bit-activation
// kernels (q8_linear.cpp) multiply codes with. dot_us: per 32-bit lane, acc + the 4 products of unsigned u and
// signed s bytes (AVX-512 VNNI: vpdpbusd; AVX2 and AVX-512BW: vpmaddubsw + vpmaddwd); dot_ss the same for signed
// w (|w| times x with w's sign). The portable build does the same arithmetic lane by lane.
#if defined(__AVX512BW__)
typedef __m512i vq;
inline vq load_q(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vq bcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}
inline vq zero_q() { return _mm512_setzero_si512(); }
inline vq splat_q(int32_t v) { return _mm512_set1_epi32(v); }
inline vq flip_signs(vq w) { return _mm512_xor_si512(w, _mm512_set1_epi8(-128)); }  // w + 128, as unsigned bytes
// 16 bytes in every 128-bit lane, and each byte of idx (0..15) replaced by its entry: vpshufb's table lookup
inline vq table16(const int8_t* t) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
inline vq lookup16(vq table, vq idx) { return _mm512_shuffle_epi8(table, idx); }
// acc + per 32-bit lane the sum of 4 products of unsigned u and signed s bytes
inline vq dot_us(vq acc, vq u, vq s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
// the same for signed w: |w| times x with w's sign (|w| <= 128, |x| <= 127: no int16 overflow)
inline vq dot_ss(vq acc, vq w, vq x) {
  const __mmask64 negative = _mm512_movepi8_mask(w);
  return dot_us(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x));
}
inline void nibbles(vq c, vq& lo, vq& hi) {
  const vq mask = _mm512_set1_epi8(15);
  lo = _mm512_and_si512(c, mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
}
inline vf to_float(vq i) { return (vf)_mm512_cvtepi32_ps(i); }
// 4-bit codes: pairs of products summed in int16 lanes, several steps before one widening to int32
inline vq pairs_us(vq u, vq s) { return _mm512_maddubs_epi16(u, s); }
inline vq add16(vq a, vq b) { return _mm512_add_epi16(a, b); }
inline vq widen16(vq acc, vq p) { return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1))); }
inline vq add_q(vq a, vq b) { return _mm512_add_epi32(a, b); }
inline vq and_q(vq a, vq b) { return _mm512_and_si512(a, b); }
inline vq or_q(vq a, vq b) { return _mm512_or_si512(a, b); }
inline vq splat8(uint8_t v) { return _mm512_set1_epi8(char(v)); }
template <int S>  // 16-bit lanes shifted left by S (right by -S)
inline vq shift16(vq v) {
  if constexpr (S >= 0) return _mm512_slli_epi16(v, S);
  else return _mm512_srli_epi16(v, -S);
}
#elif defined(__AVX2__)
typedef __m256i vq;
inline vq load_q(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vq bcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}
inline vq zero_q() { return _mm256_setzero_si256(); }
inline vq dot_us(vq acc, vq u, vq s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline vq dot_ss(vq acc, vq w, vq x) { return dot_us(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
inline vq table16(const int8_t* t) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}
inline vq lookup16(vq table, vq idx) { return _mm256_shuffle_epi8(table, idx); }
inline void nibbles(vq c, vq& lo, vq& hi) {
  const vq mask = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(c, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
}
inline vf to_float(vq i) { return (vf)_mm256_cvtepi32_ps(i); }
inline vq pairs_us(vq u, vq s) { return _mm256_maddubs_epi16(u, s); }
inline vq add16(vq a, vq b) { return _mm256_add_epi16(a, b); }
inline vq widen16(vq acc, vq p) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1))); }
inline vq splat_q(int32_t v) { return _mm256_set1_epi32(v); }
inline vq add_q(vq a, vq b) { return _mm256_add_epi32(a, b); }
inline vq and_q(vq a, vq b) { return _mm256_and_si256(a, b); }
inline vq or_q(vq a, vq b) { return _mm256_or_si256(a, b); }
inline vq splat8(uint8_t v) { return _mm256_set1_epi8(char(v)); }
template <int S>
inline vq shift16(vq v) {
  if constexpr (S >= 0) return _mm256_slli_epi16(v, S);
  else return _mm256_srli_epi16(v, -S);
}
#else
// the portable build: the same arithmetic, lane by lane
struct vq {
  alignas(16) uint8_t b[W * 4];
  int32_t acc[W];
};
inline vq load_q(const uint8_t* p) {
  vq v{};
  std::memcpy(v.b, p, W * 4);
  return v;
}
inline vq bcast4(const int8_t* x) {
  vq v{};
  for (int j = 0; j < W; ++j) std::memcpy(v.b + 4 * j, x, 4);
  return v;
}
inline vq zero_q() { return vq{}; }
inline vq dot_us(vq acc, vq u, vq s) {
  for (int j = 0; j < W; ++j)
    for (int t = 0; t < 4; ++t) acc.acc[j] += int32_t(u.b[4 * j + t]) * int32_t(int8_t(s.b[4 * j + t]));
  return acc;
}
inline vq dot_ss(vq acc, vq w, vq x) {
  for (int j = 0; j < W; ++j)
    for (int t = 0; t < 4; ++t) acc.acc[j] += int32_t(int8_t(w.b[4 * j + t])) * int32_t(int8_t(x.b[4 * j + t]));
  return acc;
}
inline vq table16(const int8_t* t) {
  vq v{};
  std::memcpy(v.b, t, 16);
  return v;
}
inline vq lookup16(vq table, vq idx) {
  for (int i = 0; i < W * 4; ++i) idx.b[i] = table.b[idx.b[i] & 15];
  return idx;
}
inline void nibbles(vq c, vq& lo, vq& hi) {
  for (int i = 0; i < W * 4; ++i) {
    lo.b[i] = c.b[i] & 15;
    hi.b[i] = c.b[i] >> 4;
  }
}
inline vf to_float(vq i) {
  vf v;
  for (int j = 0; j < W; ++j) v[j] = float(i.acc[j]);
  return v;
}
inline vq splat_q(int32_t v) {
  vq q{};
  for (int j = 0; j < W; ++j) q.acc[j] = v;
  return q;
}
inline vq add_q(vq a, vq b) {
  for (int j = 0; j < W; ++j) a.acc[j] += b.acc[j];
  return a;
}
inline vq and_q(vq a, vq b) {
  for (int i = 0; i < W * 4; ++i) a.b[i] &= b.b[i];
  return a;
}
inline vq or_q(vq a, vq b) {
  for (int i = 0; i < W * 4; ++i) a.b[i] |= b.b[i];
  return a;
}
inline vq splat8(uint8_t v) {
  vq q{};
  std::memset(q.b, v, sizeof q.b);
  return q;
}
template <int S>
inline vq shift16(vq v) {
  for (int i = 0; i < W * 4; i += 2) {
    uint16_t h;
    std::memcpy(&h, v.b + i, 2);
    h = S >= 0 ? uint16_t(h << S) : uint16_t(h >> -S);
    std::memcpy(v.b + i, &h, 2);
  }
  return v;
}
// declared only: PAIRS16 is off here, so nothing calls them
vq pairs_us(vq u, vq s);
vq add16(vq a, vq b);
vq widen16(vq acc, vq p);
#endif

}  // namespace
