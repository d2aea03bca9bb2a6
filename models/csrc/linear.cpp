// Linears with bf16 weights kept in panels (models/cpu_linear.py, the `panels` path).
//
// fp32 activations: each weight is widened to fp32 in a register, next to fp32 FMAs; that is
// exact, so the results are those of the fp32 model (up to the order of the sums), and a decode
// step streams half the bytes of fp32 weights. On CPUs without bf16 arithmetic (AVX2, AVX-512
// without BF16, portable builds) bf16 activations take the same path, widened first.
// bf16 activations on an AVX512-BF16 build: pairs of bf16 multiplied straight from the panels
// (vdpbf16ps), fp32 accumulation, as oneDNN's bf16 kernels do.
//
// Packing: panels of W output features (one vector), [panel][k / 2][W][2]: one load of 2W bf16 is
// W features at k and k + 1 (a shift and a mask widen them; vdpbf16ps takes the pairs as they
// are). A register tile is R rows of x against NP panels: R x NP accumulators, every weight loaded
// feeding R FMAs.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>

#include "simd.h"

namespace {

constexpr int MAX_ROWS = PANEL_MAX_ROWS;
constexpr int64_t ROW_CHUNK = 64;  // x rows per pass over a thread's panels (they stay in L2)
constexpr int64_t PREFETCH_K2 = 32;  // k pairs ahead weights are prefetched (1 KiB of a panel at AVX2's width)

// One k pair of a panel: W words, word j holding feature j at k (low half) and at k + 1 (high
// half) as bf16. bf16 is fp32's upper half, so a shift and a mask widen both.
inline void widen(const uint16_t* p, vf& lo, vf& hi) {
  vu u;
  std::memcpy(&u, p, sizeof u);
  const vu a = u << 16, b = u & 0xffff0000u;
  std::memcpy(&lo, &a, sizeof lo);
  std::memcpy(&hi, &b, sizeof hi);
}

// NOTE: the first row block of a chunk streams each panel from memory: keep the miss queues full
// (a decode's one block above all); later blocks find the panel cached, and these hit
template <int NP>
inline void prefetch(const uint16_t* w, int64_t panel, int64_t k2) {
  if ((k2 & (64 / (W * 4) - 1)) == 0)  // one per cache line: a k pair is 4W bytes
    for (int p = 0; p < NP; ++p) __builtin_prefetch(w + p * panel + (k2 + PREFETCH_K2) * 2 * W, 0, 0);
}

// R rows of accumulators (NP vectors each) -> y[r, n0 .. n0 + NP * W), features past n dropped.
template <int R, int NP, typename Y>
inline void store_tile(const vf (&acc)[R][NP], Y* y, int64_t n, int64_t n0, const float* bias) {
  alignas(64) float row[NP * W];
  const int64_t width = std::min<int64_t>(NP * W, n - n0);
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) std::memcpy(row + p * W, &acc[r][p], sizeof(vf));
    if (bias != nullptr)
      for (int64_t j = 0; j < width; ++j) row[j] += bias[n0 + j];
    if constexpr (std::is_same_v<Y, float>) {
      std::memcpy(y + r * n + n0, row, width * sizeof(float));
    } else {
      for (int64_t j = 0; j < width; ++j) y[r * n + n0 + j] = c10::BFloat16(row[j]);  // round to nearest even
    }
  }
}

// fp32 x: y[r, n0 + j] = bias + x[r, :] . w[n0 + j, :] for r < R, j < NP * W.
template <int R, int NP>
void tile(const void* xv, int64_t k_dim, const uint16_t* w, void* yv, int64_t n, int64_t n0, const float* bias) {
  const float* x = static_cast<const float*>(xv);
  vf acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vf{};
  const int64_t k2s = (k_dim + 1) / 2, panel = k2s * 2 * W, full = k_dim / 2;
  for (int64_t k2 = 0; k2 < full; ++k2) {
    prefetch<NP>(w, panel, k2);
    vf lo[NP], hi[NP];
    for (int p = 0; p < NP; ++p) widen(w + p * panel + k2 * 2 * W, lo[p], hi[p]);
    for (int r = 0; r < R; ++r) {
      // NOTE: scalar operands, so each becomes one broadcast load
      const float x0 = x[r * k_dim + 2 * k2], x1 = x[r * k_dim + 2 * k2 + 1];
      for (int p = 0; p < NP; ++p) {
        acc[r][p] += x0 * lo[p];  // two FMAs (one expression would be a multiply, an FMA and an add)
        acc[r][p] += x1 * hi[p];
      }
    }
  }
  if (full < k2s) {  // an odd k_dim: the last pair's high halves are padding, and x ends before them
    vf lo[NP], hi[NP];
    for (int p = 0; p < NP; ++p) widen(w + p * panel + full * 2 * W, lo[p], hi[p]);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) acc[r][p] += x[r * k_dim + 2 * full] * lo[p];
  }
  store_tile<R, NP>(acc, static_cast<float*>(yv), n, n0, bias);
}

#if ATTNSERVE_BF16_DOT
// bf16 x (k_dim even): each k pair of x, broadcast, against the panels' pairs as they are.
template <int R, int NP>
void tile_bf16(const void* xv, int64_t k_dim, const uint16_t* w, void* yv, int64_t n, int64_t n0,
               const float* bias) {
  const uint16_t* x = static_cast<const uint16_t*>(xv);
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t k2s = k_dim / 2, panel = k2s * 2 * W;
  for (int64_t k2 = 0; k2 < k2s; ++k2) {
    prefetch<NP>(w, panel, k2);
    __m512bh wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = (__m512bh)_mm512_loadu_si512(w + p * panel + k2 * 2 * W);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k_dim + 2 * k2, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xb, wv[p]);
    }
  }
  vf out[R][NP];
  std::memcpy(out, acc, sizeof out);
  store_tile<R, NP>(out, static_cast<c10::BFloat16*>(yv), n, n0, bias);
}
#endif

using TileFn = void (*)(const void*, int64_t, const uint16_t*, void*, int64_t, int64_t, const float*);

template <template <int, int> class Tile, int NP, int... R>
constexpr auto tile_table(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&Tile<R + 1, NP>::run...};
}

template <int R, int NP>
struct Fp32Tile {
  static void run(const void* x, int64_t k, const uint16_t* w, void* y, int64_t n, int64_t n0, const float* b) {
    tile<R, NP>(x, k, w, y, n, n0, b);
  }
};

// Tiles of two panels, up to MAX_ROWS rows; of four (twice the FMA chains, so a decode's few rows
// still keep the FMA units busy), up to half as many.
struct Tiles {
  std::array<TileFn, MAX_ROWS> two;
  std::array<TileFn, MAX_ROWS / 2> four;
  int64_t x_bytes;  // per element of x
};

constexpr Tiles FP32_TILES{tile_table<Fp32Tile, 2>(std::make_integer_sequence<int, MAX_ROWS>{}),
                           tile_table<Fp32Tile, 4>(std::make_integer_sequence<int, MAX_ROWS / 2>{}), 4};

#if ATTNSERVE_BF16_DOT
template <int R, int NP>
struct Bf16Tile {
  static void run(const void* x, int64_t k, const uint16_t* w, void* y, int64_t n, int64_t n0, const float* b) {
    tile_bf16<R, NP>(x, k, w, y, n, n0, b);
  }
};
constexpr Tiles BF16_TILES{tile_table<Bf16Tile, 2>(std::make_integer_sequence<int, MAX_ROWS>{}),
                           tile_table<Bf16Tile, 4>(std::make_integer_sequence<int, MAX_ROWS / 2>{}), 2};
#endif

// y (M, N) = x (M, K) @ W^T + b over panels [p0, p1) (p0 even). Per chunk of rows, each group of
// panels is read once from memory and kept in cache while every row block of the chunk uses it.
void run_panels(const Tiles& tiles, const char* x, int64_t m, int64_t k_dim, const uint16_t* w, char* y,
                int64_t y_bytes, int64_t n, const float* bias, int64_t p0, int64_t p1) {
  const int64_t panel = (k_dim + 1) / 2 * 2 * W;
  for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
    const int64_t rows = std::min(m - r0, ROW_CHUNK);
    const int64_t blocks = (rows + MAX_ROWS - 1) / MAX_ROWS;  // as even as they go: no thin tail with few chains
    for (int64_t p = p0; p < p1; p += 4) {
      const int64_t np = std::min<int64_t>(4, p1 - p);
      for (int64_t b = 0, r = r0; b < blocks; ++b) {
        const int nr = int(rows / blocks + (b < rows % blocks));
        const char* xr = x + r * k_dim * tiles.x_bytes;
        char* yr = y + r * n * y_bytes;
        r += nr;
        if (np == 4 && nr <= MAX_ROWS / 2) {
          tiles.four[nr - 1](xr, k_dim, w + p * panel, yr, n, p * W, bias);
          continue;
        }
        for (int64_t q = p; q < p + np; q += 2) tiles.two[nr - 1](xr, k_dim, w + q * panel, yr, n, q * W, bias);
      }
    }
  }
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be (out_features, in_features)");
  const at::Tensor w = weight.to(at::kBFloat16).contiguous();
  const int64_t n = w.size(0), k_dim = w.size(1), k2s = (k_dim + 1) / 2;
  // NOTE: an even number of panels, zero padded: a two-panel tile never reads past the tensor
  const int64_t panels = (n + 2 * W - 1) / (2 * W) * 2;
  at::Tensor packed = at::zeros({panels, k2s, 2 * W}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < W && p * W + j < n; ++j)
        for (int64_t k = 0; k < k_dim; ++k) dst[((p * k2s + k / 2) * W + j) * 2 + k % 2] = src[(p * W + j) * k_dim + k];
  });
  return packed;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * W && packed.size(0) % 2 == 0 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "weights must be packed by this library (panels of ", W, " bf16 features)");
  const int64_t k2s = packed.size(1), panels = packed.size(0), k_dim = x.size(-1);
  TORCH_CHECK((k_dim + 1) / 2 == k2s, "x has ", k_dim, " features, the weights ", 2 * k2s, " (or one fewer)");
  TORCH_CHECK(out_features > panels * W - 2 * W && out_features <= panels * W, "out_features does not match the panels");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const bool bf16_dot = ATTNSERVE_BF16_DOT && x.scalar_type() == at::kBFloat16 && k_dim % 2 == 0;
  const at::Tensor xc = (bf16_dot ? x : x.to(at::kFloat)).reshape({-1, k_dim}).contiguous();
  const int64_t m = xc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty({m, out_features}, xc.options());
  std::optional<at::Tensor> b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b->numel() == out_features, "bias must have out_features elements");
  }
  if (m > 0) {
#if ATTNSERVE_BF16_DOT
    const Tiles& tiles = bf16_dot ? BF16_TILES : FP32_TILES;
#else
    const Tiles& tiles = FP32_TILES;
#endif
    const char* xp = static_cast<const char*>(xc.data_ptr());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    char* yp = static_cast<char*>(y.data_ptr());
    const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
    // NOTE: whole pairs of panels per task: a two-panel tile never straddles two threads
    at::parallel_for(0, panels / 2, 1, [&](int64_t q0, int64_t q1) {
      run_panels(tiles, xp, m, k_dim, wp, yp, int64_t(y.element_size()), out_features, bp, 2 * q0, 2 * q1);
    });
  }
  return y.to(x.scalar_type()).view(shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("panel_linear", &linear);
  m.impl("pack_panels", &pack);
}
