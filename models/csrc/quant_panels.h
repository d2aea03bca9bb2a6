// What the two quantized-linear kernel files share (quant_linear.cpp: fp32 activations; q8_linear.cpp:
// 8-bit activations): panels of W output features in quads whose codes interleave, group scales and
// offsets per panel, the tile store and the row blocking. Each file lays out the codes of one feature
// its own way (a `place` function); the rest is here. Part of every library's build hash.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "code_planes.h"
#include "simd.h"

namespace {

constexpr int64_t QUAD = 4;  // panels whose rows interleave: a one-row tile over a quad reads one stream

// Where panel p's first row of codes lies; `lane_bytes`: one row of one panel (its W features).
// The one statement of the quads: packing and kernels share it.
inline int64_t panel_offset(int64_t p, int64_t panel_bytes, int64_t lane_bytes) {
  return (p / QUAD) * QUAD * panel_bytes + (p % QUAD) * lane_bytes;
}

// A format: the codes' width, fp16 scales (and offsets), whether there are offsets, whether the scales are
// superblock records (group_scales.h)
template <int BITS_, bool HALF_, bool OFFSET_, bool SUPER_ = false>
struct Fmt {
  static constexpr int BITS = BITS_;
  static constexpr bool HALF = HALF_, OFFSET = OFFSET_, SUPER = SUPER_;
};

// W scales (or offsets) of one panel and group
template <bool HALF>
inline vf load_scales(const void* base, int64_t at) {
  if constexpr (!HALF) {
    return load_f(static_cast<const float*>(base) + at);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + at;
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    vf v;
    for (int j = 0; j < W; ++j) v[j] = float(c10::Half(p[j], c10::Half::from_bits()));
    return v;
#endif
  }
}

// An op's fp32 output (M, N) and bias; `result` gives y in x's dtype and shape (..., N).
struct LinearOut {
  at::Tensor y;
  std::optional<at::Tensor> bias;
  std::vector<int64_t> shape;
  const float* bias_ptr() const { return bias.has_value() ? bias->data_ptr<float>() : nullptr; }
  at::Tensor result(const at::Tensor& x) const { return y.to(x.scalar_type()).view(shape); }  // a no-op cast where y is x's dtype
};

inline LinearOut linear_out(const at::Tensor& x, int64_t m, int64_t out_features,
                            const std::optional<at::Tensor>& bias, at::ScalarType dtype = at::kFloat) {
  LinearOut out{at::empty({m, out_features}, x.options().dtype(dtype)), std::nullopt,
                std::vector<int64_t>(x.sizes().begin(), x.sizes().end())};
  out.shape.back() = out_features;
  if (bias.has_value()) {
    out.bias = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(out.bias->numel() == out_features, "bias must have out_features elements");
  }
  return out;
}

// R rows of accumulators -> y[r, n0 .. n0 + NP * W) in fp32 or bf16, features past n dropped (padding panels).
template <int R, int NP, typename Y = float>
inline void store_tile(const vf (&acc)[R][NP], Y* y, int64_t n, int64_t n0, const float* bias) {
  alignas(64) float row[NP * W];
  const int64_t width = std::min<int64_t>(NP * W, n - n0);
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) std::memcpy(row + p * W, &acc[r][p], sizeof(vf));
    if (bias != nullptr)
      for (int64_t j = 0; j < width; ++j) row[j] += bias[n0 + j];
    // NOTE: a whole tile's width is a constant: copied inline, not by a call per row
    if constexpr (std::is_same_v<Y, float>) {
      if (width == NP * W)
        std::memcpy(y + r * n + n0, row, sizeof row);
      else
        std::memcpy(y + r * n + n0, row, width * sizeof(float));
    } else {
      alignas(64) uint16_t bits[NP * W];
      for (int p = 0; p < NP; ++p) store_bf16(bits + p * W, load_f(row + p * W));
      if (width == NP * W)
        std::memcpy(y + r * n + n0, bits, sizeof bits);
      else
        std::memcpy(y + r * n + n0, bits, width * sizeof(uint16_t));
    }
  }
}

// Rows of x in blocks as even as they go (no thin tail with few chains)
template <typename F>
inline void row_blocks(int64_t rows, int max_rows, F&& f) {
  const int64_t blocks = (rows + max_rows - 1) / max_rows;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int nr = int(rows / blocks + (b < rows % blocks));
    f(r, nr);
    r += nr;
  }
}

// A file's layout of one feature's codes: where code k of a panel's feature j lies, as (byte from the panel's
// first row, shift of its nibble). With LANE_BYTES (panel_offset's), all that packing and reading rows need.
using CodePlace = std::pair<int64_t, int> (*)(int64_t bits, int64_t j, int64_t k);

// Codes (N, K) int8 -> (panels, panel_bytes) uint8, each code where PLACE puts it (a 5- or 6-bit code's nibble;
// its higher bits where HIGH does: code_planes.h), whole quads of panels zero padded (no tile ever reads past the
// tensor). 6-bit codes are given as their values (-32..31) and stored + 32; table codes as their values, and
// stored as their indices.
template <CodePlace PLACE, int64_t LANE_BYTES, CodePlace HIGH = nullptr>
at::Tensor pack_codes(const at::Tensor& q, int64_t bits) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "codes must be int8 (out_features, in_features)");
  TORCH_CHECK(bits == 4 || bits == 8 || (HIGH != nullptr && own_width(int(bits))), "bits must be 4 or 8",
              HIGH != nullptr ? " (or 5, 6, or TABLE)" : "");
  const int64_t lo = -code_bias(int(bits)), hi = (int64_t(1) << bits) - code_bias(int(bits));
  TORCH_CHECK(bits == 8 || bits == TABLE || q.numel() == 0 ||
                  (q.min().item<int8_t>() >= lo && q.max().item<int8_t>() < hi),
              bits, "-bit codes must be in ", lo, "..", hi - 1);
  const int64_t n = q.size(0), k_dim = q.size(1);
  const int64_t panels = (n + QUAD * W - 1) / (QUAD * W) * QUAD, panel_bytes = k_dim * W * code_width(int(bits)) / 8;
  const at::Tensor qc = q.contiguous();
  at::Tensor codes = at::zeros({panels, panel_bytes}, q.options().dtype(at::kByte));
  const int8_t* src = qc.data_ptr<int8_t>();
  uint8_t* dst = codes.data_ptr<uint8_t>();
  std::array<int16_t, 256> index{};  // table codes: value + 128 -> index
  for (int v = 0; v < 256; ++v) index[v] = int16_t(table_index(v - 128));
  std::atomic<bool> off_table{false};
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < W && p * W + j < n; ++j) {
        uint8_t* panel = dst + panel_offset(p, panel_bytes, LANE_BYTES);
        const int8_t* row = src + (p * W + j) * k_dim;
        for (int64_t k = 0; k < k_dim; ++k) {
          int code = row[k] + code_bias(int(bits));
          if (bits == TABLE) {
            code = index[row[k] + 128];
            if (code < 0) {
              off_table = true;
              code = 0;
            }
          }
          const auto [byte, shift] = PLACE(bits, j, k);
          // NOTE: into zeros: an 8-bit code's byte is the code
          panel[byte] |= uint8_t((planes(int(bits)) ? code & 15 : code) << shift);
          if constexpr (HIGH != nullptr) {
            if (planes(int(bits))) {
              const auto [high_byte, high_shift] = HIGH(bits, j, k);
              panel[high_byte] |= uint8_t((code >> 4) << high_shift);
            }
          }
        }
      }
  });
  TORCH_CHECK(!off_table, "table codes must be IQ4_NL's values");
  return codes;
}

// Codes (N, K) int8 with (N, K / group) scales and offsets -> (codes, scales, offsets) in panels: pack_codes's
// codes; scales and offsets (panels, groups, W), fp16 where every value is exactly one, else fp32; offsets
// empty when none.
template <CodePlace PLACE, int64_t LANE_BYTES, CodePlace HIGH = nullptr>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_panels(const at::Tensor& q, const at::Tensor& scale,
                                                           const std::optional<at::Tensor>& offset, int64_t bits,
                                                           int64_t group) {
  at::Tensor codes = pack_codes<PLACE, LANE_BYTES, HIGH>(q, bits);
  const int64_t n = q.size(0), k_dim = q.size(1), panels = codes.size(0);
  TORCH_CHECK(group > 0 && k_dim % group == 0, "in_features must be a multiple of the group size");
  const int64_t groups = k_dim / group;
  TORCH_CHECK(scale.sizes() == at::IntArrayRef({n, groups}), "scale must be (out_features, in_features / group)");
  const at::Tensor sc = scale.to(at::kFloat).contiguous();
  const at::Tensor oc = offset.has_value() ? offset->to(at::kFloat).contiguous() : at::zeros({n, groups}, sc.options());
  TORCH_CHECK(oc.sizes() == sc.sizes(), "offset must be shaped like scale");
  at::Tensor scales = at::zeros({panels, groups, W}, sc.options()), offsets = at::zeros({panels, groups, W}, sc.options());
  const float *s_src = sc.data_ptr<float>(), *o_src = oc.data_ptr<float>();
  float *s_dst = scales.data_ptr<float>(), *o_dst = offsets.data_ptr<float>();
  for (int64_t row = 0; row < n; ++row)
    for (int64_t g = 0; g < groups; ++g) {
      s_dst[((row / W) * groups + g) * W + row % W] = s_src[row * groups + g];
      o_dst[((row / W) * groups + g) * W + row % W] = o_src[row * groups + g];
    }
  // NOTE: fp16 only where it is exact, so packing never changes a weight
  const auto exact_half = [](const at::Tensor& t) { return t.to(at::kHalf).to(at::kFloat).eq(t).all().item<bool>(); };
  const bool has_offsets = offset.has_value() && offsets.ne(0).any().item<bool>();
  if (exact_half(scales) && (!has_offsets || exact_half(offsets))) {
    scales = scales.to(at::kHalf);
    offsets = offsets.to(at::kHalf);
  }
  return {codes, scales, has_offsets ? offsets : at::empty({0}, scales.options())};
}

}  // namespace
