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
// Two ways through, by the number of rows of x, with one formula, so that a row's result is the same
// bit for bit whatever the number of rows (batch invariance: neither batching nor speculation changes a
// greedy token): per group, x . code in two chains (k and k + 16, or even and odd k), their sum times
// the group's scale, plus the group's sum of x times its offset: sum_g scale * (x . code) + offset * sum(x).
//   few rows (decode): codes widened to fp32 in registers, straight from the packed bytes;
//   more rows: each pair of panels has its codes widened once into fp32 in cache, then register tiles
//   of several rows take the same steps, so the widening is paid once per weight, not once per row.
// bf16 activations are widened to fp32 first. The library is built with -ffp-contract=off: only the
// multiply-adds spelled out (fmadd) are fused, alike in both ways.
#include <torch/library.h>

#include <array>
#include <vector>

#include "group_scales.h"

namespace {

constexpr int DIRECT_ROWS = QUANT_CODE_ROWS;
constexpr int64_t ROW_CHUNK = 64;  // x rows per widened pair of panels (the pair stays in L2)
constexpr int64_t DIRECT_MAX_M = 8;  // up to this many rows of x: code tiles (measured: AVX2 and AVX-512); above: widen once

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

// Code tile: y[r, panel p0 + p] for R rows of x, NP panels. WIDE: the codes come from a pair of panels
// widened once into fp32 (`wide`: [2][k][W], panels p0 and p0 + 1), else straight from the packed
// bytes. The same values and the same steps either way. xs: (rows, groups) sums of x over each group
// (the offsets' factor).
template <typename F, int R, int NP, bool WIDE>
void code_tile(const float* x, const float* xs, const Packed& w, int64_t p0, const float* wide, float* y, int64_t n,
               const float* bias) {
  const int64_t k_dim = w.k_dim;
  vf acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vf{};
  const uint8_t* codes[NP];
  const float* wides[NP];
  for (int p = 0; p < NP; ++p) {
    codes[p] = w.panel(p0 + p);
    wides[p] = wide + p * k_dim * W;
  }
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
          vf c, c2;
          if constexpr (WIDE) {
            c = in_register(load_f(wides[p] + k * W));
            c2 = in_register(load_f(wides[p] + (k + 1) * W));
          } else {
            __builtin_prefetch(codes[p] + (k + 16) * ROW_STRIDE, 0, 0);
            c = widen_i8(codes[p] + k * ROW_STRIDE);
            c2 = widen_i8(codes[p] + (k + 1) * ROW_STRIDE);
          }
          for (int r = 0; r < R; ++r) {
            sum[r][p] = fmadd(splat(x[r * k_dim + k]), c, sum[r][p]);
            sum2[r][p] = fmadd(splat(x[r * k_dim + k + 1]), c2, sum2[r][p]);
          }
        }
      }
    } else {
      for (int64_t c0 = k0; c0 < k0 + w.group; c0 += 32) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t at = (c0 / 2 + i) * ROW_STRIDE;  // 16 rows of W bytes per 32 k
          for (int p = 0; p < NP; ++p) {
            vf lo, hi;
            if constexpr (WIDE) {
              lo = in_register(load_f(wides[p] + (c0 + i) * W));
              hi = in_register(load_f(wides[p] + (c0 + i + 16) * W));
            } else {
              __builtin_prefetch(codes[p] + at + 16 * ROW_STRIDE, 0, 0);
              widen_u4(codes[p] + at, lo, hi);
            }
            for (int r = 0; r < R; ++r) {
              sum[r][p] = fmadd(splat(x[r * k_dim + c0 + i]), lo, sum[r][p]);
              sum2[r][p] = fmadd(splat(x[r * k_dim + c0 + i + 16]), hi, sum2[r][p]);
            }
          }
        }
      }
    }
    for (int p = 0; p < NP; ++p) {
      const int64_t at = ((p0 + p) * w.groups + g) * W;
      const vf s = load_scales<F::HALF>(w.scales, at);
      for (int r = 0; r < R; ++r) acc[r][p] = fmadd(sum[r][p] + sum2[r][p], s, acc[r][p]);
      if constexpr (F::OFFSET) {
        const vf o = load_scales<F::HALF>(w.offsets, at);
        for (int r = 0; r < R; ++r) acc[r][p] = fmadd(splat(xs[r * w.groups + g]), o, acc[r][p]);
      }
    }
  }
  store_tile<R, NP>(acc, y, n, p0 * W, bias);
}

// Panel p's codes as fp32, [k][W] (k in order), into out: exact small integers.
template <typename F>
void widen_panel(const Packed& w, int64_t p, float* out) {
  const uint8_t* codes = w.panel(p);
  if constexpr (F::BITS == 8) {
    for (int64_t k = 0; k < w.k_dim; ++k) {
      const vf v = widen_i8(codes + k * ROW_STRIDE);
      std::memcpy(out + k * W, &v, sizeof v);
    }
  } else {
    for (int64_t c0 = 0; c0 < w.k_dim; c0 += 32)
      for (int64_t i = 0; i < 16; ++i) {
        vf lo, hi;
        widen_u4(codes + (c0 / 2 + i) * ROW_STRIDE, lo, hi);
        std::memcpy(out + (c0 + i) * W, &lo, sizeof lo);
        std::memcpy(out + (c0 + i + 16) * W, &hi, sizeof hi);
      }
  }
}

using CodeTileFn = void (*)(const float*, const float*, const Packed&, int64_t, const float*, float*, int64_t,
                            const float*);

// One row: a quad's four panels at once (four independent chains per group, one stream of codes);
// more rows: two panels.
template <typename F, bool WIDE, int... R>
constexpr std::array<CodeTileFn, sizeof...(R)> code_tiles(std::integer_sequence<int, R...>) {
  return {(R == 0 && !WIDE ? &code_tile<F, 1, 4, false> : &code_tile<F, R + 1, 2, WIDE>)...};
}

// Quads [u0, u1) of the output for the fp32 rows x.
template <typename F>
void run(const Packed& w, const float* x, const float* xs, int64_t m, float* y, int64_t n, const float* bias,
         int64_t u0, int64_t u1) {
  // q: pairs of panels. NOTE: a quad's padding may hold whole pairs past n: never computed
  const int64_t k_dim = w.k_dim, q0 = 2 * u0, q1 = std::min(2 * u1, (n + 2 * W - 1) / (2 * W));
  if (m <= DIRECT_MAX_M) {
    static constexpr auto tiles = code_tiles<F, false>(std::make_integer_sequence<int, DIRECT_ROWS>{});
    if (m == 1) {
      for (int64_t u = u0; u < u1; ++u) tiles[0](x, xs, w, u * QUAD, nullptr, y, n, bias);
      return;
    }
    for (int64_t p = 2 * q0; p < 2 * q1; p += 2)
      row_blocks(m, DIRECT_ROWS, [&](int64_t r, int nr) {
        if (nr == 1)
          code_tile<F, 1, 2, false>(x + r * k_dim, xs + r * w.groups, w, p, nullptr, y + r * n, n, bias);
        else
          tiles[nr - 1](x + r * k_dim, xs + r * w.groups, w, p, nullptr, y + r * n, n, bias);
      });
    return;
  }
  static constexpr auto tiles = code_tiles<F, true>(std::make_integer_sequence<int, DIRECT_ROWS>{});
  // NOTE: vectors, so vector-aligned: at malloc's 16 bytes, half the AVX2 loads of it (every AVX-512 one) split a
  // cache line: the path ran at 2/3 of its speed
  std::vector<vf> wide_buf(2 * k_dim);
  float* const wide = reinterpret_cast<float*>(wide_buf.data());
  for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
    const int64_t rows = std::min(m - r0, ROW_CHUNK);
    for (int64_t q = q0; q < q1; ++q) {
      widen_panel<F>(w, 2 * q, wide);
      widen_panel<F>(w, 2 * q + 1, wide + k_dim * W);
      row_blocks(rows, DIRECT_ROWS, [&](int64_t r, int nr) {
        tiles[nr - 1](x + (r0 + r) * k_dim, xs + (r0 + r) * w.groups, w, 2 * q, wide, y + (r0 + r) * n, n,
                      bias);
      });
    }
  }
}

using RunFn = void (*)(const Packed&, const float*, const float*, int64_t, float*, int64_t, const float*, int64_t,
                       int64_t);

RunFn format_runner(int64_t bits, bool half, bool offsets) {
  const RunFn fns[2][2][2] = {{{&run<Fmt<4, false, false>>, &run<Fmt<4, false, true>>},
                               {&run<Fmt<4, true, false>>, &run<Fmt<4, true, true>>}},
                              {{&run<Fmt<8, false, false>>, &run<Fmt<8, false, true>>},
                               {&run<Fmt<8, true, false>>, &run<Fmt<8, true, true>>}}};
  return fns[bits == 8][half][offsets];
}

// Where code k of a panel's feature j lies: (byte from the panel's first row, shift of its nibble); the file's
// head has the layout. Packing and reading rows (pack_panels, unpack_rows) share it.
inline std::pair<int64_t, int> code_place(int64_t bits, int64_t j, int64_t k) {
  if (bits == 8) return {k * ROW_STRIDE + j, 0};
  const int64_t c = k / 32, i = k % 32;
  return {(c * 16 + i % 16) * ROW_STRIDE + j, i < 16 ? 0 : 4};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack(const at::Tensor& q, const at::Tensor& scale,
                                                    const std::optional<at::Tensor>& offset, int64_t bits,
                                                    int64_t group) {
  TORCH_CHECK(bits == 8 || group % 32 == 0, "4-bit codes need groups of a multiple of 32");
  TORCH_CHECK(group % 2 == 0, "groups must be even (the code tiles take k in pairs)");
  return pack_panels<code_place, W>(q, scale, offset, bits, group);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                  const std::optional<at::Tensor>& bias, int64_t bits, int64_t group, int64_t out_features) {
  const auto [m, groups] = check_packed(x, codes, scales, offsets, bits, group, out_features);
  const int64_t k_dim = x.size(-1);
  const bool half = scales.scalar_type() == at::kHalf, has_offsets = offsets.numel() > 0;
  const at::Tensor xc = x.to(at::kFloat).reshape({-1, k_dim}).contiguous();  // (M, K)
  const LinearOut out = linear_out(x, m, out_features, bias);
  if (m > 0) {
    const float* xp = xc.data_ptr<float>();
    std::vector<float> xs;  // (M, groups): each group's sum of x, in order, for the offsets
    if (has_offsets) {
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
      fn(w, xp, xs.data(), m, yp, out_features, bp, u0, u1);
    });
  }
  return out.result(x);
}

// ---- GGUF blocks -> codes, scales, offsets (models/quant_formats.py from_gguf, whose numpy decoders it
// replaces where this library builds: the same values bit for bit, ~10x faster). Layouts: ggml-common.h.
// Each scale and offset is the float the reference computes before its last multiply / add.

inline float f16(const uint8_t* p) { return float(c10::Half(uint16_t(p[0] | p[1] << 8), c10::Half::from_bits())); }

// 8 six-bit scales and mins of a K-quant super-block (ggml's get_scale_min_k4)
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
    m[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
  }
}

// 32 four-bit codes of 16 bytes: the low nibbles, then the high ones
inline void nibbles(const uint8_t* b, int8_t* q, int n) {
  for (int i = 0; i < n; ++i) {
    q[i] = int8_t(b[i] & 15);
    q[i + n] = int8_t(b[i] >> 4);
  }
}

// One block of GGML type `type`: its codes q, and per group scale s and offset o (o untouched for symmetric types)
void decode_block(int64_t type, const uint8_t* b, int8_t* q, float* s, float* o) {
  switch (type) {
    case 8:  // Q8_0
      s[0] = f16(b);
      for (int i = 0; i < 32; ++i) q[i] = int8_t(b[2 + i]);
      break;
    case 2:  // Q4_0: d * (q - 8) as q * d + (-8 d), exact in fp32
      s[0] = f16(b);
      o[0] = -8.f * s[0];
      nibbles(b + 2, q, 16);
      break;
    case 3:  // Q4_1
      s[0] = f16(b);
      o[0] = f16(b + 2);
      nibbles(b + 4, q, 16);
      break;
    case 6:  // Q5_0: signed codes q - 16
    case 7: {  // Q5_1
      const bool one = type == 7;
      const uint8_t* qh = b + (one ? 4 : 2);
      s[0] = f16(b);
      if (one) o[0] = f16(b + 2);
      nibbles(qh + 4, q, 16);
      const uint32_t h = qh[0] | qh[1] << 8 | qh[2] << 16 | uint32_t(qh[3]) << 24;
      for (int i = 0; i < 32; ++i) q[i] = int8_t((q[i] | ((h >> i) & 1) << 4) - (one ? 0 : 16));
      break;
    }
    case 12:  // Q4_K
    case 13: {  // Q5_K
      uint8_t sc[8], m[8];
      k_scales(b + 4, sc, m);
      const float d = f16(b), dmin = f16(b + 2);
      for (int g = 0; g < 8; ++g) {
        s[g] = d * float(sc[g]);
        o[g] = -(dmin * float(m[g]));
      }
      const uint8_t* qs = b + (type == 12 ? 16 : 48);
      for (int c = 0; c < 4; ++c) nibbles(qs + 32 * c, q + 64 * c, 32);
      if (type == 13)
        for (int i = 0; i < 256; ++i) q[i] = int8_t(q[i] | ((b[16 + i % 32] >> (i / 32)) & 1) << 4);
      break;
    }
    case 14: {  // Q6_K: two halves of 128 codes; ql's nibbles, qh's 2 bits (code 32j + l: bits 2j of qh[l])
      const float d = f16(b + 208);
      for (int g = 0; g < 16; ++g) s[g] = d * float(int8_t(b[192 + g]));
      for (int h = 0; h < 2; ++h) {
        int8_t* qq = q + 128 * h;
        nibbles(b + 64 * h, qq, 64);
        for (int i = 0; i < 128; ++i) qq[i] = int8_t((qq[i] | ((b[128 + 32 * h + i % 32] >> (2 * (i / 32))) & 3) << 4) - 32);
      }
      break;
    }
    default:
      TORCH_CHECK(false, "no decoder for GGML type ", type);
  }
}

// (B, type size) uint8 blocks of `block` weights in groups of `group` -> codes (B, block) int8, scales and
// offsets (B, block / group) fp32 (offsets empty for symmetric types)
std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_codes(const at::Tensor& blocks, int64_t type, int64_t block,
                                                         int64_t group, bool has_offset) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks must be contiguous uint8 (blocks, type size)");
  const int64_t n = blocks.size(0), groups = block / group;
  at::Tensor q = at::empty({n, block}, blocks.options().dtype(at::kChar));
  at::Tensor s = at::empty({n, groups}, blocks.options().dtype(at::kFloat));
  at::Tensor o = has_offset ? at::empty({n, groups}, s.options()) : at::empty({0}, s.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *sp = s.data_ptr<float>(), *op = has_offset ? o.data_ptr<float>() : nullptr;
  const int64_t size = blocks.size(1);
  at::parallel_for(0, n, 1024, [&](int64_t b0, int64_t b1) {
    float unused[16];  // a symmetric type's offsets: none kept
    for (int64_t i = b0; i < b1; ++i)
      decode_block(type, src + i * size, qp + i * block, sp + i * groups, op ? op + i * groups : unused);
  });
  return {q, s, o};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("quant_linear", &linear);
  m.impl("pack_quant", &pack);
  m.impl("quant_rows", &unpack_rows<code_place, W>);
  m.impl("gguf_codes", &gguf_codes);
}
