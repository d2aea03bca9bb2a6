// Prompt logprobs in one read of the logits (server/engine/sampler.py `prompt_logprobs`), and greedy tokens
// (`greedy`).
//
// Per row of raw logits (the LM head's output, in the model's dtype): the log-softmax value of one
// target token, its rank (the tokens at least as likely, itself included, as vLLM counts) and the k
// best tokens with their log-softmax values. torch needs an fp32 copy of the rows, a log_softmax,
// a comparison and a topk: four passes over rows of 10^4..10^5 words, each written out. Here a row
// is read twice while it sits in L2 (its maximum, then exp-sum, count and top-k together) and
// nothing of its size is written.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#include "simd.h"

namespace {

constexpr int64_t MAX_K = 64;  // top-k kept per row; the API allows 20
constexpr int NACC = 4;        // exp-sum accumulators per row: independent adds
constexpr int FLUSH = 16;      // NACC-vector steps between emptying them into a double

inline float value(const float* p) { return *p; }
inline float value(const c10::BFloat16* p) { return float(*p); }

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// The k best of a row so far, best first; ties keep the lower id (it came first)
struct Best {
  int64_t k = 0, size = 0;
  float vals[MAX_K];
  int64_t ids[MAX_K];
  bool open() const { return size < k; }  // NOTE: every value is offered until k are held (-inf ones too)
  float threshold() const { return k == 0 ? std::numeric_limits<float>::infinity() : vals[k - 1]; }
  void offer(float v, int64_t id) {
    if (k == 0 || (size == k && !(v > vals[k - 1]))) return;
    int64_t i = size < k ? size++ : k - 1;
    while (i > 0 && v > vals[i - 1]) {
      vals[i] = vals[i - 1];
      ids[i] = ids[i - 1];
      --i;
    }
    vals[i] = v;
    ids[i] = id;
  }
};

struct RowScore {
  float logsumexp;
  int64_t rank;
};

template <typename T>
RowScore score_row(const T* x, int64_t n, int64_t target, Best& best) {
  const int64_t nv = n / W * W;
  // NOTE: a NaN row gives NaN, as log_softmax would; max treats it as smaller than all, so check
  vf m = splat(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < nv; j += W) m = vmax(m, load_vec(x + j));
  float mx = hmax(m);
  for (int64_t j = nv; j < n; ++j) mx = std::max(mx, value(x + j));
  const float mine = value(x + target);
  const vf vmx = splat(mx), vmine = splat(mine);
  vf sums[NACC] = {};
  vi counts = {};
  double sum = 0.0;
  // NOTE: the fp32 partial sums are emptied into `sum` every FLUSH steps: fp32 sums of thousands of
  // terms each drift by 1e-5 (AVX2's 8 lanes over a 49,152-word row), a double's do not
  auto flush = [&]() {
    for (int a = 0; a < NACC; ++a) {
      for (int l = 0; l < W; ++l) sum += sums[a][l];
      sums[a] = vf{};
    }
  };
  auto step = [&](int64_t j, vf& acc) {
    const vf v = load_vec(x + j);
    acc += exp_vf(v - vmx);
    counts -= (v >= vmine);  // a true lane is -1
    bool any = best.open();
    if (!any) {
      const vi above = v > splat(best.threshold());
      for (int l = 0; l < W; ++l) any |= above[l] != 0;
    }
    if (any)
      for (int l = 0; l < W; ++l) best.offer(v[l], j + l);
  };
  int64_t j = 0;
  for (int64_t flushed = 0; j + NACC * W <= nv; j += NACC * W) {
    for (int a = 0; a < NACC; ++a) step(j + a * W, sums[a]);
    if (++flushed % FLUSH == 0) flush();
  }
  for (; j < nv; j += W) step(j, sums[0]);
  flush();
  float tail_sum = 0.0f;
  int64_t tail_count = 0;
  for (int64_t j = nv; j < n; ++j) {
    const float v = value(x + j);
    tail_sum += std::exp(v - mx);
    tail_count += v >= mine;
    best.offer(v, j);
  }
  sum += tail_sum;
  const int64_t count = tail_count + hsum(counts);
  if (std::isnan(mine) || std::isnan(mx)) return {std::numeric_limits<float>::quiet_NaN(), count};
  return {mx + float(std::log(sum)), count};
}

template <typename T>
void score_rows(const T* logits, int64_t rows, int64_t n, const int64_t* targets, int64_t k, float* logprob,
                int64_t* rank, float* top_vals, int64_t* top_ids) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      Best best;
      best.k = k;
      const T* x = logits + r * n;
      const RowScore s = score_row(x, n, targets[r], best);
      logprob[r] = value(x + targets[r]) - s.logsumexp;
      rank[r] = s.rank;
      for (int64_t i = 0; i < k; ++i) {
        top_vals[r * k + i] = best.vals[i] - s.logsumexp;
        top_ids[r * k + i] = best.ids[i];
      }
    }
  });
}

// What both ops take: raw logits (rows, vocab) on the CPU, fp32 or bf16
inline void check_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu(), "logits: (rows, vocab) on the CPU");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, "logits: fp32 or bf16");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logit_scores(const at::Tensor& logits,
                                                                        const at::Tensor& targets, int64_t k) {
  check_logits(logits);
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "targets: one int64 per row");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(k >= 0 && k <= MAX_K && k <= n, "k: 0 .. ", MAX_K);
  const at::Tensor x = logits.contiguous(), t = targets.contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(tp[r] >= 0 && tp[r] < n, "target out of the vocabulary");
  at::Tensor logprob = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rank = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor top_vals = at::empty({rows, k}, x.options().dtype(at::kFloat));
  at::Tensor top_ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat)
    score_rows(x.data_ptr<float>(), rows, n, tp, k, logprob.data_ptr<float>(), rank.data_ptr<int64_t>(),
               top_vals.data_ptr<float>(), top_ids.data_ptr<int64_t>());
  else
    score_rows(x.data_ptr<c10::BFloat16>(), rows, n, tp, k, logprob.data_ptr<float>(), rank.data_ptr<int64_t>(),
               top_vals.data_ptr<float>(), top_ids.data_ptr<int64_t>());
  return {logprob, rank, top_vals, top_ids};
}

template <typename T>
int64_t nan_index(const T* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (value(x + j) != value(x + j)) return j;
  return 0;
}

// The first maximum of a row, as torch's max(dim).indices takes it: a NaN counts as above everything (the first
// NaN wins). One read of the row: per lane its largest value and where that first came, then the lanes compared.
template <typename T>
int64_t first_max(const T* x, int64_t n) {
  const int64_t nv = n / W * W;
  vf m = splat(-std::numeric_limits<float>::infinity());
  vi at = {}, nan = {}, lanes;
  for (int l = 0; l < W; ++l) lanes[l] = l;
  for (int64_t j = 0; j < nv; j += W) {
    const vf v = load_vec(x + j);
    const vi above = v > m;  // NOTE: strictly: a lane keeps its first maximum
    m = above ? v : m;
    at = above ? lanes + int32_t(j) : at;
    nan |= v != v;
  }
  float mx = -std::numeric_limits<float>::infinity();
  int64_t best = 0;
  for (int l = 0; l < W; ++l) {
    if (nan[l]) return nan_index(x, n);
    if (m[l] > mx || (m[l] == mx && at[l] < best)) mx = m[l], best = at[l];
  }
  for (int64_t j = nv; j < n; ++j) {
    const float v = value(x + j);
    if (v != v) return nan_index(x, n);
    if (v > mx) mx = v, best = j;
  }
  return best;
}

template <typename T>
void first_maxima(const T* logits, int64_t rows, int64_t n, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = first_max(logits + r * n, n);
  });
}

// Greedy tokens: per row of raw logits (rows, vocab), fp32 or bf16, its first maximum. torch's max(dim) reads a bf16
// row at ~1.5 ns a word here (674 us for 32 rows of 49,152); this reads each row once.
at::Tensor greedy_tokens(const at::Tensor& logits) {
  check_logits(logits);
  TORCH_CHECK(logits.size(1) > 0, "logits: (rows, vocab) on the CPU");
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat)
    first_maxima(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  else
    first_maxima(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnserve, m) {
  m.def("logit_scores(Tensor logits, Tensor targets, int k) -> (Tensor, Tensor, Tensor, Tensor)", &logit_scores);
  m.def("greedy_tokens(Tensor logits) -> Tensor", &greedy_tokens);
}
