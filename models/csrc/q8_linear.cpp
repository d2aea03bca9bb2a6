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
//   4-bit codes (KS = 8): lane j, byte t = code(j, k + t) | code(j, k + 4 + t) << 4; 5- and 6-bit codes, and
//   table codes (IQ4's indices), as 4-bit ones (code_planes.h).
// The x side of a step is 4 bytes broadcast to every lane. vpmaddubsw multiplies unsigned by signed
// bytes: 4-bit codes are unsigned; signed 8-bit codes go in as |w| against x with w's sign.
//
// AMX (the amx build): a call's whole tiles of 16 rows take the tiles (from 16 rows on for 8-bit codes, 32
// for 4-bit ones), the rest the vector tiles. Per block, a tile of x (16 rows x the block's bytes) times a
// panel's codes (tdpbssd for signed 8-bit codes, whose panel steps are already the tiles' 4-byte rows;
// tdpbsud for 4- to 6-bit codes, unpacked once per call and panel; tdpbssd for table codes' values, so unpacked)
// into an int32 tile: the same exact integer sums, then the same fp32 steps per block as the vector tiles, so a
// row's bits do not depend on which path took it.
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <vector>

#include "q8_amx.h"

namespace {

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
  if (bits == TABLE) {  // IQ4_XS (records without mins, or their expansion) and IQ4_NL (fp16)
    if (form == Form::SUPER) return make(Fmt<TABLE, true, false, true>{});
    return form == Form::F16 ? make(Fmt<TABLE, true, false>{}) : make(Fmt<TABLE, false, false>{});
  }
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
  TORCH_CHECK(bits != TABLE || (group % 32 == 0 && !offset.has_value()), "table codes: groups of 32, no offsets");
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
  TORCH_CHECK(bits != TABLE || offsets.numel() == 0, "table codes: no offsets (IQ4_NL, IQ4_XS)");
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
