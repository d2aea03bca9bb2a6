// The AMX tile configuration the amx builds share (q8_linear.cpp, kvcache/csrc/paged_attention.cpp). Part of
// every library's build hash, as every header here is.
//
// ATTNSERVE_AMX_TILE / _INT8 / _BF16 say which tile instructions the build has: the CPU's (-mamx-*), or, in the
// emulated build (-DATTNSERVE_AMX_EMULATED, models/native/toolchain.py), this header's software tiles. Those
// follow the SDM's pseudo-code for each instruction and fault (abort) where the hardware would (#UD, #GP), so
// that the amx build's kernels run, and are tested, on a CPU without AMX: `make test-isa` on AVX512-BF16.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) || defined(ATTNSERVE_AMX_EMULATED)
#define ATTNSERVE_AMX_TILE 1
#define ATTNSERVE_AMX_INT8 1
#define ATTNSERVE_AMX_BF16 1
#else
#define ATTNSERVE_AMX_TILE 0
#define ATTNSERVE_AMX_INT8 0
#define ATTNSERVE_AMX_BF16 0
#endif

#if ATTNSERVE_AMX_TILE
#include <immintrin.h>

namespace {

// Palette 1: each tile's rows and bytes per row (unused tiles 0 x 0)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

#if defined(ATTNSERVE_AMX_EMULATED)
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace amx_emulated {
namespace {

constexpr int TILES = 8, MAX_ROWS = 16, MAX_COLSB = 64;

struct Registers {
  bool configured = false;
  uint16_t colsb[TILES] = {};
  uint8_t rows[TILES] = {};
  alignas(64) uint8_t data[TILES][MAX_ROWS][MAX_COLSB] = {};
};
thread_local Registers regs;

[[noreturn]] inline void fault(const char* what) {
  std::fprintf(stderr, "attnserve: emulated AMX fault: %s\n", what);
  std::abort();
}

inline void load_config(const void* config) {
  TileConfig c;
  std::memcpy(&c, config, sizeof c);
  if (c.palette != 1) fault("ldtilecfg: palette is not 1");
  if (c.start_row != 0) fault("ldtilecfg: start_row is not 0");
  for (uint8_t b : c.reserved)
    if (b) fault("ldtilecfg: reserved bytes are not 0");
  for (int t = 0; t < 16; ++t) {
    const bool used = t < TILES;
    if (!used && (c.rows[t] || c.colsb[t])) fault("ldtilecfg: a tile beyond the 8 has rows or bytes");
    if (c.rows[t] > MAX_ROWS || c.colsb[t] > MAX_COLSB) fault("ldtilecfg: a tile over 16 rows or 64 bytes a row");
    if ((c.rows[t] == 0) != (c.colsb[t] == 0)) fault("ldtilecfg: a tile with rows but no bytes, or bytes but no rows");
  }
  regs = Registers{};
  regs.configured = true;
  for (int t = 0; t < TILES; ++t) regs.rows[t] = c.rows[t], regs.colsb[t] = c.colsb[t];
}

inline void release() { regs = Registers{}; }

inline void check(int t) {
  if (!regs.configured) fault("a tile instruction before ldtilecfg (or after tilerelease)");
  if (t < 0 || t >= TILES || regs.rows[t] == 0) fault("a tile that the configuration leaves unused");
}

inline void zero(int t) {
  check(t);
  std::memset(regs.data[t], 0, sizeof regs.data[t]);
}

inline void load(int t, const void* base, int64_t stride) {
  check(t);
  zero(t);
  for (int r = 0; r < regs.rows[t]; ++r)
    std::memcpy(regs.data[t][r], static_cast<const char*>(base) + r * stride, regs.colsb[t]);
}

inline void store(int t, void* base, int64_t stride) {
  check(t);
  for (int r = 0; r < regs.rows[t]; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, regs.data[t][r], regs.colsb[t]);
}

// dst (M x N dwords) += a (M x K dwords) . b (K x N dwords), each dword a group of bytes or bf16 pairs
inline void check_dot(int dst, int a, int b) {
  check(dst), check(a), check(b);
  if (dst == a || dst == b || a == b) fault("a dot product with a tile named twice");
  if (regs.rows[dst] != regs.rows[a]) fault("a dot product whose A rows differ from the destination's");
  if (regs.colsb[dst] != regs.colsb[b]) fault("a dot product whose B bytes a row differ from the destination's");
  if (regs.colsb[a] / 4 != regs.rows[b]) fault("a dot product whose A dwords a row differ from B's rows");
  if (regs.colsb[a] % 4 || regs.colsb[dst] % 4) fault("a dot product over a part of a dword");
}

// Each destination element (an Acc) takes `step(acc, A's dword k, B's dword k)` for k ascending
template <typename Acc, typename Step>
inline void dot(int dst, int a, int b, Step step) {
  check_dot(dst, a, b);
  for (int m = 0; m < regs.rows[dst]; ++m)
    for (int n = 0; n < regs.colsb[dst] / 4; ++n) {
      Acc acc;
      std::memcpy(&acc, regs.data[dst][m] + 4 * n, 4);
      for (int k = 0; k < regs.colsb[a] / 4; ++k) acc = step(acc, regs.data[a][m] + 4 * k, regs.data[b][k] + 4 * n);
      std::memcpy(regs.data[dst][m] + 4 * n, &acc, 4);
    }
}

template <typename A, typename B>
inline void dot_bytes(int dst, int a, int b) {
  dot<int32_t>(dst, a, b, [](int32_t acc, const uint8_t* x, const uint8_t* y) {
    for (int i = 0; i < 4; ++i)  // NOTE: int32 wraps on overflow, as the instruction's sums do
      acc = int32_t(uint32_t(acc) + uint32_t(int32_t(A(x[i])) * int32_t(B(y[i]))));
    return acc;
  });
}

// A denormal fp32 as a zero of its sign: the instruction's DAZ on its inputs and FTZ on its results
inline float ftz(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float bf16_daz(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return ftz(f);
}

// The SDM's order: per destination element, pair k's even product added, then its odd one, k ascending; each
// product exact in fp32, each add rounded to nearest even
inline void dot_bf16(int dst, int a, int b) {
  dot<float>(dst, a, b, [](float acc, const uint8_t* x, const uint8_t* y) {
    acc = ftz(acc + bf16_daz(x) * bf16_daz(y));
    return ftz(acc + bf16_daz(x + 2) * bf16_daz(y + 2));
  });
}

}  // namespace
}  // namespace amx_emulated

// The intrinsics the kernels name, in place of immintrin.h's (which would emit the instructions)
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) amx_emulated::load_config(config)
#define _tile_release() amx_emulated::release()
#define _tile_loadd(t, base, stride) amx_emulated::load(t, base, stride)
#define _tile_stored(t, base, stride) amx_emulated::store(t, base, stride)
#define _tile_zero(t) amx_emulated::zero(t)
#define _tile_dpbssd(dst, a, b) amx_emulated::dot_bytes<int8_t, int8_t>(dst, a, b)
#define _tile_dpbsud(dst, a, b) amx_emulated::dot_bytes<int8_t, uint8_t>(dst, a, b)
#define _tile_dpbf16ps(dst, a, b) amx_emulated::dot_bf16(dst, a, b)
#endif

namespace {

inline void load_tile_config(const TileConfig& c) {
  // NOTE: the builtin does not tell GCC that it reads c: without the barrier the stores that filled it are
  // dropped and the first tile instruction faults (#UD: tiles not configured)
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// GCC's tile intrinsics are asm statements that name no memory: these tell the compiler that a tile store
// wrote `buf` (so reads of it stay after it) and that a tile load is about to read memory stored before.
template <typename T>
inline void tile_wrote(T& buf) { asm volatile("" : "+m"(*reinterpret_cast<char (*)[sizeof(T)]>(&buf))); }
inline void tile_reads_memory() { asm volatile("" : : : "memory"); }

}  // namespace
#endif
