// Linears with weight-only quantized weights (models/quant_linear.py): integer codes with a scale
// and an offset per group of `group_size` inputs, w = code * scale + offset (models/quant_formats.py
// maps every GGUF type and our int8 / int4 schemes onto that). Activations stay fp32 (bf16 ones are
// widened first): the results are those of the dequantized weights, up to the order of the sums.
//
// Packing: panels of W output features (one vector), as models/csrc/linear.cpp, in quads of four
// panels whose rows interleave, so that a one-row tile over a quad reads one sequential stream:
//   8-bit codes: [quad][k][4][W] int8.
//   4-bit codes: [quad][k / 32][16][4][W] bytes, byte (i, j) = code(j, 32c + i) | code(j, 32c + i + 16) << 4:
//   one load of W bytes widens to two vectors (a mask and a shift), at k and k + 16.
//   NOTE: measured (AVX2, 1 thread, weights out of cache): four panels side by side read as four
//   streams of W-byte loads ran at 4.5 GB/s, interleaved as one stream at 9-10 GB/s.
//   scales, offsets: [panel][group][W], fp16 where every value is one (a GGUF's Q4_0, Q4_1, Q8_0,
//   Q5_0, Q5_1: as few bytes as the file), else fp32; no offsets at all for symmetric formats.
// Two ways through, by the number of rows of x:
//   few rows (decode): codes widened to fp32 in registers, multiplied into per-group sums, each
//   group's sum scaled once: sum_g scale * (x . code) + offset * sum(x over the group);
//   more rows: each pair of panels is dequantized once into fp32 in cache, then multiplied by
//   register tiles of many rows, so the widening is paid once per weight, not once per row. With
//   bf16 activations on an AVX512-BF16 build the dequantized panels are rounded to bf16 pairs and
//   multiplied with vdpbf16ps (twice fp32's rate), as a bf16 model's own weights are.
#include <torch/library.h>

#include <array>
#include <vector>

#include "quant_panels.h"

namespace {

constexpr int MAX_ROWS = QUANT_MAX_ROWS;
constexpr int DIRECT_ROWS = QUANT_CODE_ROWS;
constexpr int64_t ROW_CHUNK = 64;  // x rows per dequantized pair of panels (the pair stays in L2)
constexpr int64_t DIRECT_MAX_M = 8;  // up to this many rows of x: code tiles (measured: AVX2 and AVX-512); above: dequantize

constexpr int64_t BF16_DOT_MIN_M = DIRECT_MAX_M;  // bf16 x on AVX512-BF16: bf16 tiles above this many rows (measured: dequantizing costs as much as 8-16 rows of code tiles)

// NOTE: intrinsics where the ISA has a byte -> int32 widening load: GCC scalarizes
// __builtin_convertvector from byte vectors (about 10x slower at decode)
#if defined(__AVX512F__)
inline vi bytes_i8(const uint8_t* p) {
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi bytes_u8(const uint8_t* p) {
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#elif defined(__AVX2__)
inline vi bytes_i8(const uint8_t* p) {
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vi bytes_u8(const uint8_t* p) {
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#else
inline vi bytes_i8(const uint8_t* p) {
  vsb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
}
inline vi bytes_u8(const uint8_t* p) {
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
}
#endif

inline vf widen_i8(const uint8_t* p) { return __builtin_convertvector(bytes_i8(p), vf); }

// W bytes of two nibbles: the low ones (at k) and the high ones (at k + 16), as floats
inline void widen_u4(const uint8_t* p, vf& lo, vf& hi) {
  const vi i = bytes_u8(p);
  lo = __builtin_convertvector(i & 15, vf);
  hi = __builtin_convertvector(i >> 4, vf);
}

constexpr int64_t ROW_STRIDE = QUAD * W;  // bytes from one row of a panel's codes to its next

struct Packed {
  const uint8_t* codes;
  const void* scales;  // fp32 or fp16
  const void* offsets;  // as scales, or nullptr (symmetric)
  int64_t k_dim, group, groups, panel_bytes;  // panel_bytes: one panel's codes

  const uint8_t* panel(int64_t p) const { return codes + panel_offset(p, panel_bytes, W); }
};

// Code tile: y[r, panel p0 + p] for R rows of x, NP panels, straight from the codes.
// xs: (rows, groups) sums of x over each group (the offsets' factor).
template <typename F, int R, int NP>
void code_tile(const float* x, const float* xs, const Packed& w, int64_t p0, float* y, int64_t n,
               const float* bias) {
  const int64_t k_dim = w.k_dim;
  vf acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vf{};
  const uint8_t* codes[NP];
  for (int p = 0; p < NP; ++p) codes[p] = w.panel(p0 + p);
  for (int64_t g = 0; g < w.groups; ++g) {
    // NOTE: two sums per output vector (k and k + 16; even and odd k): two FMA chains, not one,
    // so the FMAs' latency is hidden at one row
    vf sum[R][NP], sum2[R][NP];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) sum[r][p] = sum2[r][p] = vf{};
    const int64_t k0 = g * w.group;
    if constexpr (F::BITS == 8) {
      for (int64_t k = k0; k < k0 + w.group; k += 2) {  // NOTE: groups are even (16 and up)
        for (int p = 0; p < NP; ++p) {
          __builtin_prefetch(codes[p] + (k + 16) * ROW_STRIDE, 0, 0);
          const vf c = widen_i8(codes[p] + k * ROW_STRIDE);
          const vf c2 = widen_i8(codes[p] + (k + 1) * ROW_STRIDE);
          for (int r = 0; r < R; ++r) {
            sum[r][p] += x[r * k_dim + k] * c;
            sum2[r][p] += x[r * k_dim + k + 1] * c2;
          }
        }
      }
    } else {
      for (int64_t c0 = k0; c0 < k0 + w.group; c0 += 32) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t at = (c0 / 2 + i) * ROW_STRIDE;  // 16 rows of W bytes per 32 k
          for (int p = 0; p < NP; ++p) {
            __builtin_prefetch(codes[p] + at + 16 * ROW_STRIDE, 0, 0);
            vf lo, hi;
            widen_u4(codes[p] + at, lo, hi);
            for (int r = 0; r < R; ++r) {
              sum[r][p] += x[r * k_dim + c0 + i] * lo;
              sum2[r][p] += x[r * k_dim + c0 + i + 16] * hi;
            }
          }
        }
      }
    }
    for (int p = 0; p < NP; ++p) {
      const int64_t at = ((p0 + p) * w.groups + g) * W;
      const vf s = load_scales<F::HALF>(w.scales, at);
      for (int r = 0; r < R; ++r) acc[r][p] += (sum[r][p] + sum2[r][p]) * s;
      if constexpr (F::OFFSET) {
        const vf o = load_scales<F::HALF>(w.offsets, at);
        for (int r = 0; r < R; ++r) acc[r][p] += xs[r * w.groups + g] * o;
      }
    }
  }
  store_tile<R, NP>(acc, y, n, p0 * W, bias);
}

// Panel p's weights as fp32, [k][W], into out.
template <typename F>
void dequantize_panel(const Packed& w, int64_t p, float* out) {
  const uint8_t* codes = w.panel(p);
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t at = (p * w.groups + g) * W, k0 = g * w.group;
    const vf s = load_scales<F::HALF>(w.scales, at);
    const vf o = F::OFFSET ? load_scales<F::HALF>(w.offsets, at) : vf{};
    if constexpr (F::BITS == 8) {
      for (int64_t k = k0; k < k0 + w.group; ++k) {
        const vf v = widen_i8(codes + k * ROW_STRIDE) * s + o;
        std::memcpy(out + k * W, &v, sizeof v);
      }
    } else {
      for (int64_t c0 = k0; c0 < k0 + w.group; c0 += 32)
        for (int64_t i = 0; i < 16; ++i) {
          vf lo, hi;
          widen_u4(codes + (c0 / 2 + i) * ROW_STRIDE, lo, hi);
          lo = lo * s + o;
          hi = hi * s + o;
          std::memcpy(out + (c0 + i) * W, &lo, sizeof lo);
          std::memcpy(out + (c0 + i + 16) * W, &hi, sizeof hi);
        }
    }
  }
}

// fp32 tile over two dequantized panels wp ([2][k][W]): y[r, n0 ..) for R rows.
template <int R>
void fp32_tile(const float* x, int64_t k_dim, const float* wp, float* y, int64_t n, int64_t n0, const float* bias) {
  vf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf{};
  const float* w1 = wp + k_dim * W;
  for (int64_t k = 0; k < k_dim; ++k) {
    const vf a = load_f(wp + k * W), b = load_f(w1 + k * W);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * k_dim + k];
      acc[r][0] += xv * a;
      acc[r][1] += xv * b;
    }
  }
  store_tile<R, 2>(acc, y, n, n0, bias);
}

using Fp32TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, const float*);

template <int... R>
constexpr std::array<Fp32TileFn, sizeof...(R)> fp32_tiles(std::integer_sequence<int, R...>) {
  return {&fp32_tile<R + 1>...};
}
constexpr auto FP32_TILES = fp32_tiles(std::make_integer_sequence<int, MAX_ROWS>{});

#if ATTNSERVE_BF16_DOT
// fp32 panel [k][W] -> bf16 k pairs [k / 2][W][2] (k_dim even): the layout vdpbf16ps multiplies
inline void to_bf16_pairs(const float* in, int64_t k_dim, uint16_t* out) {
  alignas(64) static constexpr uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(interleave);
  for (int64_t k2 = 0; k2 < k_dim / 2; ++k2) {
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + (2 * k2 + 1) * W), _mm512_loadu_ps(in + 2 * k2 * W));
    _mm512_storeu_si512(out + k2 * 2 * W, _mm512_permutexvar_epi16(idx, (__m512i)both));  // round to nearest even
  }
}

// bf16 tile over two panels of bf16 pairs wp ([2][k / 2][W][2]): y[r, n0 ..) for R rows of bf16 x.
template <int R>
void bf16_tile(const uint16_t* x, int64_t k_dim, const uint16_t* wp, float* y, int64_t n, int64_t n0,
               const float* bias) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint16_t* w1 = wp + k_dim * W;
  for (int64_t k2 = 0; k2 < k_dim / 2; ++k2) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(wp + k2 * 2 * W), b = (__m512bh)_mm512_loadu_si512(w1 + k2 * 2 * W);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k_dim + 2 * k2, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, a);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, b);
    }
  }
  vf out[R][2];
  std::memcpy(out, acc, sizeof out);
  store_tile<R, 2>(out, y, n, n0, bias);
}

using Bf16TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, float*, int64_t, int64_t, const float*);

template <int... R>
constexpr std::array<Bf16TileFn, sizeof...(R)> bf16_tiles(std::integer_sequence<int, R...>) {
  return {&bf16_tile<R + 1>...};
}
constexpr auto BF16_TILES = bf16_tiles(std::make_integer_sequence<int, MAX_ROWS>{});
#endif

using CodeTileFn = void (*)(const float*, const float*, const Packed&, int64_t, float*, int64_t, const float*);

// One row: a quad's four panels at once (four independent chains per group, one stream of codes);
// more rows: two panels.
template <typename F, int... R>
constexpr std::array<CodeTileFn, sizeof...(R)> code_tiles(std::integer_sequence<int, R...>) {
  return {(R == 0 ? &code_tile<F, 1, 4> : &code_tile<F, R + 1, 2>)...};
}

// Quads [u0, u1) of the output. x: fp32 rows (the code tiles, fp32 tiles); xb: the same rows in
// bf16 for bf16 tiles, or nullptr.
template <typename F>
void run(const Packed& w, const float* x, const uint16_t* xb, const float* xs, int64_t m, float* y, int64_t n,
         const float* bias, int64_t u0, int64_t u1) {
  // q: pairs of panels. NOTE: a quad's padding may hold whole pairs past n: never computed
  const int64_t k_dim = w.k_dim, q0 = 2 * u0, q1 = std::min(2 * u1, (n + 2 * W - 1) / (2 * W));
  if (m <= DIRECT_MAX_M && xb == nullptr) {
    static constexpr auto tiles = code_tiles<F>(std::make_integer_sequence<int, DIRECT_ROWS>{});
    if (m == 1) {
      for (int64_t u = u0; u < u1; ++u) tiles[0](x, xs, w, u * QUAD, y, n, bias);
      return;
    }
    for (int64_t p = 2 * q0; p < 2 * q1; p += 2)
      row_blocks(m, DIRECT_ROWS, [&](int64_t r, int nr) {
        if (nr == 1)
          code_tile<F, 1, 2>(x + r * k_dim, xs + r * w.groups, w, p, y + r * n, n, bias);
        else
          tiles[nr - 1](x + r * k_dim, xs + r * w.groups, w, p, y + r * n, n, bias);
      });
    return;
  }
  std::vector<float> buf(2 * k_dim * W);
#if ATTNSERVE_BF16_DOT
  if (xb != nullptr) {
    std::vector<uint16_t> pairs(2 * k_dim * W);
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
      const int64_t rows = std::min(m - r0, ROW_CHUNK);
      for (int64_t q = q0; q < q1; ++q) {
        for (int64_t half = 0; half < 2; ++half) {
          dequantize_panel<F>(w, 2 * q + half, buf.data());
          to_bf16_pairs(buf.data(), k_dim, pairs.data() + half * k_dim * W);
        }
        row_blocks(rows, MAX_ROWS, [&](int64_t r, int nr) {
          BF16_TILES[nr - 1](xb + (r0 + r) * k_dim, k_dim, pairs.data(), y + (r0 + r) * n, n, 2 * q * W, bias);
        });
      }
    }
    return;
  }
#endif
  for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
    const int64_t rows = std::min(m - r0, ROW_CHUNK);
    for (int64_t q = q0; q < q1; ++q) {
      dequantize_panel<F>(w, 2 * q, buf.data());
      dequantize_panel<F>(w, 2 * q + 1, buf.data() + k_dim * W);
      row_blocks(rows, MAX_ROWS, [&](int64_t r, int nr) {
        FP32_TILES[nr - 1](x + (r0 + r) * k_dim, k_dim, buf.data(), y + (r0 + r) * n, n, 2 * q * W, bias);
      });
    }
  }
}

using RunFn = void (*)(const Packed&, const float*, const uint16_t*, const float*, int64_t, float*, int64_t,
                       const float*, int64_t, int64_t);

RunFn format_runner(int64_t bits, bool half, bool offsets) {
  const RunFn fns[2][2][2] = {{{&run<Fmt<4, false, false>>, &run<Fmt<4, false, true>>},
                               {&run<Fmt<4, true, false>>, &run<Fmt<4, true, true>>}},
                              {{&run<Fmt<8, false, false>>, &run<Fmt<8, false, true>>},
                               {&run<Fmt<8, true, false>>, &run<Fmt<8, true, true>>}}};
  return fns[bits == 8][half][offsets];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack(const at::Tensor& q, const at::Tensor& scale,
                                                    const std::optional<at::Tensor>& offset, int64_t bits,
                                                    int64_t group) {
  TORCH_CHECK(bits == 8 || group % 32 == 0, "4-bit codes need groups of a multiple of 32");
  TORCH_CHECK(group % 2 == 0, "groups must be even (the code tiles take k in pairs)");
  return pack_panels(q, scale, offset, bits, group, [bits](uint8_t* dst, int64_t p, int64_t panel_bytes, int64_t j,
                                                           const int8_t* row, int64_t k_dim) {
    uint8_t* panel = dst + panel_offset(p, panel_bytes, W);
    for (int64_t k = 0; k < k_dim; ++k) {
      if (bits == 8) {
        panel[k * ROW_STRIDE + j] = uint8_t(row[k]);
      } else {
        const int64_t c = k / 32, i = k % 32;
        panel[(c * 16 + i % 16) * ROW_STRIDE + j] |= uint8_t(row[k] << (i < 16 ? 0 : 4));
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                  const std::optional<at::Tensor>& bias, int64_t bits, int64_t group, int64_t out_features) {
  const auto [m, groups] = check_packed(x, codes, scales, offsets, bits, group, out_features);
  const int64_t k_dim = x.size(-1);
  const bool half = scales.scalar_type() == at::kHalf, has_offsets = offsets.numel() > 0;
  // NOTE: bf16 x, many rows, an AVX512-BF16 build: bf16 tiles (k_dim is even: groups are)
  const bool bf16_dot = ATTNSERVE_BF16_DOT && x.scalar_type() == at::kBFloat16 && m > BF16_DOT_MIN_M;
  const at::Tensor xc = (bf16_dot ? x : x.to(at::kFloat)).reshape({-1, k_dim}).contiguous();  // (M, K)
  const LinearOut out = linear_out(x, m, out_features, bias);
  if (m > 0) {
    const float* xp = bf16_dot ? nullptr : xc.data_ptr<float>();
    const uint16_t* xbp = bf16_dot ? reinterpret_cast<const uint16_t*>(xc.data_ptr()) : nullptr;
    std::vector<float> xs;  // (M, groups): each group's sum of x, for the offsets
    if (m <= DIRECT_MAX_M && !bf16_dot && has_offsets) {
      xs.assign(m * groups, 0.f);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          float s = 0.f;
          for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xp[r * k_dim + k];
          xs[r * groups + g] = s;
        }
    }
    const Packed w{codes.data_ptr<uint8_t>(), scales.data_ptr(), has_offsets ? offsets.data_ptr() : nullptr, k_dim,
                   group, groups, codes.size(1)};
    float* yp = out.y.data_ptr<float>();
    const float* bp = out.bias_ptr();
    // NOTE: whole quads of panels per task: no tile straddles two threads
    const auto fn = format_runner(bits, half, has_offsets);
    at::parallel_for(0, codes.size(0) / QUAD, 1, [&](int64_t u0, int64_t u1) {
      fn(w, xp, xbp, xs.data(), m, yp, out_features, bp, u0, u1);
    });
  }
  return out.result(x);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("quant_linear", &linear);
  m.impl("pack_quant", &pack);
}
