// The AMX tile configuration the amx builds share (q8_linear.cpp, kvcache/csrc/paged_attention.cpp). Part of
// every library's build hash, as every header here is.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <immintrin.h>

namespace {

// Palette 1: each tile's rows and bytes per row (unused tiles 0 x 0)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

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
