// The amx build's tiles for the 8-bit-activation kernel (q8_linear.cpp): int8 tiles of 16 rows (the vector tiles'
// integer sums, then their fp32 steps) and bf16 tiles for prompt rows. Other builds get TILES = false only.
#pragma once

#include "amx_tiles.h"
#include "q8_vector.h"

namespace {

constexpr int64_t AMX_ROWS = 16;  // rows per x tile: from this many rows on, a call's whole tiles of rows take AMX
#if ATTNSERVE_AMX_INT8
constexpr bool TILES = true;

// Two sets of three tiles, so that one block's loads are issued while the block before is stored:
// x (16 rows x a block's bytes: 0, 3), a panel's codes of the block (block / 4 rows of W features x 4
// bytes: 1, 4) and their int32 sums (16 rows x W: 2, 5). Per thread: each task loads it.
inline void configure_tiles(int64_t block) {
  TileConfig c;
  for (int t : {0, 3}) c.rows[t] = AMX_ROWS, c.colsb[t] = uint16_t(block);
  for (int t : {1, 4}) c.rows[t] = uint8_t(block / 4), c.colsb[t] = W * 4;
  for (int t : {2, 5}) c.rows[t] = AMX_ROWS, c.colsb[t] = W * 4;
  load_tile_config(c);
}

// The tile instructions name their tiles in the instruction itself: one macro per set
#define ATTNSERVE_DOT_BLOCK(X, C, S, BITS, x, k_dim, codes, stride) \
  do {                                                               \
    _tile_zero(S);                                                   \
    _tile_loadd(X, x, k_dim);                                        \
    _tile_loadd(C, codes, stride);                                   \
    if constexpr ((BITS) == 8 || (BITS) == TABLE)                    \
      _tile_dpbssd(S, X, C);                                         \
    else                                                             \
      _tile_dpbsud(S, X, C);                                         \
  } while (0)

// A panel's codes as the code tiles take them: 8-bit codes as packed (a step is a tile row, steps
// STEP_STRIDE apart); 4-, 5- and 6-bit codes, and table codes as their values, unpacked once per call and panel
// into `rows` (LANE_BYTES apart)
template <int BITS>
inline std::pair<const uint8_t*, int64_t> tile_codes(const uint8_t* panel, int64_t k_dim, uint8_t* rows) {
  if constexpr (BITS == 8) {
    return {panel, STEP_STRIDE};
  } else {
    for (int64_t s = 0; s < k_dim / 8; ++s) {
      vq lo, hi;
      step_codes<BITS>(panel, s, STEP_STRIDE, lo, hi);
      std::memcpy(rows + (2 * s) * LANE_BYTES, &lo, LANE_BYTES);
      std::memcpy(rows + (2 * s + 1) * LANE_BYTES, &hi, LANE_BYTES);
    }
    return {rows, LANE_BYTES};
  }
}

// Blocks go in chunks: a chunk's tile work (each block's dot products, its sums stored), then the chunk's
// scaling. NOTE: a vector load issued after a tile store waits for that store, whatever the addresses, and the
// tiles do not overlap the vector work: scaling each block one block behind the tiles (the first design) waited
// on the tiles' latency every block. AMX Xeon, Q4_1 576 -> 3072 at 512 rows: 57 -> 47 ns a block and tile of
// rows (one thread), 487 -> 640-690 GFLOP/s (two); a lag of 3 or 6 blocks, or scaling a pair of blocks between
// the next pair's dot products and stores, measured 49-68 ns.
constexpr int64_t CHUNK_BLOCKS = 8;

// y[16 rows, panel p): tile<F, Y, 16, 1>'s result, its integer sums from the tiles. Blocks alternate
// between the two tile sets.
template <typename F, typename Y>
void amx_tile(const Acts& a, const Packed& w, int64_t p, const uint8_t* codes, int64_t stride, Y* y, int64_t n,
              const float* bias) {
  constexpr int R = AMX_ROWS;
  const int64_t blocks_per_group = w.group / a.block, code_step = a.block / 4 * stride, blocks = a.blocks;
  vf acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = vf{};
  alignas(64) int32_t sums[CHUNK_BLOCKS][R][W];
  vf s{};
  for (int64_t b0 = 0, g = 0, e = 0; b0 < blocks; b0 += CHUNK_BLOCKS) {
    const int64_t b1 = std::min(blocks, b0 + CHUNK_BLOCKS);
    tile_reads_memory();  // the chunk before read its sums before these stores overwrite them
    for (int64_t i = b0; i < b1; ++i) {
      const int8_t* x = a.q + i * a.block;
      const uint8_t* c = codes + i * code_step;
      if ((i - b0) % 2 == 0) {
        ATTNSERVE_DOT_BLOCK(0, 1, 2, F::BITS, x, a.k_dim, c, stride);
        _tile_stored(2, sums[i - b0], LANE_BYTES);
      } else {
        ATTNSERVE_DOT_BLOCK(3, 4, 5, F::BITS, x, a.k_dim, c, stride);
        _tile_stored(5, sums[i - b0], LANE_BYTES);
      }
    }
    tile_wrote(sums);
    for (int64_t j = b0; j < b1; ++j) {
      if (e == 0) s = w.scale<F>(p, g);
      const int32_t* isum = sums[j - b0][0];
      const float* d = a.d + j;
      // NOTE: tile<>'s steps, in its order: one multiply, then one add, per block and lane
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        vq sum = load_q(reinterpret_cast<const uint8_t*>(isum + r * W));
        if constexpr (code_bias(F::BITS) != 0) sum = add_q(sum, splat_q(-code_bias(F::BITS) * a.qs[r * a.blocks + j]));
        acc[r] += to_float(sum) * (s * d[r * a.blocks]);
      }
      if (++e == blocks_per_group) {
        if constexpr (F::OFFSET) {
          const vf o = w.offset<F>(p, g);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) acc[r] += o * a.xq[r * a.groups + g];
        }
        e = 0;
        ++g;
      }
    }
  }
  vf out[R][1];
  for (int r = 0; r < R; ++r) out[r][0] = acc[r];
  store_tile<R, 1>(out, y, n, p * W, bias);
}

// Whole tiles of rows [0, tiled) over panels [p0, p1): the codes of each panel made tile rows once
template <typename F, typename Y>
void amx_rows(const Acts& a, const Packed& w, int64_t tiled, int64_t p0, int64_t p1, Y* y, int64_t n,
              const float* bias) {
  thread_local std::unique_ptr<uint8_t[]> rows_buf;
  thread_local int64_t rows_size = 0;
  uint8_t* rows = scratch(rows_buf, rows_size, F::BITS != 8 ? a.k_dim * W : 0);
  configure_tiles(a.block);
  for (int64_t p = p0; p < p1; ++p) {
    const auto [codes, stride] = tile_codes<F::BITS>(w.panel(p), a.k_dim, rows);
    tile_reads_memory();  // the unpacked codes
    for (int64_t r = 0; r < tiled; r += AMX_ROWS) amx_tile<F, Y>(a.rows_from(r), w, p, codes, stride, y + r * n, n, bias);
  }
  _tile_release();
}

// Prompt rows on bf16 tiles (`prompt_rows`): a panel's codes dequantized once per call into bf16 pairs as the
// tiles take them ([input pair][lane][2]: w = s * code + o in fp32, rounded to bf16), x's rows in bf16, and
// tdpbf16ps summing all of K in fp32 in the tiles. No per-block store and scaling, which bound the int8 tiles at
// prefill (AMX Xeon, Q4_1 576 -> 3072 at 512 rows: 1,238 against 733 GFLOP/s); but the dequantizing is per call,
// whatever the rows: 6x the int8 kernel's time at one row. Hence prompt rows only, whose calls are large.
// A row's bits do not depend on the other rows: each sums its K in the same tile order.
constexpr int64_t PAIR_ROW = 2 * W;  // bf16 values per tile row of codes: W lanes x an input pair
constexpr int64_t BF16_ROW_TASKS = 16;  // as ROW_TASKS, for the tiles' tasks (each dequantizes its quad once)

// W panel features' codes, K inputs -> bf16 rows[K / 2][W][2]
template <typename F>
void dequantize_panel(const Packed& w, int64_t p, uint16_t* rows) {
  constexpr int64_t KS = F::BITS == 8 ? 4 : 8;  // inputs per step of the packed codes
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512i quarter[4];  // lanes 4i .. 4i + 3, each four times: a step's 16 bytes of four lanes
  for (int i = 0; i < 4; ++i)
    quarter[i] = _mm512_add_epi32(_mm512_set1_epi32(4 * i),
                                  _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
  const uint8_t* codes = w.panel(p);
  const int64_t steps_per_group = w.group / KS;
  for (int64_t g = 0; g < w.groups; ++g) {
    vf sv, ov;
    w.scales.scale_offset<F>(p, g, sv, ov);
    __m512 S[4], O[4];
    for (int i = 0; i < 4; ++i) S[i] = _mm512_permutexvar_ps(quarter[i], (__m512)sv);
    if constexpr (F::OFFSET)
      for (int i = 0; i < 4; ++i) O[i] = _mm512_permutexvar_ps(quarter[i], (__m512)ov);
    const auto weight = [&](__m512i code, int i) {
      const __m512 c = _mm512_cvtepi32_ps(code);
      if constexpr (F::OFFSET)
        return _mm512_fmadd_ps(c, S[i], O[i]);
      else
        return _mm512_mul_ps(c, S[i]);
    };
    for (int64_t st = g * steps_per_group; st < (g + 1) * steps_per_group; ++st) {
      const uint8_t* c = codes + st * STEP_STRIDE;
      // NOTE: per lane, the step's inputs in fp32 lanes [lane][t]; two quarters rounded into one vector of bf16
      // pairs, whose even and odd pairs are the tile rows of inputs (t0, t1) and (t2, t3)
      if constexpr (F::BITS != 8) {
        __m512 lo[4], hi[4];
        alignas(64) uint8_t lo_codes[LANE_BYTES], hi_codes[LANE_BYTES];  // the step's codes, as stored
        {
          vq l, h;
          step_codes<F::BITS>(codes, st, STEP_STRIDE, l, h);
          std::memcpy(lo_codes, &l, LANE_BYTES);
          std::memcpy(hi_codes, &h, LANE_BYTES);
        }
        const __m512i bias = _mm512_set1_epi32(code_bias(F::BITS));
        const auto widened = [&](const uint8_t* b) {  // 16 codes (four lanes' steps) as int32 values
          const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(b));
          if constexpr (F::BITS == TABLE) return _mm512_cvtepi8_epi32(v);  // the table's values, signed
          return _mm512_sub_epi32(_mm512_cvtepu8_epi32(v), bias);
        };
        for (int i = 0; i < 4; ++i) {
          lo[i] = weight(widened(lo_codes + 16 * i), i);  // inputs k + t
          hi[i] = weight(widened(hi_codes + 16 * i), i);  // inputs k + 4 + t
        }
        const __m512i l01 = (__m512i)_mm512_cvtne2ps_pbh(lo[1], lo[0]), l23 = (__m512i)_mm512_cvtne2ps_pbh(lo[3], lo[2]);
        const __m512i h01 = (__m512i)_mm512_cvtne2ps_pbh(hi[1], hi[0]), h23 = (__m512i)_mm512_cvtne2ps_pbh(hi[3], hi[2]);
        uint16_t* r = rows + st * 4 * PAIR_ROW;
        _mm512_store_si512(r, _mm512_permutex2var_epi32(l01, even, l23));
        _mm512_store_si512(r + PAIR_ROW, _mm512_permutex2var_epi32(l01, odd, l23));
        _mm512_store_si512(r + 2 * PAIR_ROW, _mm512_permutex2var_epi32(h01, even, h23));
        _mm512_store_si512(r + 3 * PAIR_ROW, _mm512_permutex2var_epi32(h01, odd, h23));
      } else {
        __m512 f[4];
        for (int i = 0; i < 4; ++i)
          f[i] = weight(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * i))), i);
        const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), b = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
        uint16_t* r = rows + st * 2 * PAIR_ROW;
        _mm512_store_si512(r, _mm512_permutex2var_epi32(a, even, b));
        _mm512_store_si512(r + PAIR_ROW, _mm512_permutex2var_epi32(a, odd, b));
      }
    }
  }
}

// Tiles: 0-3 sums (two row tiles x two panels), 4-5 x (16 rows x 32 inputs), 6-7 codes (16 input pairs x W lanes)
inline void configure_bf16_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = AMX_ROWS, c.colsb[t] = 64;
  load_tile_config(c);
}

// A tile of sums (fp32, 16 x W) -> y's `rows` rows at feature n0, plus bias, features past n dropped (padding
// panels): store_tile's arithmetic (one fp32 add of the bias, bf16 rounded to nearest even), in masked vector stores
template <typename Y>
void store_sums(const float* sums, int64_t rows, Y* y, int64_t n, int64_t n0, const float* bias) {
  const int64_t width = std::min<int64_t>(W, n - n0);
  const __mmask16 lanes = width >= W ? __mmask16(0xffff) : __mmask16((1u << width) - 1);
  const vf b = bias != nullptr ? (vf)_mm512_maskz_loadu_ps(lanes, bias + n0) : vf{};
  for (int64_t r = 0; r < rows; ++r) {
    vf v = load_f(sums + r * W);
    if (bias != nullptr) v += b;
    if constexpr (std::is_same_v<Y, float>)
      _mm512_mask_storeu_ps(y + r * n + n0, lanes, (__m512)v);
    else
      _mm256_mask_storeu_epi16(y + r * n + n0, lanes, _mm512_cvtepi32_epi16((__m512i)to_bf16_bits(v)));
  }
}

// Rows [0, m) of bf16 x (`pad`: its last m % 16 rows, zero padded to a tile) over panels [p0, p1)
template <typename F, typename Y>
void bf16_rows(const uint16_t* x, int64_t m, const uint16_t* pad, const Packed& w, int64_t p0, int64_t p1, Y* y,
               int64_t n, const float* bias) {
  const int64_t k_dim = w.k_dim, blocks = k_dim / 32, stride = k_dim * 2, panel_values = k_dim * W;
  thread_local std::unique_ptr<uint16_t[]> rows_buf;
  thread_local int64_t rows_size = 0;
  uint16_t* codes = scratch(rows_buf, rows_size, 2 * panel_values);
  alignas(64) float sums[4][AMX_ROWS * W];
  const int64_t whole = m / AMX_ROWS * AMX_ROWS;
  const auto rows_at = [&](int64_t r) { return r < whole ? x + r * k_dim : pad; };
  configure_bf16_tiles();
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 1 < p1;
    dequantize_panel<F>(w, p, codes);
    if (two) dequantize_panel<F>(w, p + 1, codes + panel_values);
    const uint16_t *c0 = codes, *c1 = codes + panel_values;
    tile_reads_memory();  // the codes just written
    for (int64_t r = 0; r < m; r += 2 * AMX_ROWS) {
      const bool pair = r + AMX_ROWS < m;
      const uint16_t *x0 = rows_at(r), *x1 = pair ? rows_at(r + AMX_ROWS) : x0;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      // NOTE: every row sums its blocks in this order, one tdpbf16ps per block, whichever tile and call it is in
      for (int64_t b = 0; b < blocks; ++b) {
        _tile_loadd(6, c0 + b * 16 * PAIR_ROW, 64);
        _tile_loadd(4, x0 + b * 32, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, c1 + b * 16 * PAIR_ROW, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (pair) {
          _tile_loadd(5, x1 + b * 32, stride);
          _tile_dpbf16ps(2, 5, 6);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, sums[0], W * 4);
      if (two) _tile_stored(1, sums[1], W * 4);
      if (pair) _tile_stored(2, sums[2], W * 4);
      if (pair && two) _tile_stored(3, sums[3], W * 4);
      tile_wrote(sums);
      const int64_t rows0 = std::min<int64_t>(AMX_ROWS, m - r), rows1 = std::min<int64_t>(AMX_ROWS, m - r - AMX_ROWS);
      store_sums(sums[0], rows0, y + r * n, n, p * W, bias);
      if (two) store_sums(sums[1], rows0, y + r * n, n, (p + 1) * W, bias);
      if (pair) store_sums(sums[2], rows1, y + (r + AMX_ROWS) * n, n, p * W, bias);
      if (pair && two) store_sums(sums[3], rows1, y + (r + AMX_ROWS) * n, n, (p + 1) * W, bias);
    }
  }
  _tile_release();
}
#else
constexpr bool TILES = false;  // no tiles in this build
#endif

}  // namespace
