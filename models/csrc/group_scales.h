// The forms a packed matrix's group scales (and offsets) take, what checks them, and the reading of rows that
// any form serves (quant_rows, q8_rows). Two forms hold a value per panel, group and feature: fp32, or fp16 where
// every value is exactly one (quant_panels.h pack_panels).
//
// The superblock form (q8_linear.cpp only) keeps K-quant scales as their GGUF files store them: per panel and
// super-block of 256 inputs, one record of W lanes, from which a group's W scales (and offsets) are computed
// when the kernel reaches the group, instead of being held as fp32 per group (4 bytes a group and feature:
// Q4_K's 4-bit codes took 6 bits a weight; with its own 12 bytes of 6-bit scales, 4.5, the file's).
//
// Two record layouts, by whether the format has mins (offsets):
//   with mins (Q4_K, Q5_K: groups of 32): d (W fp16), then the 12 scale bytes of each lane as three
//     little-endian words, word t of every lane before word t + 1 (3 x W uint32): 14 W bytes; and dmin in the
//     offsets tensor (W fp16 per record). Group i's 6-bit scale and min: ggml's get_scale_min_k4.
//   without, groups of 16 (Q6_K, Q3_K): d (W fp16), then each group's signed scale (W int8 per group): 18 W bytes;
//   without, groups of 32 (IQ4_XS): its file's 8 bytes, d (W fp16), scales_h (W uint16: 2 high bits of each of
//     the 8 scales) and scales_l (W uint32: their low nibbles); a scale is those 6 bits - 32.
// scale = d * sc and offset = -(dmin * m), each one fp32 product of exact values: the values
// models/quant_formats.py's decoders give (the reference's), so a weight's bits do not depend on the form.
#pragma once

#include "quant_panels.h"

namespace {

constexpr int64_t SUPER = 256;  // inputs per super-block
constexpr int64_t MIN_RECORD = 14;  // bytes per lane of a record with mins

constexpr int64_t PACKED_SCALES_GROUP = 32;  // records without mins of this group size: IQ4_XS's 6-bit scales

inline int64_t record_bytes(bool mins, int64_t group) {
  return (mins ? MIN_RECORD : group == PACKED_SCALES_GROUP ? 8 : 2 + SUPER / group) * W;
}

inline vu load_words(const uint8_t* p) {
  vu v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf to_f(vu v) { return __builtin_convertvector(__builtin_convertvector(v, vi), vf); }

enum class Form { F32, F16, SUPER };

inline Form form_of(const at::Tensor& scales) {
  return scales.scalar_type() == at::kByte ? Form::SUPER : scales.scalar_type() == at::kHalf ? Form::F16 : Form::F32;
}

// A packed matrix's scale form: where group g of panel p finds its W scales and offsets
struct GroupScales {
  const void* scales;  // (panels, groups, W) fp32 or fp16; superblock form: (panels, supers, record) bytes
  const void* offsets;  // as scales; superblock form: (panels, supers, W) fp16 dmin; nullptr: none
  int64_t groups, group;
  Form form;
  int64_t panel0 = 0;  // the first panel the per-group forms hold (an expanded part: expand())

  int64_t supers() const { return groups * group / SUPER; }
  const uint8_t* record(int64_t p, int64_t g, bool mins) const {
    return static_cast<const uint8_t*>(scales) + (p * supers() + g * group / SUPER) * record_bytes(mins, group);
  }

  // group i of a record with mins: its (scale, min) codes, 6 bits each (for i >= 4, the top two bits sit at bits 6-7
  // of byte i - 4 of words 0 and 1: shifted by 2, masked to bits 4-5)
  static std::pair<vu, vu> scale_min(const uint8_t* rec, int64_t i) {
    const vu w0 = load_words(rec + 2 * W), w1 = load_words(rec + 6 * W);
    if (i < 4) return {(w0 >> (8 * i)) & 63u, (w1 >> (8 * i)) & 63u};
    const vu w2 = load_words(rec + 10 * W);
    const int s = int(8 * (i - 4));
    return {((w2 >> s) & 15u) | ((w0 >> (s + 2)) & 48u), ((w2 >> (s + 4)) & 15u) | ((w1 >> (s + 2)) & 48u)};
  }

  // group i's signed scale of a record without mins, as fp32 (exact): an int8, or IQ4_XS's 6 bits - 32
  vf signed_scale(const uint8_t* rec, int64_t i) const {
    if (group != PACKED_SCALES_GROUP) return load_i8_f(rec + (2 + i) * W);
    vh h;
    std::memcpy(&h, rec + 2 * W, sizeof h);
    const vu high = (__builtin_convertvector(h, vu) >> (2 * i)) & 3u;
    const vu code = ((load_words(rec + 4 * W) >> (4 * i)) & 15u) | (high << 4);
    return to_f(code) - 32.f;
  }

  template <typename F>
  vf scale(int64_t p, int64_t g) const {
    if constexpr (!F::SUPER) {
      return load_scales<F::HALF>(scales, ((p - panel0) * groups + g) * W);
    } else {
      const uint8_t* rec = record(p, g, F::OFFSET);
      const int64_t i = g % (SUPER / group);
      const vf d = load_scales<true>(rec, 0);
      if constexpr (F::OFFSET) {
        return d * to_f(scale_min(rec, i).first);
      } else {
        return d * signed_scale(rec, i);
      }
    }
  }

  template <typename F>
  vf offset(int64_t p, int64_t g) const {
    if constexpr (!F::SUPER) {
      return load_scales<F::HALF>(offsets, ((p - panel0) * groups + g) * W);
    } else {
      const vf dmin = load_scales<true>(offsets, (p * supers() + g * group / SUPER) * W);
      return -(dmin * to_f(scale_min(record(p, g, true), g % (SUPER / group)).second));
    }
  }

  // scale<F> and offset<F> (where F has offsets) at once: a record's words read once
  template <typename F>
  void scale_offset(int64_t p, int64_t g, vf& s, vf& o) const {
    if constexpr (!F::SUPER || !F::OFFSET) {
      s = scale<F>(p, g);
      if constexpr (F::OFFSET) o = offset<F>(p, g);
    } else {
      const uint8_t* rec = record(p, g, true);
      const auto [sc, m] = scale_min(rec, g % (SUPER / group));
      s = load_scales<true>(rec, 0) * to_f(sc);
      o = -(load_scales<true>(offsets, (p * supers() + g * group / SUPER) * W) * to_f(m));
    }
  }

  // Panels [p, p + np) in the fp32 per-group form, written to `buf` (2 np groups W floats): what a kernel that
  // reads each panel's scales for many tiles of rows takes, instead of computing them per tile
  // (a super-block's groups at once: its d, dmin and words read and widened once)
  template <typename F>
  GroupScales expand(int64_t p, int64_t np, float* buf) const {
    float* o = buf + np * groups * W;
    const int64_t per = SUPER / group;
    const auto put = [](float* at, vf v) { std::memcpy(at, &v, sizeof v); };
    for (int64_t i = 0; i < np; ++i)
      for (int64_t sb = 0; sb < supers(); ++sb) {
        const int64_t g0 = sb * per, at = (i * groups + g0) * W;
        const uint8_t* rec = record(p + i, g0, F::OFFSET);
        const vf d = load_scales<true>(rec, 0);
        if constexpr (F::OFFSET) {
          const vf dmin = load_scales<true>(offsets, ((p + i) * supers() + sb) * W);
          const vu w0 = load_words(rec + 2 * W), w1 = load_words(rec + 6 * W), w2 = load_words(rec + 10 * W);
          for (int k = 0; k < 4; ++k) {  // NOTE: scale_min's fields, each word read once
            put(buf + at + k * W, d * to_f((w0 >> (8 * k)) & 63u));
            put(o + at + k * W, -(dmin * to_f((w1 >> (8 * k)) & 63u)));
            put(buf + at + (4 + k) * W, d * to_f(((w2 >> (8 * k)) & 15u) | ((w0 >> (8 * k + 2)) & 48u)));
            put(o + at + (4 + k) * W, -(dmin * to_f(((w2 >> (8 * k + 4)) & 15u) | ((w1 >> (8 * k + 2)) & 48u))));
          }
        } else {
          for (int64_t k = 0; k < per; ++k) put(buf + at + k * W, d * signed_scale(rec, k));
        }
      }
    return {buf, F::OFFSET ? o : nullptr, groups, group, Form::F32, p};
  }

  // lane j of scale<F> (or offset<F>), the form known only at run time: reading rows, not a kernel's loop
  float lane(int64_t p, int64_t g, int64_t j, bool of_offset) const {
    using F32 = Fmt<8, false, true>;
    using F16 = Fmt<8, true, true>;
    using WithMins = Fmt<8, true, true, true>;
    using NoMins = Fmt<8, true, false, true>;
    if (form == Form::SUPER) {
      if (of_offset) return offset<WithMins>(p, g)[j];
      return offsets != nullptr ? scale<WithMins>(p, g)[j] : scale<NoMins>(p, g)[j];
    }
    if (form == Form::F16) return of_offset ? offset<F16>(p, g)[j] : scale<F16>(p, g)[j];
    return of_offset ? offset<F32>(p, g)[j] : scale<F32>(p, g)[j];
  }
};

// Superblocks (N, K / 256, 16 with mins: the block's first 16 bytes, d, dmin, 12 scale bytes; without, groups of
// 16: 18, d then an int8 scale per group; of 32: IQ4_XS's first 8 bytes) -> (records (panels, supers,
// record_bytes), dmin (panels, supers, W) fp16 or empty), zero padded as pack_panels pads the codes
inline std::pair<at::Tensor, at::Tensor> pack_records(const at::Tensor& superblocks, bool mins, int64_t group,
                                                      int64_t panels) {
  const bool packed_scales = !mins && group == PACKED_SCALES_GROUP;
  const int64_t in_bytes = mins ? 16 : packed_scales ? 8 : 2 + SUPER / group;
  TORCH_CHECK(superblocks.dim() == 3 && superblocks.scalar_type() == at::kByte && superblocks.size(2) == in_bytes,
              "superblocks must be uint8 (out_features, in_features / 256, ", in_bytes, ")");
  TORCH_CHECK(mins ? group == 32 : (group == 16 || group == 32), "superblock scales take groups of 32 (or 16 without mins)");
  const at::Tensor src = superblocks.contiguous();
  const int64_t n = src.size(0), supers = src.size(1), rec = record_bytes(mins, group);
  at::Tensor records = at::zeros({panels, supers, rec}, src.options());
  at::Tensor dmin = mins ? at::zeros({panels, supers, W}, src.options().dtype(at::kHalf)) : at::empty({0}, src.options().dtype(at::kHalf));
  const uint8_t* in = src.data_ptr<uint8_t>();
  uint8_t* out = records.data_ptr<uint8_t>();
  uint16_t* dm = mins ? reinterpret_cast<uint16_t*>(dmin.data_ptr()) : nullptr;
  for (int64_t row = 0; row < n; ++row) {
    const int64_t p = row / W, j = row % W;
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* b = in + (row * supers + s) * in_bytes;
      uint8_t* r = out + (p * supers + s) * rec;
      std::memcpy(r + 2 * j, b, 2);  // d
      if (mins) {
        std::memcpy(dm + (p * supers + s) * W + j, b + 2, 2);
        for (int t = 0; t < 3; ++t) std::memcpy(r + (2 + 4 * t) * W + 4 * j, b + 4 + 4 * t, 4);
      } else if (packed_scales) {
        std::memcpy(r + 2 * W + 2 * j, b + 2, 2);  // scales_h
        std::memcpy(r + 4 * W + 4 * j, b + 4, 4);  // scales_l
      } else {
        for (int64_t i = 0; i < SUPER / group; ++i) r[(2 + i) * W + j] = b[2 + i];
      }
    }
  }
  return {records, dmin};
}

// The superblock form's checks (panels: the codes'); returns its groups
inline int64_t check_records(const at::Tensor& scales, const at::Tensor& offsets, int64_t bits, int64_t group,
                             int64_t k_dim, int64_t panels) {
  const bool mins = offsets.numel() > 0;
  const bool fits = mins ? group == 32 && bits != 6 && bits != TABLE
                          : (group == 16 || group == 32) && (bits == 8 || bits == 6 || (bits == TABLE && group == 32));
  TORCH_CHECK(k_dim % SUPER == 0 && fits, "superblock scales take K a multiple of 256: with mins, groups of 32 and 4-, "
              "5- or 8-bit codes; without, groups of 16 or 32 and 6- or 8-bit codes, or table codes in groups of 32");
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({panels, k_dim / SUPER, record_bytes(mins, group)}) &&
                  (!mins || (offsets.scalar_type() == at::kHalf && offsets.is_contiguous() &&
                             offsets.sizes() == at::IntArrayRef({panels, k_dim / SUPER, W}))),
              "superblock scales must be packed by this library (panels of ", W, " features)");
  return k_dim / group;
}

// The packed tensors' checks for a matrix of `k_dim` inputs and `out_features` outputs; returns its groups.
// `superblocks`: whether the caller's kernel takes the superblock form.
inline int64_t check_panels(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                            int64_t group, int64_t k_dim, int64_t out_features, bool superblocks = false) {
  TORCH_CHECK(bits == 4 || bits == 8 || (superblocks && own_width(int(bits))), "bits must be 4 or 8",
              superblocks ? " (or 5, 6, or TABLE)" : "");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(0) % QUAD == 0,
              "codes must be packed by this library");
  TORCH_CHECK(codes.size(1) == k_dim * W * code_width(int(bits)) / 8, "the weights do not take ", k_dim,
              " input features");
  TORCH_CHECK(out_features > codes.size(0) * W - QUAD * W && out_features <= codes.size(0) * W,
              "out_features does not match the panels");
  if (form_of(scales) == Form::SUPER) {
    TORCH_CHECK(superblocks, "this kernel does not take superblock scales");
    return check_records(scales, offsets, bits, group, k_dim, codes.size(0));
  }
  const bool half = scales.scalar_type() == at::kHalf, has_offsets = offsets.numel() > 0;
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == W && scales.is_contiguous() &&
                  (half || scales.scalar_type() == at::kFloat) &&
                  (!has_offsets || (offsets.sizes() == scales.sizes() && offsets.is_contiguous() &&
                                    offsets.scalar_type() == scales.scalar_type())),
              "scales and offsets must be packed by this library (panels of ", W, " features)");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups * group == k_dim && scales.size(0) == codes.size(0), "the weights do not take ", k_dim,
              " input features");
  return groups;
}

// The packed tensors' checks against x; returns (M rows, groups).
inline std::pair<int64_t, int64_t> check_packed(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                                const at::Tensor& offsets, int64_t bits, int64_t group,
                                                int64_t out_features, bool superblocks = false) {
  const int64_t k_dim = x.size(-1);
  const int64_t groups = check_panels(codes, scales, offsets, bits, group, k_dim, out_features, superblocks);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  return {x.numel() / std::max<int64_t>(k_dim, 1), groups};
}

// Rows `ids` of a packed (N, K) matrix as fp32 (T, K): each code times its scale, then plus its offset
// (models/quant_formats.py dequantize_codes, op for op), for an embedding that reads a tied LM head's panels
// (models/quant_linear.py QuantEmbedding); the op `quant_rows` / `q8_rows` of the file whose layout it reads.
template <CodePlace PLACE, int64_t LANE_BYTES, CodePlace HIGH = nullptr>
at::Tensor unpack_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                       const at::Tensor& ids, int64_t bits, int64_t group, int64_t k_dim, int64_t n) {
  const int64_t groups = check_panels(codes, scales, offsets, bits, group, k_dim, n, true);
  const bool has_offsets = offsets.numel() > 0;
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids must be int64");
  const at::Tensor idx = ids.contiguous().view(-1);
  const int64_t t = idx.numel(), panel_bytes = codes.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "id ", ip[r], " out of range for ", n, " rows");
  at::Tensor out = at::empty({t, k_dim}, codes.options().dtype(at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const GroupScales gs{scales.data_ptr(), has_offsets ? offsets.data_ptr() : nullptr, groups, group, form_of(scales)};
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t p = ip[r] / W, j = ip[r] % W;
      const uint8_t* panel = cp + panel_offset(p, panel_bytes, LANE_BYTES);
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = gs.lane(p, g, j, false), offset = has_offsets ? gs.lane(p, g, j, true) : 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const auto [byte, shift] = PLACE(bits, j, k);
          int code = bits == 8 ? int(int8_t(panel[byte])) : (panel[byte] >> shift) & 15;
          if constexpr (HIGH != nullptr) {
            if (planes(int(bits))) {
              const auto [high_byte, high_shift] = HIGH(bits, j, k);
              code |= ((panel[high_byte] >> high_shift) & ((1 << (bits - 4)) - 1)) << 4;
              code -= code_bias(int(bits));
            }
            if (bits == TABLE) code = TABLE_VALUES[code];
          }
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
