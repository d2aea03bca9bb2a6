// LoRA deltas grouped by adapter (models/lora.py `LoraStep.apply`; SGMV/BGMV on GPUs, here on CPU).
//
// The base linear has run for every row; this adds, for each segment g of `rows` (the rows of one
// adapter slot s) and each piece p of the fused output with rank r_p > 0,
//   y[row, cols_p] += (x[row] . a[s, pR : pR + r_p]^T) . bt[s, :r_p, cols_p]
// where bt holds scale * lora_B^T. Per task (a segment's TASK_ROWS rows), both in fp32:
//   shrink: h[i, pR + j] = x[rows[i]] . a[s, pR + j], a tile of rows x A-rows sharing each load;
//   expand: per column tile of a piece, rows share each load of bt, and each row's tile of y is read,
//           added to and rounded to y's dtype once.
// A segment of MM_ROWS rows or more (a prefill chunk) takes at::mm (oneDNN / MKL) on its gathered rows
// instead. Measured on two threads (Zen 4) over the default model's 120 linears, rank 16, bf16: the
// tiles take 8.5 ms at 31 rows and ~0.27 ms more per row; at::mm costs ~17 ms of fixed overhead
// (gathers, conversions, oneDNN calls) and 28.7 ms at 128 rows, 47 ms at 256: the crossover is ~100.
// Rows outside `rows` are never read or written; a call with no rows returns at once.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int SHRINK_ROWS = 4;  // x rows per shrink tile
constexpr int SHRINK_COLS = 2;  // A rows per shrink tile: 8 accumulators, 2 + 1 loads per step
constexpr int EXPAND_VECS = 4;  // vectors of columns per expand tile: its accumulators stay in registers
constexpr int EXPAND_ROWS = W >= 16 ? 4 : 2;  // rows per expand tile: 16 accumulators (8 with AVX2's 16 registers)
constexpr int64_t TASK_ROWS = 4;  // a segment's rows per task: each task reads its slot's A and B^T once
constexpr int64_t GRAIN_FMAS = 1 << 15;  // multiply-adds per task below which a thread is not worth waking
constexpr int64_t MM_ROWS = 96;  // a segment's rows from which it takes at::mm (measured below)

inline float value(const float* p) { return *p; }
inline float value(const c10::BFloat16* p) { return float(*p); }
inline void put(float* p, float v) { *p = v; }
inline void put(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

inline float lanes_sum(vf v) {
  float s = 0.0f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

struct Piece {
  int64_t row0, col0, col1;  // its A rows start at row0 of a slot; its output columns are [col0, col1)
};

struct Segment {
  int64_t begin, end, slot;  // rows[begin:end] use slot `slot`
};

// h[r][c] = xs[r] . as[c] over n inputs, in fp32: nr <= SHRINK_ROWS rows, nc <= SHRINK_COLS A rows
template <typename TX, typename TW>
void dot_tile(const TX* const* xs, int nr, const TW* const* as, int nc, int64_t n, float* const* h) {
  vf acc[SHRINK_ROWS][SHRINK_COLS] = {};
  const int64_t nv = n / W * W;
  for (int64_t k = 0; k < nv; k += W) {
    vf av[SHRINK_COLS];
    for (int c = 0; c < nc; ++c) av[c] = load_vec(as[c] + k);
    for (int r = 0; r < nr; ++r) {
      const vf xv = load_vec(xs[r] + k);
      for (int c = 0; c < nc; ++c) acc[r][c] = fmadd(xv, av[c], acc[r][c]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < nc; ++c) {
      float s = lanes_sum(acc[r][c]);
      for (int64_t k = nv; k < n; ++k) s += value(xs[r] + k) * value(as[c] + k);
      h[r][c] = s;
    }
}

template <typename TX, typename TW>
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const std::vector<Piece>& pieces, const int64_t* ranks, const int64_t* rows,
              const std::vector<Segment>& segs) {
  const int64_t n = x.size(1), out = y.size(1), big_r = bt.size(1);
  const int64_t np = static_cast<int64_t>(pieces.size()), hw = np * big_r;
  const int64_t nrows = segs.back().end;
  const int64_t xs_stride = x.stride(0), ys_stride = y.stride(0);
  const int64_t a_slot = a.stride(0), bt_slot = bt.stride(0);
  const TX* xp = x.data_ptr<TX>();
  TX* yp = y.data_ptr<TX>();
  const TW* ap = a.data_ptr<TW>();
  const TW* btp = bt.data_ptr<TW>();
  auto rank_of = [&](const Segment& s, int64_t p) { return ranks[s.slot * np + p]; };

  // NOTE: one parallel region per call, of tasks (segment, TASK_ROWS rows) that shrink then expand their
  // own rows: no task reads what another writes, and a decode step's 120 calls pay one fork-join each
  // (two, shrink then expand, cost ~10% of a step in libgomp's barriers)
  struct Task {
    int64_t seg, row;
  };
  std::vector<Task> tasks;
  int64_t fmas = 0;
  for (int64_t g = 0; g < static_cast<int64_t>(segs.size()); ++g) {
    int64_t per_row = 0;
    for (int64_t p = 0; p < np; ++p) per_row += rank_of(segs[g], p) * (n + pieces[p].col1 - pieces[p].col0);
    if (per_row == 0) continue;
    for (int64_t i = segs[g].begin; i < segs[g].end; i += TASK_ROWS) tasks.push_back({g, i});
    fmas += (segs[g].end - segs[g].begin) * per_row;
  }
  if (tasks.empty()) return;
  std::vector<float> hbuf(nrows * hw);
  float* h = hbuf.data();
  constexpr int64_t TILE = EXPAND_VECS * W;
  const int64_t grain = std::max<int64_t>(1, GRAIN_FMAS * static_cast<int64_t>(tasks.size()) / std::max<int64_t>(fmas, 1));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Segment& s = segs[tasks[t].seg];
      const int64_t first = tasks[t].row, last = std::min(first + TASK_ROWS, s.end);
      for (int64_t p = 0; p < np; ++p) {
        const int64_t r = rank_of(s, p);
        if (r == 0) continue;
        const Piece& pc = pieces[p];
        // shrink: h[i, pR + j] = x[rows[i]] . a[s, pR + j], SHRINK_ROWS x SHRINK_COLS at a time
        const TW* a_rows = ap + s.slot * a_slot + pc.row0 * n;
        for (int64_t i = first; i < last; i += SHRINK_ROWS) {
          const int nr = static_cast<int>(std::min<int64_t>(SHRINK_ROWS, last - i));
          const TX* xs[SHRINK_ROWS];
          for (int k = 0; k < nr; ++k) xs[k] = xp + rows[i + k] * xs_stride;
          for (int64_t j = 0; j < r; j += SHRINK_COLS) {
            const int nc = static_cast<int>(std::min<int64_t>(SHRINK_COLS, r - j));
            const TW* as[SHRINK_COLS];
            for (int c = 0; c < nc; ++c) as[c] = a_rows + (j + c) * n;
            float* hs[SHRINK_ROWS];
            for (int k = 0; k < nr; ++k) hs[k] = h + (i + k) * hw + pc.row0 + j;
            dot_tile(xs, nr, as, nc, n, hs);
          }
        }
        // expand: per column tile, EXPAND_ROWS rows share each load of bt. NOTE: a row's sums keep their
        // order (j ascending) whatever the rows beside it
        const TW* b = btp + s.slot * bt_slot;  // (R, out)
        for (int64_t col0 = pc.col0; col0 < pc.col1; col0 += TILE) {
          const int64_t width = std::min(TILE, pc.col1 - col0), nv = width / W;
          for (int64_t i0 = first; i0 < last; i0 += EXPAND_ROWS) {
            const int nr = static_cast<int>(std::min<int64_t>(EXPAND_ROWS, last - i0));
            vf acc[EXPAND_ROWS][EXPAND_VECS] = {};
            for (int64_t j = 0; j < r; ++j) {
              const TW* bj = b + j * out + col0;
              vf bv[EXPAND_VECS];
              for (int64_t v = 0; v < nv; ++v) bv[v] = load_vec(bj + v * W);
              for (int k = 0; k < nr; ++k) {
                const vf hj = splat(h[(i0 + k) * hw + pc.row0 + j]);
                for (int64_t v = 0; v < nv; ++v) acc[k][v] = fmadd(hj, bv[v], acc[k][v]);
              }
            }
            for (int k = 0; k < nr; ++k) {
              const float* hi = h + (i0 + k) * hw + pc.row0;
              TX* yr = yp + rows[i0 + k] * ys_stride + col0;
              for (int64_t v = 0; v < nv; ++v) store_vec(yr + v * W, load_vec(yr + v * W) + acc[k][v]);
              for (int64_t c = nv * W; c < width; ++c) {
                float sum = 0.0f;
                for (int64_t j = 0; j < r; ++j) sum += hi[j] * value(b + j * out + col0 + c);
                put(yr + c, value(yr + c) + sum);
              }
            }
          }
        }
      }
    }
  });
}

// One long segment through at::mm: the delta of each targeted piece in fp32, added to y's rows with
// one rounding
template <typename TX>
void mm_segment(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                const std::vector<Piece>& pieces, const int64_t* ranks, const at::Tensor& rows, const Segment& s) {
  const int64_t np = static_cast<int64_t>(pieces.size()), n = s.end - s.begin;
  const at::Tensor idx = rows.slice(0, s.begin, s.end);
  // bf16 rows on bf16 slots multiply in bf16 (oneDNN's AVX512-BF16 / AMX GEMMs, 2.2x fp32's here at 256
  // rows), rounding x.A^T to bf16 as PEFT's bf16 lora_A does; anything else in fp32
  const at::ScalarType dt = x.scalar_type() == at::kBFloat16 && a.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor xs = x.index_select(0, idx).to(dt);  // (n, in)
  const int64_t* rp = idx.data_ptr<int64_t>();
  TX* yp = y.data_ptr<TX>();
  for (int64_t p = 0; p < np; ++p) {
    const int64_t r = ranks[s.slot * np + p];
    if (r == 0) continue;
    const Piece& pc = pieces[p];
    const at::Tensor h = at::mm(xs, a[s.slot].narrow(0, pc.row0, r).to(dt).t());  // (n, r)
    const at::Tensor d = at::mm(h, bt[s.slot].narrow(0, 0, r).narrow(1, pc.col0, pc.col1 - pc.col0).to(dt))
                             .to(at::kFloat);  // (n, width)
    const float* dp = d.data_ptr<float>();  // (n, width), contiguous
    const int64_t width = pc.col1 - pc.col0, nv = width / W * W;
    at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        TX* yr = yp + rp[i] * y.stride(0) + pc.col0;
        const float* di = dp + i * width;
        for (int64_t c = 0; c < nv; c += W) store_vec(yr + c, load_vec(yr + c) + load_f(di + c));
        for (int64_t c = nv; c < width; ++c) put(yr + c, value(yr + c) + di[c]);
      }
    });
  }
}

void lora_add_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& ranks, const at::Tensor& rows, const at::Tensor& seg_start,
               const at::Tensor& seg_slot, c10::IntArrayRef splits) {
  const int64_t nrows = rows.numel();
  if (nrows == 0) return;
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && a.device().is_cpu() && bt.device().is_cpu(),
              "lora_add_: CPU tensors");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "lora_add_: y (T, out), x (T, in)");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "lora_add_: y and x both fp32 or both bf16");
  TORCH_CHECK(a.scalar_type() == bt.scalar_type() && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_add_: a and bt both fp32 or both bf16");
  TORCH_CHECK(y.stride(1) == 1, "lora_add_: y's rows must be contiguous (it is written in place)");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.size(0) == bt.size(0), "lora_add_: a (S, P R, in), bt (S, R, out)");
  const int64_t np = static_cast<int64_t>(splits.size()), big_r = bt.size(1), num_slots = a.size(0);
  int64_t width = 0;
  for (int64_t s : splits) width += s;
  TORCH_CHECK(width == y.size(1) && bt.size(2) == width && a.size(1) == np * big_r && a.size(2) == x.size(1),
              "lora_add_: shapes of y, x, a, bt and splits disagree");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.dim() == 2 && ranks.size(0) == num_slots && ranks.size(1) == np,
              "lora_add_: ranks (S, P) int64");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seg_start.scalar_type() == at::kLong && seg_slot.scalar_type() == at::kLong,
              "lora_add_: rows, seg_start and seg_slot int64");
  TORCH_CHECK(seg_start.numel() == seg_slot.numel() + 1, "lora_add_: seg_start has one more entry than seg_slot");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor ac = a.contiguous(), btc = bt.contiguous(), rk = ranks.contiguous(), rw = rows.contiguous();
  const at::Tensor ss = seg_start.contiguous(), sl = seg_slot.contiguous();
  const int64_t* rkp = rk.data_ptr<int64_t>();
  const int64_t* rwp = rw.data_ptr<int64_t>();
  const int64_t* ssp = ss.data_ptr<int64_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_slots * np; ++i)
    TORCH_CHECK(rkp[i] >= 0 && rkp[i] <= big_r, "lora_add_: a rank outside 0..", big_r);
  // NOTE: every row at most once: tasks own their rows' columns, so a repeated row would race
  std::vector<char> seen(y.size(0), 0);
  for (int64_t i = 0; i < nrows; ++i) {
    TORCH_CHECK(rwp[i] >= 0 && rwp[i] < y.size(0) && !seen[rwp[i]], "lora_add_: rows must be distinct rows of y");
    seen[rwp[i]] = 1;
  }
  TORCH_CHECK(ssp[0] == 0 && ssp[seg_slot.numel()] == nrows, "lora_add_: segments must cover rows");
  std::vector<Segment> segs, long_segs;
  for (int64_t g = 0; g < seg_slot.numel(); ++g) {
    TORCH_CHECK(ssp[g] <= ssp[g + 1] && slp[g] >= 0 && slp[g] < num_slots, "lora_add_: bad segment ", g);
    if (ssp[g] < ssp[g + 1]) (ssp[g + 1] - ssp[g] >= MM_ROWS ? long_segs : segs).push_back({ssp[g], ssp[g + 1], slp[g]});
  }
  std::vector<Piece> pieces;
  int64_t col = 0;
  for (int64_t p = 0; p < np; ++p) {
    pieces.push_back({p * big_r, col, col + splits[p]});
    col += splits[p];
  }
  const bool x32 = y.scalar_type() == at::kFloat, w32 = a.scalar_type() == at::kFloat;
  for (const Segment& s : long_segs) {
    if (x32) mm_segment<float>(y, xc, ac, btc, pieces, rkp, rw, s);
    else mm_segment<c10::BFloat16>(y, xc, ac, btc, pieces, rkp, rw, s);
  }
  if (segs.empty()) return;
  if (x32 && w32) lora_add<float, float>(y, xc, ac, btc, pieces, rkp, rwp, segs);
  else if (x32) lora_add<float, c10::BFloat16>(y, xc, ac, btc, pieces, rkp, rwp, segs);
  else if (w32) lora_add<c10::BFloat16, float>(y, xc, ac, btc, pieces, rkp, rwp, segs);
  else lora_add<c10::BFloat16, c10::BFloat16>(y, xc, ac, btc, pieces, rkp, rwp, segs);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) { m.impl("lora_add_", &lora_add_); }
