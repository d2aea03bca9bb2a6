// The vector tiles of the 8-bit-activation kernel (q8_linear.cpp): a panel's codes and scales (Packed), a call's
// rows of x rounded to int8 (Acts), and tile<>: R rows x NP panels in registers, per block the exact integer sums
// then the fp32 steps every path shares.
#pragma once

#include <array>
#include <memory>

#include "code_planes.h"
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
  // table codes' values (flipped, as 8-bit codes are, where VNNI takes them unsigned)
  [[maybe_unused]] const vq table = [] {
    if constexpr (FLIPPED_CODES) return flip_signs(table16(TABLE_VALUES));
    else return table16(TABLE_VALUES);
  }();
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
          if constexpr ((F::BITS == 8 || F::BITS == TABLE) && FLIPPED_CODES)
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
          if constexpr (F::BITS != 8) x1[r] = bcast4(a.q + r * a.k_dim + k + 4);
        }
        for (int p = 0; p < NP; ++p) {
          __builtin_prefetch(codes[p] + (step + PREFETCH_STEPS) * STEP_STRIDE, 0, PREFETCH_LOCALITY);
          const vq c = load_q(codes[p] + step * STEP_STRIDE);
          if constexpr (F::BITS == 8 && FLIPPED_CODES) {
            const vq u = flip_signs(c);
            for (int r = 0; r < R; ++r) isum[r][p] = dot_us(isum[r][p], u, x0[r]);
          } else if constexpr (F::BITS == 8) {
            for (int r = 0; r < R; ++r) isum[r][p] = dot_ss(isum[r][p], c, x0[r]);
          } else if constexpr (F::BITS == TABLE) {
            vq lo, hi;
            nibbles(c, lo, hi);
            lo = lookup16(table, lo);
            hi = lookup16(table, hi);
            for (int r = 0; r < R; ++r) {
              if constexpr (FLIPPED_CODES)
                isum[r][p] = dot_us(dot_us(isum[r][p], lo, x0[r]), hi, x1[r]);
              else
                isum[r][p] = dot_ss(dot_ss(isum[r][p], lo, x0[r]), hi, x1[r]);
            }
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

}  // namespace
