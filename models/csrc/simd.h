// What the kernel files share (linear.cpp, quant_linear.cpp, kvcache/csrc/paged_attention.cpp): the
// ISA preamble, vectors of one register, and each kernel's register tiles, fixed at compile time by
// the level a library is built for (models/native/toolchain.py builds one library per level). This
// text is part of every library's build hash.
#pragma once

#include <cstdint>

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

}  // namespace
