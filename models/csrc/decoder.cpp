// Every decoder layer of a Llama-family model in one call (server/engine/native_decoder.py): RMSNorm,
// RoPE, SwiGLU and the residual adds run here, between calls to the same packed quantized-linear
// and paged-attention kernels the Python model calls (through the dispatcher, from C++).
//
// Why: a batch-1 decode step of the default model is ~270 small operations. Through torch.compile's
// Python wrapper each one costs microseconds of Python, guards and dispatch: perf on the engine
// (AVX2, 2 threads) put ~40% of the main thread there, while the second thread sat idle.
//
// LoRA (models/lora.py): after each of a layer's four linears, the rows of a step that have an adapter
// get its delta from the same op the Python model calls, attnserve::lora_add_ (models/csrc/lora.cpp).
//
// Rounding follows the Python model's ops (models/layers.py, models/rope.py) op by op, so a bf16
// model rounds where eager bf16 rounds: normalised in fp32 then cast, scaled in the model's dtype;
// RoPE's two products and their sum each rounded; SiLU rounded before the product with `up`.
#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t ELEMENTS_PER_TASK = 1 << 15;  // rows of elementwise work below this run on one thread

struct Part {
  at::Tensor codes, scales, offsets;
  std::optional<at::Tensor> bias;
  int64_t bits, group_size, out_features;
  bool int8_activations;  // packed for models/csrc/q8_linear.cpp, else quant_linear.cpp
};

// A linear's output features in parts, side by side: one, or a fused matrix of mixed GGUF types whose parts each
// keep their own form (models/quant_linear.py QuantLinear.parts)
struct Linear {
  std::vector<Part> parts;

  int64_t out_features() const {
    int64_t n = 0;
    for (const Part& p : parts) n += p.out_features;
    return n;
  }
};

struct Layer {
  at::Tensor attn_norm, mlp_norm;  // (C,) in the model's dtype
  Linear qkv, o, gate_up, down;
};

// One (layer, module)'s LoRA slots (models/lora.py LoraSlots), held by reference: installing an adapter
// writes into them between steps
struct LoraModule {
  at::Tensor a, bt, ranks;  // (S, P R, in), (S, R, out), (S, P) int64
  std::vector<int64_t> splits;  // the output width of each of the P pieces
};

// One step's rows that have an adapter, grouped by slot (models/lora.py LoraMetadata)
struct LoraRows {
  const at::Tensor &rows, &seg_start, &seg_slot;
};

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, int64_t, int64_t, c10::SymInt);
using Int8LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, int64_t, int64_t, c10::SymInt,
                                const std::optional<at::Tensor>&);

template <typename Fn>
c10::TypedOperatorHandle<Fn> linear_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// `prompt_rows`: (T,) bool, the rows that are prompt tokens (q8_linear takes them on bf16 tiles where it has them)
at::Tensor part_linear(const at::Tensor& x, const Part& w, const std::optional<at::Tensor>& prompt_rows) {
  // NOTE: each looked up on its first use, when the library of those linears has been loaded
  if (w.int8_activations) {
    static const auto int8 = linear_op<Int8LinearFn>("attnserve::q8_linear");
    return int8.call(x, w.codes, w.scales, w.offsets, w.bias, w.bits, w.group_size, c10::SymInt(w.out_features),
                     prompt_rows);
  }
  static const auto exact = linear_op<LinearFn>("attnserve::quant_linear");
  return exact.call(x, w.codes, w.scales, w.offsets, w.bias, w.bits, w.group_size, c10::SymInt(w.out_features));
}

at::Tensor quant_linear(const at::Tensor& x, const Linear& w, const std::optional<at::Tensor>& prompt_rows) {
  if (w.parts.size() == 1) return part_linear(x, w.parts[0], prompt_rows);
  std::vector<at::Tensor> ys;
  for (const Part& p : w.parts) ys.push_back(part_linear(x, p, prompt_rows));
  return at::cat(ys, -1);
}

// y (T, out) += each adapter row's delta of x (T, in), in place
// NOTE: typed as lora.cpp's kernel is declared (y by value): the dispatcher checks the C++ signature
void lora_add(const at::Tensor& y, const at::Tensor& x, const LoraModule& m, const LoraRows& step) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("attnserve::lora_add_", "")
                             .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, c10::IntArrayRef)>();
  op.call(y, x, m.a, m.bt, m.ranks, step.rows, step.seg_start, step.seg_slot, m.splits);
}

// A tensor-parallel rank's partial sums, summed over its group through shared memory (models/shm_comm.py)
at::Tensor all_reduce(const at::Tensor& x, int64_t handle) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnserve::shm_all_reduce", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(x, handle);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t max_query_len,
                           int64_t max_seq_len, double scale, double k_scale, double v_scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnserve::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymInt,
                            c10::SymInt, double, double, double, int64_t, double, const std::optional<at::Tensor>&)>();
  // NOTE: window 0, softcap 0, no sinks: the native decoder only runs models without variants
  return op.call(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                 c10::SymInt(max_query_len), c10::SymInt(max_seq_len), scale, k_scale, v_scale, 0, 0.0, std::nullopt);
}

// A value rounded to the model's dtype and back (identity in fp32; round to nearest even in bf16).
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename F>
void for_rows(int64_t rows, int64_t row_elements, const F& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, ELEMENTS_PER_TASK / std::max<int64_t>(1, row_elements)), fn);
}

// y = w * rms_norm(x): normalised in fp32, cast to T, then scaled in T (models/layers.py RMSNorm).
// NOTE: the squares are summed in double, as ATen's rms_norm sums them: summed in fp32, one bf16
// rounding in a thousand differed from eager's, and over 30 layers only 18% of the default
// model's final hidden values stayed equal (an 8-bit KV cache then changed its answers)
template <typename T>
void rms_norm(const T* x, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  for_rows(rows, dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      double sum = 0.0;
      for (int64_t i = 0; i < dim; ++i) sum += double(static_cast<float>(xr[i]) * static_cast<float>(xr[i]));
      const float inv = float(1.0 / std::sqrt(sum / double(dim) + double(eps)));
      for (int64_t i = 0; i < dim; ++i)
        y[r * dim + i] = static_cast<T>(static_cast<float>(w[i]) * rounded<T>(static_cast<float>(xr[i]) * inv));
    }
  });
}

// x += d, rounded to T (the residual stream)
template <typename T>
void add_into(T* x, const T* d, int64_t n) {
  for_rows(n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) x[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(d[i]));
  });
}

// out[t, h] = x * cos + swap_halves(x) * signed_sin for the first `heads` heads of each row of qkv
// (models/rope.py: the tables are (T, D) in T, sin's first half negated)
template <typename T>
void rope(const T* qkv, int64_t qkv_stride, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
          int64_t dim) {
  const int64_t half = dim / 2;
  for_rows(rows, heads * dim, [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = qkv + t * qkv_stride + h * dim;
        T* o = out + (t * heads + h) * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const float swapped = static_cast<float>(x[i < half ? i + half : i - half]);
          o[i] = static_cast<T>(rounded<T>(static_cast<float>(x[i]) * static_cast<float>(c[i])) +
                                rounded<T>(swapped * static_cast<float>(s[i])));
        }
      }
    }
  });
}

// out = silu(gate) * up, gate and up the two halves of each row of gate_up
// A vector rounded to T and back (identity in fp32), as `rounded` rounds one value
template <typename T>
inline vf rounded_vec(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) c10::BFloat16 b[W];
    store_vec(b, v);
    return load_vec(b);
  }
}

// out = silu(gate) * up, silu rounded to T first (models/layers.py SwiGLU), W values at a time.
// NOTE: e^-g from simd.h's exp_vf, not libm's: the scalar loop was 9% of a 2,048-token prefill step
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t width) {
  for_rows(rows, width, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * width;
      const T* u = g + width;
      T* o = out + r * width;
      int64_t i = 0;
      for (; i + W <= width; i += W) {
        const vf gi = load_vec(g + i);
        store_vec(o + i, rounded_vec<T>(gi / (splat(1.f) + exp_vf(-gi))) * load_vec(u + i));
      }
      for (; i < width; ++i) {
        const float gi = static_cast<float>(g[i]);
        o[i] = static_cast<T>(rounded<T>(gi / (1.f + std::exp(-gi))) * static_cast<float>(u[i]));
      }
    }
  });
}

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps,
               at::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        intermediate_size_(intermediate_size), eps_(float(eps)), final_norm_(final_norm.contiguous()) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0,
                "head counts or head_dim out of range");
  }

  // linears: per part of qkv, o, gate_up and down in turn, (codes, scales, offsets, bias); an empty bias means none.
  // sizes: per linear its number of parts, then per part (bits, group_size, out_features, int8 activations 0/1).
  void add_layer(at::Tensor attn_norm, at::Tensor mlp_norm, std::vector<at::Tensor> linears,
                 std::vector<int64_t> sizes) {
    Linear w[4];
    size_t t = 0, s = 0;
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(s < sizes.size() && sizes[s] > 0, "each linear: its number of parts first");
      const int64_t parts = sizes[s++];
      TORCH_CHECK(t + 4 * parts <= linears.size() && s + 4 * parts <= sizes.size(), "4 tensors and 4 sizes a part");
      for (int64_t j = 0; j < parts; ++j, t += 4, s += 4) {
        const at::Tensor& bias = linears[t + 3];
        w[i].parts.push_back({linears[t], linears[t + 1], linears[t + 2],
                              bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt, sizes[s], sizes[s + 1],
                              sizes[s + 2], sizes[s + 3] != 0});
      }
    }
    TORCH_CHECK(t == linears.size() && s == sizes.size(), "4 linears: nothing after the last part");
    const int64_t q = num_heads_ * head_dim_, kv = num_kv_heads_ * head_dim_;
    TORCH_CHECK(w[0].out_features() == q + 2 * kv && w[2].out_features() == 2 * intermediate_size_ &&
                    w[1].out_features() == w[3].out_features() && w[1].out_features() == attn_norm.numel(),
                "linear shapes do not fit the stack");
    layers_.push_back({attn_norm.contiguous(), mlp_norm.contiguous(), w[0], w[1], w[2], w[3]});
  }

  // A tensor-parallel rank: o_proj's and down_proj's outputs are partial sums, all-reduced through the
  // shared-memory communicator `handle` (its library must be loaded) before each residual add.
  void set_all_reduce(int64_t handle) { all_reduce_ = handle; }

  // LoRA slots: per layer (after add_layer), 4 x (a, bt, ranks) for qkv, o, gate_up, down, each list in
  // that order. NOTE: held by reference; the lora_add_ op checks their shapes against each step's
  void set_lora(std::vector<at::Tensor> a, std::vector<at::Tensor> bt, std::vector<at::Tensor> ranks) {
    const size_t n = 4 * layers_.size();
    TORCH_CHECK(a.size() == n && bt.size() == n && ranks.size() == n, "4 LoRA modules per layer");
    TORCH_CHECK(all_reduce_ < 0, "LoRA with tensor parallelism is not supported");
    const int64_t q = num_heads_ * head_dim_, kv = num_kv_heads_ * head_dim_, c = final_norm_.numel();
    const std::vector<int64_t> splits[4] = {{q, kv, kv}, {c}, {intermediate_size_, intermediate_size_}, {c}};
    lora_.clear();
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(ranks[i].size(1) == int64_t(splits[i % 4].size()) && a[i].size(0) == bt[i].size(0),
                  "LoRA slots do not fit the stack");
      lora_.push_back({a[i], bt[i], ranks[i], splits[i % 4]});
    }
  }

  // x: (T, C) embedded tokens; cos, sin: (T, D) RoPE tables in x's dtype; the rest is one step's
  // paged-attention metadata and the pool (kvcache/paged_attention.py); prompt_rows: (T,) bool, the rows that
  // are prompt tokens, or none (every row int8 where the linears take 8-bit activations). Returns the final-normed (T, C).
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, at::Tensor slot_mapping, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, int64_t max_query_len, int64_t max_seq_len,
                     std::vector<double> k_scales, std::vector<double> v_scales,
                     std::optional<at::Tensor> lora_rows, std::optional<at::Tensor> lora_seg_start,
                     std::optional<at::Tensor> lora_seg_slot, std::optional<at::Tensor> prompt_rows) {
    const size_t n = layers_.size();
    TORCH_CHECK(k_caches.size() == n && v_caches.size() == n && k_scales.size() == n && v_scales.size() == n,
                "one cache and scale per layer");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == final_norm_.numel(), "x must be (T, hidden)");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                    cos.numel() == x.size(0) * head_dim_ && sin.numel() == cos.numel() && cos.is_contiguous() &&
                    sin.is_contiguous(),
                "cos and sin must be (T, head_dim) in x's dtype");
    TORCH_CHECK(final_norm_.scalar_type() == x.scalar_type(), "the weights' dtype is x's");
    TORCH_CHECK(lora_rows.has_value() == lora_seg_start.has_value() && lora_rows.has_value() == lora_seg_slot.has_value(),
                "LoRA rows, segment starts and segment slots come together");
    TORCH_CHECK(!lora_rows || !lora_.empty(), "LoRA rows but no LoRA slots (set_lora)");
    std::optional<LoraRows> lora;
    if (lora_rows) lora.emplace(LoraRows{*lora_rows, *lora_seg_start, *lora_seg_slot});
    if (x.scalar_type() == at::kBFloat16) {
      return run<c10::BFloat16>(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, seq_lens,
                                query_start_loc, max_query_len, max_seq_len, k_scales, v_scales, lora, prompt_rows);
    }
    return run<float>(x, cos, sin, k_caches, v_caches, slot_mapping, block_tables, seq_lens, query_start_loc,
                      max_query_len, max_seq_len, k_scales, v_scales, lora, prompt_rows);
  }

 private:
  template <typename T>
  at::Tensor run(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                 std::vector<at::Tensor>& k_caches, std::vector<at::Tensor>& v_caches,
                 const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 const at::Tensor& query_start_loc, int64_t max_query_len, int64_t max_seq_len,
                 const std::vector<double>& k_scales, const std::vector<double>& v_scales,
                 const std::optional<LoraRows>& lora, const std::optional<at::Tensor>& prompt_rows) {
    const int64_t t = x_in.size(0), c = x_in.size(1), d = head_dim_;
    const int64_t h = num_heads_, hkv = num_kv_heads_, width = intermediate_size_;
    const double scale = 1.0 / std::sqrt(double(d));
    at::Tensor x = x_in.contiguous().clone();  // (T, C) the residual stream, updated in place
    at::Tensor normed = at::empty({t, c}, x.options());
    at::Tensor qk = at::empty({t, h + hkv, d}, x.options());  // (T, H + Hkv, D) rotated q and k
    at::Tensor act = at::empty({t, width}, x.options());  // (T, I)
    T* xp = x.data_ptr<T>();
    T* np = normed.data_ptr<T>();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      rms_norm<T>(xp, layer.attn_norm.data_ptr<T>(), np, t, c, eps_);
      at::Tensor qkv = quant_linear(normed, layer.qkv, prompt_rows).contiguous();  // (T, (H + 2 Hkv) D)
      if (lora) lora_add(qkv, normed, lora_[4 * l], *lora);  // NOTE: before RoPE, as PEFT adds it
      rope<T>(qkv.data_ptr<T>(), qkv.size(1), cos.data_ptr<T>(), sin.data_ptr<T>(), qk.data_ptr<T>(), t, h + hkv, d);
      at::Tensor q = qk.narrow(1, 0, h);  // (T, H, D)
      at::Tensor k = qk.narrow(1, h, hkv);  // (T, Hkv, D)
      at::Tensor v = qkv.view({t, h + 2 * hkv, d}).narrow(1, h + hkv, hkv);  // (T, Hkv, D)
      at::Tensor out = paged_attention(q, k, v, k_caches[l], v_caches[l], slot_mapping, block_tables, seq_lens,
                                       query_start_loc, max_query_len, max_seq_len, scale, k_scales[l], v_scales[l]);
      at::Tensor o = quant_linear(out.view({t, h * d}), layer.o, prompt_rows).contiguous();  // (T, C)
      if (lora) lora_add(o, out.view({t, h * d}), lora_[4 * l + 1], *lora);
      if (all_reduce_ >= 0) o = all_reduce(o, all_reduce_);
      add_into<T>(xp, o.data_ptr<T>(), t * c);
      rms_norm<T>(xp, layer.mlp_norm.data_ptr<T>(), np, t, c, eps_);
      at::Tensor gate_up = quant_linear(normed, layer.gate_up, prompt_rows).contiguous();  // (T, 2 I)
      if (lora) lora_add(gate_up, normed, lora_[4 * l + 2], *lora);
      silu_mul<T>(gate_up.data_ptr<T>(), act.data_ptr<T>(), t, width);
      at::Tensor down = quant_linear(act, layer.down, prompt_rows).contiguous();  // (T, C)
      if (lora) lora_add(down, act, lora_[4 * l + 3], *lora);
      if (all_reduce_ >= 0) down = all_reduce(down, all_reduce_);
      add_into<T>(xp, down.data_ptr<T>(), t * c);
    }
    rms_norm<T>(xp, final_norm_.data_ptr<T>(), np, t, c, eps_);
    return normed;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_size_;
  float eps_;
  int64_t all_reduce_ = -1;  // a shared-memory communicator's handle; -1: not tensor parallel
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  std::vector<LoraModule> lora_;  // 4 per layer once set_lora is called; empty: no LoRA
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnserve, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, at::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_all_reduce", &DecoderStack::set_all_reduce)
      .def("set_lora", &DecoderStack::set_lora)
      .def("forward", &DecoderStack::forward);
}
