// Linears over quantized weights with 8-bit activations (models/quant_linear.py, activations "int8"):
// each row of x is rounded per block of QB inputs (32; 16 for groups of 16) to int8 with one fp32 scale
// (its largest magnitude / 127), and multiplied by the weights' integer codes with integer dot
// products: 4 byte products summed per 32-bit lane. AVX2 has vpmaddubsw + vpmaddwd (32 products in
// two instructions, against 8 per fp32 FMA); AVX-512 the same at twice the width, and with VNNI one
// instruction (vpdpbusd). llama.cpp multiplies its quantized types this way.
//
// What it computes: x rounded to that int8 grid, times the exact weights. Per block the integer sum
// is exact; it is scaled in fp32:
//   y[r, j] = sum_g ( s[j, g] * sum_{b in g} dx[r, b] * (qx[r, b] . code[j, b])
//                   + o[j, g] * sum_{b in g} dx[r, b] * sum(qx[r, b]) )
// so |y - x @ W.T| <= sum_b dx[r, b] / 2 * sum_{k in b} |w[j, k]| (plus fp32 rounding).
// Batch invariant: a row's operations, and their order, do not depend on the other rows of the call,
// so decode, speculative verification and a prefill chunk give a row the same bits.
//
// Packing: panels of W output features in quads (quant_panels.h); a step of KS inputs is, per panel,
// one vector of W lanes x 4 bytes:
//   8-bit codes (KS = 4): lane j, byte t = code(j, k + t), signed;
//   4-bit codes (KS = 8): lane j, byte t = code(j, k + t) | code(j, k + 4 + t) << 4.
// The x side of a step is 4 bytes broadcast to every lane. vpmaddubsw multiplies unsigned by signed
// bytes: 4-bit codes are unsigned; signed 8-bit codes go in as |w| against x with w's sign.
//
// AMX (the amx build): a call's whole tiles of 16 rows take the tiles (from 16 rows on for 8-bit codes, 32
// for 4-bit ones), the rest the vector tiles. Per block, a tile of x (16 rows x the block's bytes) times a
// panel's codes (tdpbssd for signed 8-bit codes, whose panel steps are already the tiles' 4-byte rows;
// tdpbsud for 4-bit codes, unpacked once per call and panel) into an int32 tile: the same exact integer
// sums, then the same fp32 steps per block as the vector tiles, so a row's bits do not depend on which
// path took it.
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <array>
#include <cmath>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "group_scales.h"

namespace {

constexpr int LANE_BYTES = W * 4;  // one panel's codes of one step
constexpr int64_t ROW_TASKS = 64;  // (quad, row chunk) tasks a call aims for when its output has few quads
constexpr int64_t PREFILL_ROWS = 64;  // rows from which a call's rows are chunked (decode batches never are)
constexpr int64_t STEP_STRIDE = QUAD * LANE_BYTES;  // bytes from one step of a panel's codes to its next

// How far ahead a tile prefetches its codes, and into which caches. On the AMX Xeon (480 MiB L3, which
// holds the default model) 32 steps ahead into every level (T0) took one row's pass over the default model
// from 9.7 to 6.5 ms against 8 steps non-temporally. On Zen 4 (32 MiB L3, the weights from DRAM) 8 steps into L2
// (T2) took the Q8_0 pass from 6.9 to 6.1 ms (bench_linear, three alternating runs); into every level was no
// faster than non-temporally. Under the AVX2 cap the difference was within noise: the AVX2 and portable builds
// keep non-temporal.
#if ATTNSERVE_AMX_INT8
constexpr int64_t PREFETCH_STEPS = 32;
constexpr int PREFETCH_LOCALITY = 3;
#elif defined(__AVX512F__)
constexpr int64_t PREFETCH_STEPS = 8;
constexpr int PREFETCH_LOCALITY = 1;
#else
constexpr int64_t PREFETCH_STEPS = 8;
constexpr int PREFETCH_LOCALITY = 0;
#endif

// Register tiles: rows of x that share one load of codes (R x NP integer and fp32 accumulators). Measured
// at AVX2 (Zen 3, 2 threads, the default model's shapes, Q4_1 at M = 512): 2 rows 216 GFLOP/s, 3 rows 230, 4 rows 222
#if defined(__AVX512F__)
constexpr int Q8_ROWS = 4;
#else
constexpr int Q8_ROWS = 3;
#endif


// 4-bit codes without VNNI: a block's products summed in int16 first (its 8 pairs per lane of at most
// 15 x 127 x 2 each: 30,480 < 2^15), then widened once: half the multiplies of widening every step
#if (defined(__AVX2__) || defined(__AVX512BW__)) && !defined(__AVX512VNNI__)
constexpr bool PAIRS16 = true;
#else
constexpr bool PAIRS16 = false;
#endif

// Signed 8-bit codes with VNNI: each code vector's signs flipped once (w + 128, unsigned: one xor, where the sign
// form took a sign mask and an absolute value), then per row only the vpdpbusd (the sign form also negated x under
// the mask), the block's int32 sums started at -128 * sum(x's block) to take the 128s back: the same exact
// integers (Q8_0 at 32 and 512 rows 1.2-1.4x). Without VNNI, vpmaddubsw's int16 pairs would overflow on
// 255 x 127: the sign form stays.
#if defined(__AVX512VNNI__)
constexpr bool FLIPPED_CODES = true;
#else
constexpr bool FLIPPED_CODES = false;
vq flip_signs(vq w);  // declared only: nothing calls it here
#endif

// Quad tiles: rows that take a quad's four panels at once, one stream of codes (the pair tiles of Q8_ROWS rows
// read half of each 256-byte step, the other half on a second pass). One row always does. Signed 8-bit codes on
// VNNI (flipped, so a row costs one instruction a code vector) do in tiles of up to 3 rows, for calls of up to 8
// rows. Measured on Zen 4 (bench_linear, Q8_0 x8 bf16, three alternating runs, docs/benchmarks.md "Quad tiles"):
// 4 rows 121-136 -> 136-153 GFLOP/s, 8 rows 181-201 -> 204-232; at 32 and 512 rows within noise, so those keep
// the pair tiles. 4-bit codes in quad tiles of 2 rows measured slower at 4 and 8 rows (145-155 against 164-184).
template <int BITS>
constexpr int QUAD_ROWS = BITS == 8 && FLIPPED_CODES ? 3 : 1;
template <int BITS>
constexpr int64_t QUAD_MAX_ROWS = BITS == 8 && FLIPPED_CODES ? 8 : 1;

struct Packed {
  const uint8_t* codes;
  GroupScales scales;  // fp32, fp16 or superblock records (group_scales.h)
  int64_t k_dim, group, groups, panel_bytes, panels;

  const uint8_t* panel(int64_t p) const { return codes + panel_offset(p, panel_bytes, LANE_BYTES); }
  int64_t quads() const { return panels / QUAD; }
  template <typename F>
  vf scale(int64_t p, int64_t g) const { return scales.scale<F>(p, g); }
  template <typename F>
  vf offset(int64_t p, int64_t g) const { return scales.offset<F>(p, g); }
};

// A thread's activation buffers, kept between calls: a prefill's are megabytes, which fresh each call cost
// a page fault per 4 KiB and a zeroing (14% of a 2,048-token step here). 64-byte aligned, so that no tile
// row straddles two cache lines
template <typename T>
T* scratch(std::unique_ptr<T[]>& buf, int64_t& size, int64_t n) {
  constexpr int64_t ALIGN = 64 / sizeof(T);
  if (n > size) {
    buf.reset(new T[n + ALIGN]);  // NOTE: not value-initialised: every element is written before it is read
    size = n;
  }
  const auto at = reinterpret_cast<uintptr_t>(buf.get());
  return buf.get() + ((64 - at % 64) % 64) / sizeof(T);
}

// Rows of x rounded to int8 per block of `block` inputs
struct Acts {
  const int8_t* q;  // (rows, K)
  const float* d;  // (rows, K / block): each block's scale
  const float* xq;  // (rows, groups): sum over the group's blocks of d * sum(q), the offsets' factor
  const int32_t* qs;  // (rows, K / block): each block's sum(q)
  int64_t k_dim, block, blocks, groups;

  Acts rows_from(int64_t r) const {
    return {q + r * k_dim, d + r * blocks, xq + r * groups, qs + r * blocks, k_dim, block, blocks, groups};
  }
};

// y[r, panels p0 .. p0 + NP) for R rows of x.
template <typename F, typename Y, int R, int NP>
void tile(const Acts& a, const Packed& w, int64_t p0, Y* y, int64_t n, const float* bias) {
  constexpr int64_t KS = F::BITS == 8 ? 4 : 8;  // inputs per step
  const int64_t steps_per_block = a.block / KS, blocks_per_group = w.group / a.block;
  vf acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vf{};
  const uint8_t* codes[NP];
  for (int p = 0; p < NP; ++p) codes[p] = w.panel(p0 + p);
  for (int64_t g = 0; g < w.groups; ++g) {
    vf s[NP], o[NP];
    for (int p = 0; p < NP; ++p) {
      if constexpr (F::SUPER)  // NOTE: a record's words read once for both
        w.scales.scale_offset<F>(p0 + p, g, s[p], o[p]);
      else
        s[p] = w.scale<F>(p0 + p, g);
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      vq isum[R][NP];
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < NP; ++p) {
          if constexpr (F::BITS == 8 && FLIPPED_CODES)
            isum[r][p] = splat_q(-128 * a.qs[r * a.blocks + b]);  // NOTE: takes back the flipped codes' 128s
          else if constexpr (code_bias(F::BITS) != 0)
            isum[r][p] = splat_q(-code_bias(F::BITS) * a.qs[r * a.blocks + b]);  // and the stored 6-bit codes' 32s
          else
            isum[r][p] = zero_q();
        }
      if constexpr (planes(F::BITS)) {
        // NOTE: a block of steps and its plane row (code_planes.h), the steps unrolled: each merges its own bits
        constexpr int SPB = plane_steps(F::BITS);
        vq plane[NP];
        for (int p = 0; p < NP; ++p) {
          const int64_t row = plane_row(F::BITS, b * SPB);  // NOTE: prefetched too: every row of the stream is
          __builtin_prefetch(codes[p] + (row + PREFETCH_STEPS) * STEP_STRIDE, 0, PREFETCH_LOCALITY);
          plane[p] = load_q(codes[p] + row * STEP_STRIDE);
        }
        const auto one = [&]<int I>() {
          const int64_t step = b * SPB + I, k = step * KS, row = nibble_row(F::BITS, step);
          vq x0[R], x1[R];
          for (int r = 0; r < R; ++r) {
            x0[r] = bcast4(a.q + r * a.k_dim + k);
            x1[r] = bcast4(a.q + r * a.k_dim + k + 4);
          }
          for (int p = 0; p < NP; ++p) {
            __builtin_prefetch(codes[p] + (row + PREFETCH_STEPS) * STEP_STRIDE, 0, PREFETCH_LOCALITY);
            vq lo, hi;
            nibbles(load_q(codes[p] + row * STEP_STRIDE), lo, hi);
            merge_plane<F::BITS, I>(plane[p], lo, hi);
            for (int r = 0; r < R; ++r) isum[r][p] = dot_us(dot_us(isum[r][p], lo, x0[r]), hi, x1[r]);
          }
        };
        [&]<int... I>(std::integer_sequence<int, I...>) {
          (one.template operator()<I>(), ...);
        }(std::make_integer_sequence<int, SPB>{});
      } else
      for (int64_t step = b * steps_per_block; step < (b + 1) * steps_per_block; ++step) {
        const int64_t k = step * KS;
        vq x0[R], x1[R];
        for (int r = 0; r < R; ++r) {
          x0[r] = bcast4(a.q + r * a.k_dim + k);
          if constexpr (F::BITS == 4) x1[r] = bcast4(a.q + r * a.k_dim + k + 4);
        }
        for (int p = 0; p < NP; ++p) {
          __builtin_prefetch(codes[p] + (step + PREFETCH_STEPS) * STEP_STRIDE, 0, PREFETCH_LOCALITY);
          const vq c = load_q(codes[p] + step * STEP_STRIDE);
          if constexpr (F::BITS == 8 && FLIPPED_CODES) {
            const vq u = flip_signs(c);
            for (int r = 0; r < R; ++r) isum[r][p] = dot_us(isum[r][p], u, x0[r]);
          } else if constexpr (F::BITS == 8) {
            for (int r = 0; r < R; ++r) isum[r][p] = dot_ss(isum[r][p], c, x0[r]);
          } else {
            vq lo, hi;
            nibbles(c, lo, hi);
            for (int r = 0; r < R; ++r) {
              if constexpr (PAIRS16)  // isum holds int16 pairs until the block ends
                isum[r][p] = add16(isum[r][p], add16(pairs_us(lo, x0[r]), pairs_us(hi, x1[r])));
              else
                isum[r][p] = dot_us(dot_us(isum[r][p], lo, x0[r]), hi, x1[r]);
            }
          }
        }
      }
      if constexpr (F::BITS == 4 && PAIRS16)
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < NP; ++p) isum[r][p] = widen16(zero_q(), isum[r][p]);
      // NOTE: one multiply, then one add, per block and lane, in block order: whatever R and NP are
      for (int r = 0; r < R; ++r) {
        const float d = a.d[r * a.blocks + b];
        for (int p = 0; p < NP; ++p) acc[r][p] += to_float(isum[r][p]) * (s[p] * d);
      }
    }
    if constexpr (F::OFFSET) {
      for (int p = 0; p < NP; ++p) {
        if constexpr (!F::SUPER) o[p] = w.offset<F>(p0 + p, g);
        for (int r = 0; r < R; ++r) acc[r][p] += o[p] * a.xq[r * a.groups + g];
      }
    }
  }
  store_tile<R, NP>(acc, y, n, p0 * W, bias);
}

template <typename Y>
using TileFn = void (*)(const Acts&, const Packed&, int64_t, Y*, int64_t, const float*);

template <typename F, typename Y, int NP, int... R>
constexpr std::array<TileFn<Y>, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {&tile<F, Y, R + 1, NP>...};
}

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
    if constexpr ((BITS) == 8)                                       \
      _tile_dpbssd(S, X, C);                                         \
    else                                                             \
      _tile_dpbsud(S, X, C);                                         \
  } while (0)

// A panel's codes as the code tiles take them: 8-bit codes as packed (a step is a tile row, steps
// STEP_STRIDE apart); 4-, 5- and 6-bit codes unpacked once per call and panel into `rows` (LANE_BYTES apart)
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
          return _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(b))), bias);
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

// Quads [u0, u1) of the output: up to QUAD_MAX_ROWS rows take a quad's four panels at once (one stream of
// codes), in row blocks of QUAD_ROWS; more rows go two panels at a time, in row blocks that share each load (on
// AMX, whole tiles of 16 rows first).
template <typename F, typename Y>
void run(const Packed& w, const Acts& a, int64_t m, void* out, int64_t n, const float* bias, int64_t u0, int64_t u1) {
  Y* y = static_cast<Y*>(out);
  static_assert(QUAD_MAX_ROWS<F::BITS> < AMX_ROWS, "quad tiles take calls too small for the AMX tiles");
  if constexpr (F::SUPER) {
    if (m > QUAD_ROWS<F::BITS>) {
      // NOTE: more than one tile of rows: each panel's scales computed once per call and quad, not once per tile
      // (Q4_K at 8 rows 1.11x the per-group fp32 form's time, per tile; 1.00x so); the same values, the same bits
      thread_local std::unique_ptr<float[]> buf;
      thread_local int64_t size = 0;
      const int64_t np = QUAD * (u1 - u0);
      Packed expanded = w;
      expanded.scales = w.scales.expand<F>(QUAD * u0, np, scratch(buf, size, 2 * np * w.groups * W));
      return run<Fmt<F::BITS, false, F::OFFSET>, Y>(expanded, a, m, out, n, bias, u0, u1);
    }
  }
  if (m <= QUAD_MAX_ROWS<F::BITS>) {
    static constexpr auto quad_tiles = tiles<F, Y, 4>(std::make_integer_sequence<int, QUAD_ROWS<F::BITS>>{});
    for (int64_t u = u0; u < u1; ++u)
      row_blocks(m, QUAD_ROWS<F::BITS>, [&](int64_t r, int nr) {
        quad_tiles[nr - 1](a.rows_from(r), w, u * QUAD, y + r * n, n, bias);
      });
    return;
  }
  static constexpr auto row_tiles = tiles<F, Y, 2>(std::make_integer_sequence<int, Q8_ROWS>{});
  // NOTE: a quad's padding may hold whole pairs of panels past n: never computed
  const int64_t p1 = std::min(QUAD * u1, (n + 2 * W - 1) / (2 * W) * 2);
  // Tiles from 16 rows on for 8-bit codes, from 32 for 4-bit ones (whose vector tiles are as fast up to 32
  // rows; measured on the AMX Xeon, bench_linear: Q4_1 at 32 rows 305 against 303 GFLOP/s, at 64 381 against 326)
  const int64_t min_rows = F::BITS == 8 ? AMX_ROWS : 2 * AMX_ROWS;
  const int64_t tiled = TILES && m >= min_rows ? m / AMX_ROWS * AMX_ROWS : 0;
#if ATTNSERVE_AMX_INT8
  if (tiled > 0) amx_rows<F, Y>(a, w, tiled, QUAD * u0, std::min(QUAD * u1, (n + W - 1) / W), y, n, bias);
#endif
  if (tiled == m) return;
  const Acts rest = a.rows_from(tiled);
  for (int64_t p = QUAD * u0; p < p1; p += 2)
    row_blocks(m - tiled, Q8_ROWS, [&](int64_t r, int nr) {
      row_tiles[nr - 1](rest.rows_from(r), w, p, y + (tiled + r) * n, n, bias);
    });
}

using RunFn = void (*)(const Packed&, const Acts&, int64_t, void*, int64_t, const float*, int64_t, int64_t);

// A kernel's instance for each format (code width, scale form, offsets): `make(Fmt<...>{})` names it. The
// superblock form comes as 4-bit codes with mins (Q4_K) or 8-bit codes with (Q5_K) or without (Q6_K, Q3_K,
// IQ4_XS); check_records refuses the rest.
template <typename Fn, typename Make>
Fn for_format(int64_t bits, Form form, bool offsets, Make make) {
  // NOTE: 5- and 6-bit codes only as GGUF gives them: Q6_K (records without mins, or their expansion), Q5_K
  // (records with mins, or their expansion) and Q5_1 (fp16, offsets; none where every one is 0); linear() refuses
  // the rest
  if (bits == 6) return form == Form::SUPER ? make(Fmt<6, true, false, true>{}) : make(Fmt<6, false, false>{});
  if (bits == 5) {
    if (form == Form::SUPER) return make(Fmt<5, true, true, true>{});
    if (!offsets) return form == Form::F16 ? make(Fmt<5, true, false>{}) : make(Fmt<5, false, false>{});
    return form == Form::F16 ? make(Fmt<5, true, true>{}) : make(Fmt<5, false, true>{});
  }
  if (form == Form::SUPER) {
    if (!offsets) return make(Fmt<8, true, false, true>{});
    return bits == 4 ? make(Fmt<4, true, true, true>{}) : make(Fmt<8, true, true, true>{});
  }
  const bool half = form == Form::F16;
  const Fn fns[2][2][2] = {{{make(Fmt<4, false, false>{}), make(Fmt<4, false, true>{})},
                            {make(Fmt<4, true, false>{}), make(Fmt<4, true, true>{})}},
                           {{make(Fmt<8, false, false>{}), make(Fmt<8, false, true>{})},
                            {make(Fmt<8, true, false>{}), make(Fmt<8, true, true>{})}}};
  return fns[bits == 8][half][offsets];
}

template <typename Y>
RunFn format_runner(int64_t bits, const Packed& w) {
  return for_format<RunFn>(bits, w.scales.form, w.scales.offsets != nullptr,
                           [](auto f) -> RunFn { return &run<decltype(f), Y>; });
}

// The activation block for a group size: 32, or the group itself when it is 16 (Q6_K).
inline int64_t act_block(int64_t group) { return group % 32 == 0 ? 32 : group; }

// x (M, K) fp32 or bf16 -> int8 codes, block scales and the offsets' factor, row by row; W values at a time
// (a block of 16 or 32 is whole vectors at every level). NOTE: the same values as rounding each input with
// nearbyint: t + 1.5 * 2^23 - 1.5 * 2^23 rounds |t| <= 127 to the nearest integer, ties to even, as the
// default rounding mode does; and the same sums in the same order.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k_dim, int64_t block, int64_t group, int8_t* q, float* d,
                   float* xq, int32_t* qs) {
  const int64_t blocks = k_dim / block, groups = k_dim / group, per_group = group / block;
  const vf round = splat(12582912.0f), hi = splat(127.f), lo = splat(-127.f);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        float offset_factor = 0.f;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
          const T* xb = x + r * k_dim + b * block;
          int8_t* qb = q + r * k_dim + b * block;
          vf vmax{};
          for (int64_t i = 0; i < block; i += W) {
            const vf v = load_vec(xb + i);
            const vf a = v < vf{} ? -v : v;
            vmax = a > vmax ? a : vmax;
          }
          const float amax = hmax(vmax);
          const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
          vi sums{};
          for (int64_t i = 0; i < block; i += W) {
            vf t = load_vec(xb + i) * splat(inv);
            t = t > hi ? hi : t;
            t = t < lo ? lo : t;
            const vi v = __builtin_convertvector((t + round) - round, vi);
            sums += v;
            const vsb b = __builtin_convertvector(v, vsb);
            std::memcpy(qb + i, &b, sizeof b);
          }
          d[r * blocks + b] = scale;
          qs[r * blocks + b] = hsum(sums);
          offset_factor += scale * float(qs[r * blocks + b]);
        }
        xq[r * groups + g] = offset_factor;
      }
    }
  });
}

// Where code k of a panel's feature j lies: (byte from the panel's first row, shift of its nibble). 8-bit codes:
// 4 consecutive inputs per lane and step; 4-bit: byte t of a lane's step holds input t (low nibble) and t + 4
// (high). Packing and reading rows (pack_panels, unpack_rows) share it.
inline std::pair<int64_t, int> code_place(int64_t bits, int64_t j, int64_t k) {
  if (bits == 8) return {(k / 4) * STEP_STRIDE + 4 * j + k % 4, 0};
  const int64_t t = k % 8;
  return {nibble_row(int(bits), k / 8) * STEP_STRIDE + 4 * j + t % 4, t < 4 ? 0 : 4};
}

// Where the bits above the nibble of a 5- or 6-bit code lie (code_planes.h): its plane row's byte, and the shift
inline std::pair<int64_t, int> high_place(int64_t bits, int64_t j, int64_t k) {
  const int64_t s = k / 8, t = k % 8;
  return {plane_row(int(bits), s) * STEP_STRIDE + 4 * j + t % 4,
          plane_shift(int(bits), s % plane_steps(int(bits)), t < 4 ? 0 : 1)};
}

// `superblocks` (N, K / 256, bytes; group_scales.h pack_records): the superblock scale form from them, scale and
// offset then only say which format it is (an offset: one with mins)
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack(const at::Tensor& q, const at::Tensor& scale,
                                                    const std::optional<at::Tensor>& offset, int64_t bits,
                                                    int64_t group, const std::optional<at::Tensor>& superblocks) {
  TORCH_CHECK(group % 32 == 0 || (bits >= 6 && group == 16),
              "8-bit activations need groups of a multiple of 32 (or 16 for 8- and 6-bit codes)");
  TORCH_CHECK(bits != 6 || group == 16, "6-bit codes come in groups of 16 (Q6_K)");
  TORCH_CHECK(bits != 5 || group % 32 == 0, "5-bit codes come in groups of 32");
  if (!superblocks.has_value()) return pack_panels<code_place, LANE_BYTES, high_place>(q, scale, offset, bits, group);
  at::Tensor codes = pack_codes<code_place, LANE_BYTES, high_place>(q, bits);
  TORCH_CHECK(superblocks->size(0) == q.size(0) && superblocks->size(1) * SUPER == q.size(1),
              "superblocks must be (out_features, in_features / 256, bytes)");
  auto [records, dmin] = pack_records(*superblocks, offset.has_value(), group, codes.size(0));
  check_records(records, dmin, bits, group, q.size(1), codes.size(0));
  return {codes, records, dmin};
}

// A call's tasks: whole quads of panels, and where a prefill's rows are many, chunks of `rows_per` rows (a
// multiple of `align`). NOTE: whole quads of panels per task: no tile straddles two threads. A narrow output (a
// small model's o_proj and down_proj: 9 quads) left a thread idle for a quad's time at the end of every call, so a
// prefill's rows go in chunks too: a row's arithmetic is the same whichever chunk it is in.
// NOTE: tasks go to whichever thread is free, in shrinking runs (guided: each thread's first run is contiguous,
// as fixed halves were, for the prefetchers), not in fixed halves: a thread the OS takes away for a while (a
// serving stack's other processes share these cores) leaves its tasks to the other instead of stalling the
// call. Which thread runs a task changes no bit of it
template <typename Task>
void run_tasks(int64_t m, int64_t quads, int64_t align, Task&& task, int64_t row_tasks = ROW_TASKS) {
  const int64_t chunks = m >= PREFILL_ROWS ? std::min<int64_t>(m / PREFILL_ROWS, row_tasks / quads + 1) : 1;
  const int64_t rows_per = ((m + chunks - 1) / chunks + align - 1) / align * align;
  const int64_t tasks = quads * chunks;
  const int num_threads = int(std::clamp<int64_t>(at::get_num_threads(), 1, tasks));
#pragma omp parallel for schedule(guided) num_threads(num_threads)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t u = t / chunks, r0 = (t % chunks) * rows_per, r1 = std::min(m, r0 + rows_per);
    if (r0 < r1) task(u, r0, r1);
  }
}

// y (M, N) from x (M, K) fp32 or bf16 rounded to int8 per block
void int8_rows(const at::Tensor& xc, const Packed& w, int64_t bits, const at::Tensor& y,
               const float* bias) {
  const int64_t m = xc.size(0), k_dim = w.k_dim, block = act_block(w.group), n = y.size(1);
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  thread_local std::unique_ptr<int8_t[]> q_buf;
  thread_local std::unique_ptr<float[]> d_buf, xq_buf;
  thread_local std::unique_ptr<int32_t[]> qs_buf;
  thread_local int64_t q_size = 0, d_size = 0, xq_size = 0, qs_size = 0;
  int8_t* qx = scratch(q_buf, q_size, m * k_dim);
  float* d = scratch(d_buf, d_size, m * (k_dim / block));
  float* xq = scratch(xq_buf, xq_size, m * w.groups);
  int32_t* qs = scratch(qs_buf, qs_size, m * (k_dim / block));
  if (bf16)
    quantize_rows(xc.data_ptr<c10::BFloat16>(), m, k_dim, block, w.group, qx, d, xq, qs);
  else
    quantize_rows(xc.data_ptr<float>(), m, k_dim, block, w.group, qx, d, xq, qs);
  const Acts a{qx, d, xq, qs, k_dim, block, k_dim / block, w.groups};
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t item = y.element_size();
  const auto fn = bf16 ? format_runner<c10::BFloat16>(bits, w) : format_runner<float>(bits, w);
  // NOTE: on AMX, chunks of whole x tiles, so that only the call's last rows miss them
  run_tasks(m, w.quads(), TILES ? AMX_ROWS : 1, [&](int64_t u, int64_t r0, int64_t r1) {
    fn(w, a.rows_from(r0), r1 - r0, yp + r0 * n * item, n, bias, u, u + 1);
  });
}

#if ATTNSERVE_AMX_BF16
// Quad u of the output: its panels that hold features
template <typename F, typename Y>
void bf16_quad(const uint16_t* x, int64_t m, const uint16_t* pad, const Packed& w, int64_t u, void* y, int64_t n,
               const float* bias) {
  bf16_rows<F, Y>(x, m, pad, w, QUAD * u, std::min(QUAD * (u + 1), (n + W - 1) / W), static_cast<Y*>(y), n, bias);
}

using Bf16Fn = void (*)(const uint16_t*, int64_t, const uint16_t*, const Packed&, int64_t, void*, int64_t, const float*);

template <typename Y>
Bf16Fn bf16_runner(int64_t bits, const Packed& w) {
  return for_format<Bf16Fn>(bits, w.scales.form, w.scales.offsets != nullptr,
                            [](auto f) -> Bf16Fn { return &bf16_quad<decltype(f), Y>; });
}

// y (M, N) from x (M, K) in bf16 on the tiles
void bf16_rows_of(const at::Tensor& xc, const Packed& w, int64_t bits, const at::Tensor& y, const float* bias) {
  const int64_t m = xc.size(0), k_dim = w.k_dim, n = y.size(1), tail = m % AMX_ROWS;
  const at::Tensor xb = xc.to(at::kBFloat16).contiguous();  // (M, K)
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  // NOTE: the last m % 16 rows zero padded to a whole tile: no tile load reads past x
  thread_local std::unique_ptr<uint16_t[]> pad_buf;
  thread_local int64_t pad_size = 0;
  uint16_t* pad_rows = tail > 0 ? scratch(pad_buf, pad_size, AMX_ROWS * k_dim) : nullptr;
  if (tail > 0) {
    std::memcpy(pad_rows, x + (m - tail) * k_dim, tail * k_dim * 2);
    std::memset(pad_rows + tail * k_dim, 0, (AMX_ROWS - tail) * k_dim * 2);
  }
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t item = y.element_size();
  const auto fn = y.scalar_type() == at::kBFloat16 ? bf16_runner<c10::BFloat16>(bits, w) : bf16_runner<float>(bits, w);
  // NOTE: each task dequantizes its quad's codes: a narrow output's rows in fewer chunks than the int8 kernel's
  run_tasks(m, w.quads(), AMX_ROWS, [&](int64_t u, int64_t r0, int64_t r1) {
    fn(x + r0 * k_dim, r1 - r0, r1 == m ? pad_rows : nullptr, w, u, yp + r0 * n * item, n, bias);
  }, BF16_ROW_TASKS);
}
constexpr bool BF16_TILES = true;
#else
void bf16_rows_of(const at::Tensor&, const Packed&, int64_t, const at::Tensor&, const float*) {}
constexpr bool BF16_TILES = false;
#endif

// x (..., K) -> (..., N). `prompt_rows` (M,) bool, in the amx build: those rows on bf16 tiles, the rest int8. A row
// takes one kernel or the other by what it is (models/quant_linear.py), never by what else is in the call.
at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                  const std::optional<at::Tensor>& bias, int64_t bits, int64_t group, int64_t out_features,
                  const std::optional<at::Tensor>& prompt_rows) {
  const auto [m, groups] = check_packed(x, codes, scales, offsets, bits, group, out_features, true);
  TORCH_CHECK(group % 32 == 0 || (bits == 8 && group == 16) || (bits == 6 && group == 16),
              "groups must be packed by this library");
  TORCH_CHECK(bits != 6 || (group == 16 && offsets.numel() == 0), "6-bit codes: groups of 16, no offsets (Q6_K)");
  TORCH_CHECK(bits != 5 || group % 32 == 0, "5-bit codes: groups of 32 (Q5_K, Q5_1)");
  const int64_t k_dim = x.size(-1);
  const bool has_offsets = offsets.numel() > 0;
  // NOTE: bf16 is read as it is (widened exactly in quantize_rows); other dtypes go through fp32
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = (bf16 ? x : x.to(at::kFloat)).reshape({-1, k_dim}).contiguous();  // (M, K)
  // NOTE: bf16 rows give bf16 rows, rounded in the tile store as Tensor.to would round the fp32 ones
  const LinearOut out = linear_out(x, m, out_features, bias, bf16 ? at::kBFloat16 : at::kFloat);
  const GroupScales gs{scales.data_ptr(), has_offsets ? offsets.data_ptr() : nullptr, groups, group, form_of(scales)};
  const Packed w{codes.data_ptr<uint8_t>(), gs, k_dim, group, groups, codes.size(1), codes.size(0)};
  at::Tensor tiled;  // (P,) the prompt rows' indices
  if (prompt_rows.has_value())
    TORCH_CHECK(prompt_rows->numel() == m && prompt_rows->scalar_type() == at::kBool, "prompt_rows: (M,) bool");
  // NOTE: the tiles take inputs 32 at a time: a K of 16 x an odd number (groups of 16) stays on the int8 kernel
  if (BF16_TILES && prompt_rows.has_value() && m > 0 && k_dim % 32 == 0) tiled = prompt_rows->nonzero().view(-1);
  if (!tiled.defined() || tiled.numel() == 0) {
    if (m > 0) int8_rows(xc, w, bits, out.y, out.bias_ptr());
  } else if (tiled.numel() == m) {
    bf16_rows_of(xc, w, bits, out.y, out.bias_ptr());
  } else {
    const at::Tensor rest = prompt_rows->logical_not().nonzero().view(-1);
    at::Tensor y_tiled = at::empty({tiled.numel(), out_features}, out.y.options());
    at::Tensor y_rest = at::empty({rest.numel(), out_features}, out.y.options());
    bf16_rows_of(xc.index_select(0, tiled), w, bits, y_tiled, out.bias_ptr());
    int8_rows(xc.index_select(0, rest), w, bits, y_rest, out.bias_ptr());
    out.y.index_copy_(0, tiled, y_tiled);
    out.y.index_copy_(0, rest, y_rest);
  }
  return out.result(x);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("q8_linear", &linear);
  m.impl("pack_q8", &pack);
  m.impl("q8_rows", &unpack_rows<code_place, LANE_BYTES, high_place>);
}
