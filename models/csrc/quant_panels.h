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
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t QUAD = 4;  // panels whose rows interleave: a one-row tile over a quad reads one stream

// Where panel p's first row of codes lies; `lane_bytes`: one row of one panel (its W features).
// The one statement of the quads: packing and kernels share it.
inline int64_t panel_offset(int64_t p, int64_t panel_bytes, int64_t lane_bytes) {
  return (p / QUAD) * QUAD * panel_bytes + (p % QUAD) * lane_bytes;
}

// A format: the codes' width, fp16 scales (and offsets), whether there are offsets
template <int BITS_, bool HALF_, bool OFFSET_>
struct Fmt {
  static constexpr int BITS = BITS_;
  static constexpr bool HALF = HALF_, OFFSET = OFFSET_;
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

// Codes (N, K) int8 with (N, K / group) scales and offsets -> (codes, scales, offsets) in panels:
// codes (panels, panel_bytes) uint8, each code where PLACE puts it; scales and offsets (panels, groups, W),
// fp16 where every value is exactly one, else fp32; offsets empty when none.
template <CodePlace PLACE, int64_t LANE_BYTES>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_panels(const at::Tensor& q, const at::Tensor& scale,
                                                           const std::optional<at::Tensor>& offset, int64_t bits,
                                                           int64_t group) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "codes must be int8 (out_features, in_features)");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t n = q.size(0), k_dim = q.size(1);
  TORCH_CHECK(group > 0 && k_dim % group == 0, "in_features must be a multiple of the group size");
  const int64_t groups = k_dim / group;
  TORCH_CHECK(bits == 8 || q.numel() == 0 || (q.min().item<int8_t>() >= 0 && q.max().item<int8_t>() < 16),
              "4-bit codes must be in 0..15");
  TORCH_CHECK(scale.sizes() == at::IntArrayRef({n, groups}), "scale must be (out_features, in_features / group)");
  const at::Tensor qc = q.contiguous(), sc = scale.to(at::kFloat).contiguous();
  const at::Tensor oc = offset.has_value() ? offset->to(at::kFloat).contiguous() : at::zeros({n, groups}, sc.options());
  TORCH_CHECK(oc.sizes() == sc.sizes(), "offset must be shaped like scale");
  // NOTE: whole quads of panels, zero padded: no tile ever reads past the tensor
  const int64_t panels = (n + QUAD * W - 1) / (QUAD * W) * QUAD, panel_bytes = k_dim * W * bits / 8;
  at::Tensor codes = at::zeros({panels, panel_bytes}, q.options().dtype(at::kByte));
  at::Tensor scales = at::zeros({panels, groups, W}, sc.options()), offsets = at::zeros({panels, groups, W}, sc.options());
  const int8_t* src = qc.data_ptr<int8_t>();
  const float *s_src = sc.data_ptr<float>(), *o_src = oc.data_ptr<float>();
  uint8_t* dst = codes.data_ptr<uint8_t>();
  float *s_dst = scales.data_ptr<float>(), *o_dst = offsets.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < W && p * W + j < n; ++j) {
        uint8_t* panel = dst + panel_offset(p, panel_bytes, LANE_BYTES);
        const int8_t* row = src + (p * W + j) * k_dim;
        for (int64_t k = 0; k < k_dim; ++k) {
          const auto [byte, shift] = PLACE(bits, j, k);
          panel[byte] |= uint8_t(row[k] << shift);  // NOTE: into zeros: an 8-bit code's byte is the code
        }
        for (int64_t g = 0; g < groups; ++g) {
          s_dst[(p * groups + g) * W + j] = s_src[(p * W + j) * groups + g];
          o_dst[(p * groups + g) * W + j] = o_src[(p * W + j) * groups + g];
        }
      }
  });
  // NOTE: fp16 only where it is exact, so packing never changes a weight
  const auto exact_half = [](const at::Tensor& t) { return t.to(at::kHalf).to(at::kFloat).eq(t).all().item<bool>(); };
  const bool has_offsets = offset.has_value() && offsets.ne(0).any().item<bool>();
  if (exact_half(scales) && (!has_offsets || exact_half(offsets))) {
    scales = scales.to(at::kHalf);
    offsets = offsets.to(at::kHalf);
  }
  return {codes, scales, has_offsets ? offsets : at::empty({0}, scales.options())};
}

// The packed tensors' checks for a matrix of `k_dim` inputs and `out_features` outputs; returns its groups.
inline int64_t check_panels(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                            int64_t group, int64_t k_dim, int64_t out_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(0) % QUAD == 0,
              "codes must be packed by this library");
  const bool half = scales.scalar_type() == at::kHalf, has_offsets = offsets.numel() > 0;
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == W && scales.is_contiguous() &&
                  (half || scales.scalar_type() == at::kFloat) &&
                  (!has_offsets || (offsets.sizes() == scales.sizes() && offsets.is_contiguous() &&
                                    offsets.scalar_type() == scales.scalar_type())),
              "scales and offsets must be packed by this library (panels of ", W, " features)");
  const int64_t panels = codes.size(0), groups = scales.size(1);
  TORCH_CHECK(codes.size(1) == k_dim * W * bits / 8 && groups * group == k_dim && scales.size(0) == panels,
              "the weights do not take ", k_dim, " input features");
  TORCH_CHECK(out_features > panels * W - QUAD * W && out_features <= panels * W,
              "out_features does not match the panels");
  return groups;
}

// The packed tensors' checks against x; returns (M rows, groups).
inline std::pair<int64_t, int64_t> check_packed(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                                const at::Tensor& offsets, int64_t bits, int64_t group,
                                                int64_t out_features) {
  const int64_t k_dim = x.size(-1), groups = check_panels(codes, scales, offsets, bits, group, k_dim, out_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  return {x.numel() / std::max<int64_t>(k_dim, 1), groups};
}

// Rows `ids` of a packed (N, K) matrix as fp32 (T, K): each code times its scale, then plus its offset
// (models/quant_formats.py dequantize_codes, op for op), for an embedding that reads a tied LM head's panels
// (models/quant_linear.py QuantEmbedding); the op `quant_rows` / `q8_rows` of the file whose layout it reads.
template <CodePlace PLACE, int64_t LANE_BYTES>
at::Tensor unpack_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                       const at::Tensor& ids, int64_t bits, int64_t group, int64_t k_dim, int64_t n) {
  const int64_t groups = check_panels(codes, scales, offsets, bits, group, k_dim, n);
  const bool half = scales.scalar_type() == at::kHalf, has_offsets = offsets.numel() > 0;
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids must be int64");
  const at::Tensor idx = ids.contiguous().view(-1);
  const int64_t t = idx.numel(), panel_bytes = codes.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "id ", ip[r], " out of range for ", n, " rows");
  at::Tensor out = at::empty({t, k_dim}, codes.options().dtype(at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const void* sp = scales.data_ptr();
  const void* fp = has_offsets ? offsets.data_ptr() : nullptr;
  float* op = out.data_ptr<float>();
  const auto value = [half](const void* table, int64_t at) {
    return half ? float(static_cast<const at::Half*>(table)[at]) : static_cast<const float*>(table)[at];
  };
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t p = ip[r] / W, j = ip[r] % W;
      const uint8_t* panel = cp + panel_offset(p, panel_bytes, LANE_BYTES);
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = value(sp, (p * groups + g) * W + j);
        const float offset = has_offsets ? value(fp, (p * groups + g) * W + j) : 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const auto [byte, shift] = PLACE(bits, j, k);
          const int code = bits == 8 ? int(int8_t(panel[byte])) : (panel[byte] >> shift) & 15;
          float w = float(code) * scale;
          if (has_offsets) w = w + offset;  // NOTE: two roundings, as the reference's (no fused multiply-add)
          op[r * k_dim + k] = w;
        }
      }
    }
  });
  return out;
}

}  // namespace
