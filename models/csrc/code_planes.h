// 5- and 6-bit codes in their own bits (q8_linear.cpp; Q5_K and Q5_1 as 5 bits, Q6_K as 6), where 8-bit codes
// took 8 bits a weight: 4-bit nibbles laid out as the 4-bit codes are, and the codes' high bits in a plane row
// after each block of steps, whose bits are merged into the nibbles as the kernel reaches each step.
//
// A panel's codes are rows of LANE_BYTES (W lanes x 4 bytes; a step of 8 inputs is one row of nibbles: byte t of a
// lane = code(k + t) | code(k + 4 + t) << 4). 5-bit codes go in blocks of 4 steps (32 inputs): 4 nibble rows, then
// one plane row whose byte t of a lane holds, at bit 2i + h, the fifth bit of step i's code t + 4h. 6-bit codes go
// in blocks of 2 steps (16 inputs, Q6_K's groups): 2 nibble rows, then a plane row with, at bits 4i + 2h and up,
// the top two bits of step i's code t + 4h. A block is the activation block of its format (32 and 16 inputs).
// 6-bit codes are stored as code + 32 (Q6_K's are -32..31) and the kernels take the 32s back from the integer
// sums exactly (32 x the block's sum of x); 5-bit codes are unsigned (Q5_K, Q5_1: 0..31, with offsets).
//
// IQ4_NL's and IQ4_XS's codes are a table's values (16 int8s, non-uniform): held as their 4-bit indices
// (`bits` = TABLE), laid out as 4-bit codes, and looked up per step with a byte shuffle (vpshufb), where 8-bit codes
// of the values took twice the bytes.
#pragma once

#include <cstdint>

#include "simd.h"

namespace {

constexpr int TABLE = -4;  // `bits` of table codes: 4-bit indices into TABLE_VALUES
inline constexpr int8_t TABLE_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int code_width(int bits) { return bits == TABLE ? 4 : bits; }  // bits a code takes in the panel
constexpr bool planes(int bits) { return bits == 5 || bits == 6; }
constexpr bool own_width(int bits) { return planes(bits) || bits == TABLE; }  // the int8 kernel's forms only
constexpr int plane_steps(int bits) { return bits == 5 ? 4 : bits == 6 ? 2 : 1; }  // steps per block
constexpr int code_bias(int bits) { return bits == 6 ? 32 : 0; }  // stored code - value

// The row (of LANE_BYTES) that holds step s's nibbles, and the plane row of the block holding step s
inline int64_t nibble_row(int bits, int64_t s) {
  return planes(bits) ? s / plane_steps(bits) * (plane_steps(bits) + 1) + s % plane_steps(bits) : s;
}
inline int64_t plane_row(int bits, int64_t s) {
  return s / plane_steps(bits) * (plane_steps(bits) + 1) + plane_steps(bits);
}

// Where a code's high bits lie in its plane row's byte, and how many (codes of step i, half h: t + 4h)
inline int plane_shift(int bits, int64_t i, int h) { return bits == 5 ? int(2 * i + h) : int(4 * i + 2 * h); }

// Step i of a block: its nibbles (lo: inputs k + t; hi: k + 4 + t) given their high bits from the block's plane
// row: the plane's bits for (i, h) moved to bit 4 (and 5), masked, or'ed in. Shifts of 16-bit lanes: what crosses
// a byte is masked off.
template <int BITS, int I>
inline void merge_plane(vq plane, vq& lo, vq& hi) {
  static_assert(planes(BITS));
  constexpr uint8_t MASK = BITS == 5 ? 0x10 : 0x30;
  constexpr int LO = BITS == 5 ? 2 * I : 4 * I, HI = LO + (BITS == 5 ? 1 : 2);
  lo = or_q(lo, and_q(shift16<4 - LO>(plane), splat8(MASK)));
  hi = or_q(hi, and_q(shift16<4 - HI>(plane), splat8(MASK)));
}

// Table codes' index (0..15) of a value, or -1 where it is none of TABLE_VALUES
inline int table_index(int value) {
  for (int i = 0; i < 16; ++i)
    if (TABLE_VALUES[i] == value) return i;
  return -1;
}

// Step s's 8-bit codes of one panel (stored values, unsigned; table codes: their values, signed): lo for inputs
// k + t, hi for k + 4 + t
template <int BITS>
inline void step_codes(const uint8_t* panel, int64_t s, int64_t stride, vq& lo, vq& hi) {
  nibbles(load_q(panel + nibble_row(BITS, s) * stride), lo, hi);
  if constexpr (BITS == TABLE) {
    const vq table = table16(TABLE_VALUES);
    lo = lookup16(table, lo);
    hi = lookup16(table, hi);
  }
  if constexpr (planes(BITS)) {
    const vq plane = load_q(panel + plane_row(BITS, s) * stride);
    const int64_t i = s % plane_steps(BITS);
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((i == I ? merge_plane<BITS, I>(plane, lo, hi) : void()), ...);
    }(std::make_integer_sequence<int, plane_steps(BITS)>{});
  }
}

}  // namespace
