// Paged attention for CPU: reads K/V blocks where they lie in the pool, no gather, no padding.
//
// One call per layer covers a whole step: every sequence with its own number of new (query)
// tokens and its own context. Work items are (sequence, KV head, query tile); the query heads
// of a GQA group share each K/V read, and the softmax is online (flash style), so the only
// per-item state is the tile's accumulators. Math is fp32 whatever the storage dtype, but for one
// rounding: a bf16 model's softmax weights are rounded to bf16 for P.V in the avx512_bf16 build on AMD (PV_PAIRS).
//
// The cache may hold 8-bit floats (e4m3 or e5m2) with one power-of-two scale per layer for K and
// one for V: K's scale folds into the query scale, V's into the output, so the loops only widen.
//
// Per-layer variants (models/attention.py AttentionVariant): a sliding window starts each key loop
// at the window's first key, so a windowed layer reads (and pays for) `window` keys, never the
// stale blocks before them; a logit soft-cap squashes each score before the mask; learned sinks
// start each row's online softmax at the sink's logit with no value (its mass is dropped). The
// plain case pays for none of them: each is a branch hoisted out of the per-key math.
//
// Batch invariance: a query row's output is the same, bit for bit, whichever path computes it (a
// decode, a row of a speculative verification, a prefill tile) and whatever rows share its call, so
// neither batching, speculation, chunking nor a prefix-cache hit changes a greedy token. Both paths
// take the same steps per row: q.k summed over head_dim in order (in the amx build, on the tiles, 32
// dims a step, both paths alike: qk_scores); the online softmax per chunk of
// KEY_CHUNK keys at multiples of KEY_CHUNK (masked keys add exact zeros); each chunk's sum folded in
// the same tree; the values accumulated key by key (in the avx512_bf16 build, pair by pair: PV_PAIRS). The
// library is built with -ffp-contract=off, so only the multiply-adds spelled out (fmadd) are fused, in both
// paths alike.
//
// Vectors are GCC vector extensions of W floats, one register of the ISA the library is built
// for: 16 with AVX-512, 8 with AVX2, 4 for the portable build (SSE2 or NEON). Each ISA gets its
// own library (models/native/toolchain.py), chosen from the CPU's features at run time.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "simd.h"

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int MAX_TILE_ROWS = 32;  // query rows (tokens x group heads) per work item
constexpr int HEAD_DIM_STEP = 16;  // head_dim is padded up to a multiple of this (zero lanes)
constexpr int MAX_HEAD_DIM_STEPS = 16;  // head_dim up to 256
// The padded head_dims (in HEAD_DIM_STEPs) with code of their own: 16, 32, 64, 80, 96, 128, 256, the
// ones models use. Any other pads up to the next of them (zero lanes, as head_dim 8 or 24 always
// did). Each costs ~4 s of compile per library, on every machine's first start and in CI: all 16
// took 74 s.
using HeadDimSteps = std::integer_sequence<int, 1, 2, 4, 5, 6, 8, MAX_HEAD_DIM_STEPS>;
constexpr int PREFETCH_KEYS = 16;  // how far ahead (in keys) K/V rows are prefetched
// keys per online-softmax step, in every path (a multiple of W): the per-row step (max, exp, the
// accumulators' rescale) is paid once per 16 keys, not once per vector of scores
constexpr int KEY_CHUNK = 16;
constexpr int DECODE_CHUNKS = 4;  // chunks whose scores a decode takes at once
alignas(64) constexpr float ZERO_ROW[HEAD_DIM_STEP * MAX_HEAD_DIM_STEPS] = {};  // a masked key's K row


inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// x[0..W) as a W x W matrix, transposed in place (x[j][i] = x[i][j] before): one step per bit of
// the index, each swapping the off-diagonal blocks of that size. W log2(W) two-source shuffles.
template <int H, int... I>
inline void transpose_step(vf* x, std::integer_sequence<int, I...>) {
  constexpr vi lo = {((I & H) ? W + I - H : I)...};
  constexpr vi hi = {((I & H) ? W + I : I + H)...};
  for (int i = 0; i < W; ++i) {
    if (i & H) continue;
    const vf a = x[i], b = x[i + H];
    x[i] = __builtin_shuffle(a, b, lo);
    x[i + H] = __builtin_shuffle(a, b, hi);
  }
}

template <int H = 1>
inline void transpose(vf* x) {
  transpose_step<H>(x, std::make_integer_sequence<int, W>{});
  if constexpr (2 * H < W) transpose<2 * H>(x);
}

template <int... I>
constexpr vi iota(std::integer_sequence<int, I...>) {
  return vi{I...};
}
constexpr vi LANES = iota(std::make_integer_sequence<int, W>{});

// Butterfly over lanes: every lane ends up holding op over all lanes.
template <int S, int... I>
inline vf swap_lanes(vf x, std::integer_sequence<int, I...>) {
  constexpr vi m = {(I ^ S)...};
  return __builtin_shuffle(x, m);
}

template <int S>
inline vf swapped(vf x) { return swap_lanes<S>(x, std::make_integer_sequence<int, W>{}); }

template <int S = W / 2>
inline float hsum(vf v) {
  if constexpr (S == 0) {
    return v[0];
  } else {
    return hsum<S / 2>(v + swapped<S>(v));
  }
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

template <int S = W / 2>
inline float hmax(vf v) {
  if constexpr (S == 0) {
    return v[0];
  } else {
    return hmax<S / 2>(vmax(v, swapped<S>(v)));
  }
}

// tanh to ~3 ulp: a rational approximation (Eigen's), clamped where tanh rounds to +-1 in fp32.
inline vf tanh_v(vf x) {
  constexpr float clamp = 7.90531110763549805f;
  x = x < -clamp ? splat(-clamp) : x;
  x = x > clamp ? splat(clamp) : x;
  const vf x2 = x * x;
  vf p = splat(-2.76076847742355e-16f);
  p = fmadd(p, x2, splat(2.00018790482477e-13f));
  p = fmadd(p, x2, splat(-8.60467152213735e-11f));
  p = fmadd(p, x2, splat(5.12229709037114e-08f));
  p = fmadd(p, x2, splat(1.48572235717979e-05f));
  p = fmadd(p, x2, splat(6.37261928875436e-04f));
  p = fmadd(p, x2, splat(4.89352455891786e-03f));
  vf d = splat(1.19825839466702e-06f);
  d = fmadd(d, x2, splat(1.18534705686654e-04f));
  d = fmadd(d, x2, splat(2.26843463243900e-03f));
  d = fmadd(d, x2, splat(4.89352518554385e-03f));
  return p * x / d;
}

// exp for x <= 0 (softmax arguments), ~1 ulp: 2^n * p(r) with |r| <= ln2 / 2.
inline vf exp_neg(vf x) {
  x = vmax(x, splat(-87.0f));
  const vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);  // nearest, for x <= 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = fmadd(nf, splat(2.12194440e-4f), fmadd(nf, splat(-0.693359375f), x));
  vf p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(p * r, r, r) + 1.0f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T>
constexpr bool is_fp8() {
  return std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;
}

template <typename T>
struct Fp8 {  // e4m3 (bias 7, 3 mantissa bits, largest 448) or e5m2 (bias 15, 2 bits, 57344)
  static constexpr bool e4m3 = std::is_same_v<T, c10::Float8_e4m3fn>;
  static constexpr uint32_t mant = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  static constexpr float max = e4m3 ? 448.f : 57344.f;
  static constexpr float tiny = e4m3 ? 0x1p-6f : 0x1p-14f;  // the smallest normal
};

// NOTE: a pool never holds an 8-bit subnormal: writes flush |x| < the smallest normal to +0
// (kvcache.quant.quantize does the same), so widening is a shift and a rebias of the exponent.

// W floats (already divided by the scale) -> W 8-bit codes: saturate, flush, round to nearest even.
template <typename C>
inline vb float_to_fp8(vf x) {
  using F = Fp8<C>;
  constexpr uint32_t drop = 23 - F::mant;
  vu bits;
  std::memcpy(&bits, &x, sizeof bits);
  const vu sign = (bits >> 24) & 0x80u;
  bits &= 0x7fffffffu;
  vf ax;
  std::memcpy(&ax, &bits, sizeof ax);
  ax = ax < F::max ? ax : splat(F::max);
  std::memcpy(&bits, &ax, sizeof bits);
  bits += ((1u << (drop - 1)) - 1) + ((bits >> drop) & 1u);
  const vu code = ((bits >> drop) - ((127 - F::bias) << F::mant)) | sign;
  return __builtin_convertvector(ax < F::tiny ? vu{} : code, vb);
}

// W 8-bit codes -> W floats, exactly: the code's exponent and mantissa move into fp32's fields,
// the exponent rebiased; code 0 (and 0x80) is 0.
template <typename C>
inline vf fp8_to_float(const uint8_t* p) {
  using F = Fp8<C>;
  vb b;
  std::memcpy(&b, p, sizeof b);
  const vu u = __builtin_convertvector(b, vu);
  const vu mag = u & 0x7fu;
  const vu bits = ((mag << (23 - F::mant)) + ((127 - F::bias) << 23)) | ((u & 0x80u) << 24);
  const vu out_bits = mag == 0 ? vu{} : bits;
  vf out;
  std::memcpy(&out, &out_bits, sizeof out);
  return out;
}

// One code -> float, as fp8_to_float widens it (0x80, which writes never store, reads as +0).
template <typename C>
inline float fp8_one(C x) {
  uint8_t code;
  std::memcpy(&code, &x, 1);
  return (code & 0x7f) ? float(x) : 0.f;
}

// n storage values -> NV * W floats (zero padded).
template <typename T, int NV>
inline void to_float(const T* src, float* dst, int n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (is_fp8<T>()) {
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
    int i = 0;
    for (; i + W <= n; i += W) store(dst + i, fp8_to_float<T>(s + i));
    for (; i < n; ++i) dst[i] = fp8_one(src[i]);
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    if (n == NV * W) {  // the common case, unrolled: head_dim a multiple of W
      for (int j = 0; j < NV; ++j) {
        vh h;
        std::memcpy(&h, s + j * W, sizeof h);
        const vu u = __builtin_convertvector(h, vu) << 16;
        std::memcpy(dst + j * W, &u, sizeof u);
      }
      return;
    }
    int i = 0;
    for (; i + W <= n; i += W) {
      vh h;
      std::memcpy(&h, s + i, sizeof h);
      const vu u = __builtin_convertvector(h, vu) << 16;
      std::memcpy(dst + i, &u, sizeof u);
    }
    for (; i < n; ++i) {
      const uint32_t u = uint32_t(s[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
  }
  for (int i = n; i < NV * W; ++i) dst[i] = 0.f;
}

// Where q.k runs on bf16 pairs (below), an 8-bit cache's K rows are first widened to bf16, which
// holds every e4m3 / e5m2 value exactly; elsewhere K rows are read as stored.
template <typename T, typename C>
using KRow = std::conditional_t<ATTNSERVE_BF16_DOT && std::is_same_v<T, c10::BFloat16> && is_fp8<C>(),
                                c10::BFloat16, C>;

// n K elements into K-row type K: a copy, or 8-bit -> bf16 (the top half of the exact fp32).
template <typename K, typename C>
inline void copy_k(const C* src, K* dst, int64_t n) {
  if constexpr (std::is_same_v<K, C>) {
    std::memcpy(dst, src, n * sizeof(C));
  } else {
    typedef uint8_t vb2 __attribute__((vector_size(2 * W)));
    typedef uint16_t vh2 __attribute__((vector_size(2 * W * sizeof(uint16_t))));
    using F = Fp8<C>;
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {  // bf16 has fp32's exponent: the same rebias, 16-bit lanes
      vb2 b;
      std::memcpy(&b, s + i, sizeof b);
      const vh2 u = __builtin_convertvector(b, vh2);
      const vh2 mag = u & 0x7f;
      const vh2 bits = ((mag << (7 - F::mant)) + ((127 - F::bias) << 7)) | ((u & 0x80) << 8);
      const vh2 out = mag == 0 ? vh2{} : bits;
      std::memcpy(d + i, &out, sizeof out);
    }
    for (; i < n; ++i) dst[i] = K(fp8_one(src[i]));
  }
}

template <typename T>
inline void from_float(const float* src, T* dst, int n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);  // round to nearest even
  }
}

struct Layout {
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  int block_shift;  // log2(block_size): a power of two, so positions split by shift and mask
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h;
  int64_t cache_stride_block, cache_stride_tok, cache_stride_head;
  int64_t table_stride;
};

struct WorkItem {
  int32_t seq, first_head, num_heads;  // KV heads [first, first + num) of sequence `seq`
  int32_t first_row, num_rows;  // per head, query rows [first, first + num); row r = token r / group
  int64_t cost;
};

struct SeqView {  // one sequence's slice of the step
  const int32_t* block_table;
  int64_t seq_len, query_start, num_queries;
  int64_t position(int64_t token) const { return seq_len - num_queries + token; }
};

// One layer's departures from plain causal attention (all off: window 0, softcap 0, no sinks).
struct Variant {
  int64_t window;  // > 0: the query at position p sees keys (p - window, p]
  float softcap, inv_softcap;  // softcap > 0: score -> softcap * tanh(score / softcap), before the mask
  const float* sinks;  // (num_heads,) one logit per query head that attends to nothing, or null

  // The first key a query at `pos` sees. NOTE: every key loop starts here: the blocks before a
  // window are stale (the engine may have handed them to another sequence), never to be read.
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  vf cap(vf s) const { return tanh_v(s * inv_softcap) * softcap; }
  // A row's online softmax state before any key: the sink as a logit already seen, with no value.
  float start_max(int64_t qhead) const { return sinks ? sinks[qhead] : NEG_INF; }
  float start_sum(int64_t qhead) const { return sinks && sinks[qhead] > NEG_INF ? 1.f : 0.f; }
};

inline int64_t kv_offset(const SeqView& s, int64_t pos, int64_t head, const Layout& L) {
  return s.block_table[pos >> L.block_shift] * L.cache_stride_block + (pos & (L.block_size - 1)) * L.cache_stride_tok +
         head * L.cache_stride_head;
}

// Prefetch the K and V rows of keys [key0, key0 + nk), `bytes` of each from KV head `head` on.
template <typename C>
inline void prefetch_keys(const C* k_cache, const C* v_cache, const SeqView& s, int64_t key0, int64_t nk,
                          int64_t head, int64_t bytes, const Layout& L) {
  for (int64_t t = 0; t < nk; ++t) {
    const int64_t off = kv_offset(s, key0 + t, head, L);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k_cache + off) + b, 0, 1);
      __builtin_prefetch(reinterpret_cast<const char*>(v_cache + off) + b, 0, 1);
    }
  }
}

// K and V rows of keys [key0 + t0, key0 + nk) for one head: V as fp32 [t][Dp] (or, with `v_rows`, where each
// V row lies), K as fp32 too unless `kf` is null, and where each K row lies (in the cache, or widened into `kb`
// [t][Dp]). The chunk's other keys are zero rows: those before t0 (before the earliest window's start) are never
// read, as their blocks may be stale; those from nk on do not exist. The math then runs whole chunks.
template <typename C, typename K, int NV>
inline void load_chunk(const C* k_cache, const C* v_cache, const SeqView& s, int64_t key0, int t0, int nk,
                       int64_t head, const Layout& L, float* kf, float* vf_, const K** k_rows, K* kb,
                       const C** v_rows) {
  const int64_t num_keys = s.seq_len, row_bytes = L.head_dim * int64_t(sizeof(C));
  for (int t = 0; t < KEY_CHUNK; ++t) {
    if (t >= t0 && t < nk) continue;
    k_rows[t] = reinterpret_cast<const K*>(ZERO_ROW);
    if (kf != nullptr) std::fill(kf + t * NV * W, kf + (t + 1) * NV * W, 0.f);
    if (v_rows != nullptr)
      v_rows[t] = reinterpret_cast<const C*>(ZERO_ROW);
    else
      std::fill(vf_ + t * NV * W, vf_ + (t + 1) * NV * W, 0.f);
  }
  for (int t = t0; t < nk; ++t) {
    // NOTE: a steady stream of prefetches, PREFETCH_KEYS ahead: a burst of a whole chunk's rows
    // would overflow the miss queues, and the blocks are DRAM-cold (every other layer ran since)
    if (key0 + t + PREFETCH_KEYS < num_keys) {
      prefetch_keys(k_cache, v_cache, s, key0 + t + PREFETCH_KEYS, 1, head, row_bytes, L);
    }
    const int64_t off = kv_offset(s, key0 + t, head, L);
    if constexpr (std::is_same_v<K, C>) {
      k_rows[t] = k_cache + off;
    } else {
      copy_k(k_cache + off, kb + t * NV * W, L.head_dim);
      k_rows[t] = kb + t * NV * W;
    }
    if (kf != nullptr) to_float<C, NV>(k_cache + off, kf + t * NV * W, int(L.head_dim));
    if (v_rows != nullptr)
      v_rows[t] = v_cache + off;
    else
      to_float<C, NV>(v_cache + off, vf_ + t * NV * W, int(L.head_dim));
  }
}

// An fp32 pool's row as the math reads it (only called for an fp32 pool).
template <typename X>
inline const float* fp32_row(const X* row) {
  if constexpr (std::is_same_v<X, float>) {
    return row;
  } else {
    return nullptr;
  }
}

// Whether q.k can be taken on bf16 pairs directly (vdpbf16ps): bf16 queries and storage, an
// AVX512-BF16 CPU, and head_dim a multiple of 2W, so rows load as whole vectors of 2W bf16.
template <typename T, typename C, int NV>
constexpr bool bf16_dot() {
  return ATTNSERVE_BF16_DOT && std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && NV % 2 == 0;
}

#if ATTNSERVE_BF16_DOT
inline __m512bh load_bf16_pairs(const void* p) { return (__m512bh)_mm512_loadu_si512(p); }
#endif

// q.k on AMX tiles (the amx build): 16 keys x 16 query rows per chunk, `tdpbf16ps` over 32 dims a step,
// K's rows as tile A and the rows' q pairs ([pair][row], as a prefill tile keeps them) as tile B. Decode
// and prefill both take their bf16 scores this way, with the same operands, so a row's bits do not
// depend on its path (the file's head). NOTE: vdpbf16ps runs at half the fp32 FMA's multiply rate on
// the AMX Xeon, and the q.k of a prefill chunk was 40% of its time.
#if ATTNSERVE_AMX_BF16
constexpr bool QK_TILES = true;

// Tiles 0, 6: 16 K rows x 32 bf16 dims; 1: 16 dim pairs x 16 rows' q pairs; 2-5: scores, 16 keys x 16 rows
inline void configure_qk_tiles() {
  TileConfig c;
  for (int t : {0, 1, 2, 3, 4, 5, 6}) c.rows[t] = 16, c.colsb[t] = 64;
  load_tile_config(c);
}

inline void release_qk_tiles() { _tile_release(); }

// scores[chunk][key][row] for `n` (1-4) chunks of 16 keys = sum over head_dim (`steps` x 32 dims, in order)
// of k row . q row: chunk c's K rows from k[c] on, `k_stride` bytes apart; q's pairs as [pair][16 rows].
// The chunks' dot products are issued side by side (one chunk's alone waits on each step's latency).
inline void qk_scores(const void* const* k, int64_t k_stride, const uint32_t* q_pairs, int steps, int n,
                      float* scores) {
  const char* k0 = static_cast<const char*>(k[0]);
  const char* k1 = static_cast<const char*>(k[n > 1 ? 1 : 0]);
  const char* k2 = static_cast<const char*>(k[n > 2 ? 2 : 0]);
  const char* k3 = static_cast<const char*>(k[n > 3 ? 3 : 0]);
  tile_reads_memory();  // the rows written before are what the tile loads read
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  for (int s = 0; s < steps; ++s) {
    _tile_loadd(1, q_pairs + 16 * 16 * s, 64);
    _tile_loadd(0, k0 + 64 * s, k_stride);
    _tile_dpbf16ps(2, 0, 1);
    if (n > 1) {
      _tile_loadd(6, k1 + 64 * s, k_stride);
      _tile_dpbf16ps(3, 6, 1);
    }
    if (n > 2) {
      _tile_loadd(0, k2 + 64 * s, k_stride);
      _tile_dpbf16ps(4, 0, 1);
    }
    if (n > 3) {
      _tile_loadd(6, k3 + 64 * s, k_stride);
      _tile_dpbf16ps(5, 6, 1);
    }
  }
  _tile_stored(2, scores, 64);
  if (n > 1) _tile_stored(3, scores + 256, 64);
  if (n > 2) _tile_stored(4, scores + 512, 64);
  if (n > 3) _tile_stored(5, scores + 768, 64);
  tile_reads_memory();  // and the scores are read after the stores
}
#else
constexpr bool QK_TILES = false;
inline void configure_qk_tiles() {}
inline void release_qk_tiles() {}
inline void qk_scores(const void* const*, int64_t, const uint32_t*, int, int, float*) {}
#endif

// P.V on bf16 pairs (vdpbf16ps) where q.k is (`bf16_path`), in the avx512_bf16 build: a chunk's weights rounded
// to bf16 (as ATen's CPU flash attention rounds them for bf16 inputs) and its keys taken two at a time, V's rows
// as they are stored, no widening: half the multiply instructions of fp32 FMAs. Key pair i of a chunk is keys 2i
// (the low half) and 2i + 1 in every path, and every path takes all of a chunk's pairs, so a row's value sums are
// the same steps whichever path takes it; a masked key adds an exact zero (a zero weight, and a zero row where no
// key lies). Measured on Zen 4 (`bench_attention.py --repeats 21`, bf16, three alternating runs): prefill 1 x 1024
// keys 7.07-7.41 -> 5.23-6.09 ms, verification 4 x 4 rows 0.32-0.33 -> 0.22-0.32 ms; the default model's
// perplexity (`attnserve eval`) 21.0264 -> 21.0413 on its Q4_1 codes, 20.9811 -> 20.9855 in bf16. Only on AMD's
// cores (`pv_pairs_here`), where vdpbf16ps runs at the fp32 FMA's rate (Zen 4: 3.6 G/s a core, each), so twice its
// multiplies: Intel's run it at half the FMA's rate (the AMX Xeon, the qk tiles' NOTE), which would make their P.V
// slower; the amx build's values stay on fp32 FMAs until they go on the tiles.
#if ATTNSERVE_BF16_DOT && !ATTNSERVE_AMX_BF16
constexpr bool PV_PAIRS = true;

// NOTE: one answer per process, so that every path of every call takes its values the same way
inline bool pv_pairs_here() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// Two bf16 rows a and b (32 dims each) as pairs (a[d], b[d]) of 16 dims each: dims 0-15, then 16-31
inline __m512i pairs_low(__m512i a, __m512i b) {
  const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(a, idx, b);
}
inline __m512i pairs_high(__m512i a, __m512i b) {
  const __m512i idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                       55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  return _mm512_permutex2var_epi16(a, idx, b);
}

// A chunk's V rows (KEY_CHUNK of them, Dp bf16 each) as key pairs: out[i][d] = (v[2i][d], v[2i + 1][d])
template <int NV>
inline void value_pairs(const c10::BFloat16* const* v, uint32_t* out) {
  constexpr int Dp = NV * W;
  for (int i = 0; i < KEY_CHUNK / 2; ++i) {
    const char* a = reinterpret_cast<const char*>(v[2 * i]);
    const char* b = reinterpret_cast<const char*>(v[2 * i + 1]);
    for (int c = 0; c < Dp / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(a + 64 * c), y = _mm512_loadu_si512(b + 64 * c);
      _mm512_store_si512(out + i * Dp + 32 * c, pairs_low(x, y));
      _mm512_store_si512(out + i * Dp + 32 * c + 16, pairs_high(x, y));
    }
  }
}

// A decode's values for R rows of one head over one chunk: acc (rows Dp apart) * correction, then per key pair
// the row's two weights (rounded to bf16) against the pairs of V rows, which the R rows share.
template <int NV, int R>
inline void add_value_pair_rows(float* acc, const float* correction, const float* pf, const uint32_t* vp) {
  constexpr int Dp = NV * W;
  __m512 av[R][NV];
  alignas(64) uint32_t wp[R][KEY_CHUNK / 2];  // the rows' weights as bf16 pairs: keys 2i, 2i + 1
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < NV; ++j) av[i][j] = (__m512)(load(acc + i * Dp + j * W) * correction[i]);
    const __m256bh w = _mm512_cvtneps_pbh((__m512)load(pf + i * KEY_CHUNK));
    std::memcpy(wp[i], &w, sizeof w);
  }
  for (int k = 0; k < KEY_CHUNK / 2; ++k) {
    for (int i = 0; i < R; ++i) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int32_t(wp[i][k]));
      for (int j = 0; j < NV; ++j)
        av[i][j] = _mm512_dpbf16_ps(av[i][j], (__m512bh)_mm512_load_si512(vp + k * Dp + j * W), w);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) store(acc + i * Dp + j * W, (vf)av[i][j]);
}

// add_value_pair_rows over a head's n rows, as many at a time as keep their accumulators in registers
template <int NV>
inline void add_value_pairs(float* acc, int n, const float* correction, const float* pf, const uint32_t* vp) {
  constexpr int RB = std::clamp((32 - 2) / NV, 1, 4);
  for (int r0 = 0; r0 < n; r0 += RB) {
    const int nr = std::min(RB, n - r0);
    [&]<int... R>(std::integer_sequence<int, R...>) {
      ((nr == R + 1 ? add_value_pair_rows<NV, R + 1>(acc + r0 * NV * W, correction + r0, pf + r0 * KEY_CHUNK, vp)
                    : void()),
       ...);
    }(std::make_integer_sequence<int, RB>{});
  }
}

// A prefill tile's values over one chunk: accT ([d][lane]) * correction, then per key pair the lanes' two
// weights (s: the chunk's KEY_CHUNK weight vectors, rounded to bf16) against V's pair for each dim, broadcast.
template <int NV, int DB>
inline void add_value_pair_lanes(float* accT, vf correction, const vf* s, const uint32_t* vp) {
  constexpr int Dp = NV * W;
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512bh wp[KEY_CHUNK / 2];  // lane l of pair i: (s[2i][l], s[2i + 1][l])
  for (int i = 0; i < KEY_CHUNK / 2; ++i)
    wp[i] = (__m512bh)_mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh((__m512)s[2 * i + 1], (__m512)s[2 * i]));
  for (int d0 = 0; d0 < Dp; d0 += DB) {
    __m512 a[DB];
    for (int j = 0; j < DB; ++j) a[j] = (__m512)(load(accT + (d0 + j) * W) * correction);
    for (int i = 0; i < KEY_CHUNK / 2; ++i)
      for (int j = 0; j < DB; ++j)
        a[j] = _mm512_dpbf16_ps(a[j], wp[i], (__m512bh)_mm512_set1_epi32(int32_t(vp[i * Dp + d0 + j])));
    for (int j = 0; j < DB; ++j) store(accT + (d0 + j) * W, (vf)a[j]);
  }
}
#else
constexpr bool PV_PAIRS = false;
inline bool pv_pairs_here() { return false; }
template <int NV>
inline void value_pairs(const c10::BFloat16* const*, uint32_t*) {}
template <int NV>
inline void add_value_pairs(float*, int, const float*, const float*, const uint32_t*) {}
template <int NV, int DB>
inline void add_value_pair_lanes(float*, vf, const vf*, const uint32_t*) {}
#endif

// NOTE: on the tiles (`tile_path`: head_dim whole tiles of bf16 pairs), a bf16 pool's chunk of keys (16 keys
// of one block, where block_size is a multiple of KEY_CHUNK) is read where it lies: K by strided tile loads,
// in decode and prefill alike, and a decode's V rows by the values' loop. A tile load of rows just copied out
// waited for the copy's stores (a quarter of the decode's time). Measured: a batch-1 step at 1,600 tokens of
// context 12.8 -> 11.0 ms; 32 decodes over L3-resident blocks 25% faster, over DRAM-cold ones alike.
template <typename C>
inline bool k_tiles_in_pool(bool tile_path, const Layout& L) {
  return tile_path && std::is_same_v<C, c10::BFloat16> && L.block_size % KEY_CHUNK == 0;
}

// A decode's values for R rows of one head: acc (rows Dp apart) * correction, then + p[t] * V row t over keys
// [first, end), key by key (a row's steps, in its order, as one row alone takes them). The R rows share each
// V row's load (and a bf16 row's widening, exact, in registers).
template <int NV, int R, typename V>
inline void add_value_rows(float* acc, const float* correction, const float* pf, const V* const* v, int first, int end,
                           int base) {
  constexpr int Dp = NV * W;
  vf av[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) av[i][j] = load(acc + i * Dp + j * W) * correction[i];
  for (int t = first; t < end; ++t) {
    vf x[NV];
    for (int j = 0; j < NV; ++j) x[j] = load_vec(v[t] + j * W);
    for (int i = 0; i < R; ++i) {
      const vf pt = splat(pf[i * KEY_CHUNK + t - base]);
      for (int j = 0; j < NV; ++j) av[i][j] = fmadd(x[j], pt, av[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) store(acc + i * Dp + j * W, av[i][j]);
}

// add_value_rows over a head's n rows, as many at a time as keep their accumulators in registers
template <int NV, typename V>
inline void add_values(float* acc, int n, const float* correction, const float* pf, const V* const* v, int first,
                       int end, int base) {
  constexpr int REGS = W == 16 ? 32 : 16, RB = std::clamp((REGS - NV - 2) / NV, 1, 4);
  for (int r0 = 0; r0 < n; r0 += RB) {
    const int nr = std::min(RB, n - r0);
    [&]<int... R>(std::integer_sequence<int, R...>) {
      ((nr == R + 1 ? add_value_rows<NV, R + 1, V>(acc + r0 * NV * W, correction + r0, pf + r0 * KEY_CHUNK, v, first,
                                                    end, base)
                    : void()),
       ...);
    }(std::make_integer_sequence<int, RB>{});
  }
}

// A decode: one query token, KV heads [first, first + num), each head's group of query heads
// as rows. A head's K rows are transposed (keys as lanes), so each row's scores are head_dim
// multiply-adds in order, as a prefill tile's lane takes them; DECODE_CHUNKS chunks at a time, whose
// sums are independent chains (one chain alone waits on each multiply-add's latency). Taking all
// heads of a sequence in one item reads each block whole, in address order. NV * W = head_dim
// rounded up to HEAD_DIM_STEP (padding lanes are zero).
template <typename T, typename C, int NV>
void attend_decode(const WorkItem& w, const SeqView& sv, const T* q, T* out, const C* k_cache, const C* v_cache,
                   const Layout& L, float scale, float v_scale, const Variant& var) {
  constexpr int Dp = NV * W, KC = KEY_CHUNK, CH = KC / W, NC = DECODE_CHUNKS, SPAN = NC * KC;
  const int group = int(L.num_heads / L.num_kv_heads);
  const int rows = w.num_heads * group;
  const int64_t num_keys = sv.seq_len;
  const int64_t first_key = var.first_key(sv.position(sv.num_queries - 1));  // the window's start (0 without)
  const int64_t token = sv.query_start + sv.num_queries - 1;
  const bool capped = var.softcap > 0.f;

  alignas(64) float qf[MAX_TILE_ROWS * Dp];
  alignas(64) float acc[MAX_TILE_ROWS * Dp];
  alignas(64) float kf[SPAN * Dp];
  alignas(64) float vfb[SPAN * Dp];
  alignas(64) float kT[NC * Dp * KC];  // [chunk][d][key]: K, keys as lanes (bf16 path: [chunk][pair][key])
  alignas(64) float pf[MAX_TILE_ROWS * KC];  // a chunk's weights, per row of the head
  alignas(64) vf srows[MAX_TILE_ROWS][NC * CH];  // the span's scores, per row of the head
  float mrow[MAX_TILE_ROWS], lrow[MAX_TILE_ROWS];

  const int64_t first_qhead = int64_t(w.first_head) * group;  // row r is query head first_qhead + r
  for (int r = 0; r < rows; ++r) {
    float* dst = qf + r * Dp;
    to_float<T, NV>(q + token * L.q_stride_t + (first_qhead + r) * L.q_stride_h, dst, int(L.head_dim));
    for (int j = 0; j < NV; ++j) store(dst + j * W, load(dst + j * W) * scale);
  }
  std::fill(acc, acc + rows * Dp, 0.f);
  for (int r = 0; r < rows; ++r) {
    mrow[r] = var.start_max(first_qhead + r);
    lrow[r] = var.start_sum(first_qhead + r);
  }
  using K = KRow<T, C>;
  const K* k_rows[SPAN];
  const bool bf16_path = bf16_dot<T, K, NV>() && L.head_dim == Dp;  // else q.k on fp32 copies
  constexpr bool TILED = QK_TILES && bf16_dot<T, K, NV>();
  const bool tile_path = TILED && bf16_path;  // q.k on the tiles
  const int cols = bf16_path ? Dp / 2 : Dp;  // 32-bit columns per K row
  // tile path: the rows' q pairs [pair][16 rows], and a head's scores [chunk][key][16 rows], per 16 rows
  constexpr int SCORES = NC * KC * 16;
  alignas(64) uint32_t q_pairs[TILED ? (MAX_TILE_ROWS / 16) * (Dp / 2) * 16 : 1];
  alignas(64) float chunk_scores[TILED ? (MAX_TILE_ROWS / 16) * SCORES : 1];
  if (tile_path) {  // NOTE: lanes past `rows` are left as they are: their scores' columns are never read
    for (int r = 0; r < rows; ++r) {
      const T* qr = q + token * L.q_stride_t + (first_qhead + r) * L.q_stride_h;
      for (int j = 0; j < Dp / 2; ++j) std::memcpy(q_pairs + ((r / 16) * (Dp / 2) + j) * 16 + r % 16, qr + 2 * j, 4);
    }
  }

  // NOTE: a span's K and V rows for all the item's heads (adjacent in a row) are first copied
  // out in address order: one sequential read per block, which DRAM streams 2-3x faster than
  // the strided per-head reads the math would make; the math then reads the L1-resident copy.
  // An fp32 pool (head_dim a whole number of vectors) is read where it lies instead: the rows
  // are what the math reads, a whole-rows item still reads each block in order, and the two
  // copies cost more than the math. An item of one head (a decode when there are fewer sequences
  // than 2 per thread) reads only its head's part of each row: no sequential read to gain, so its
  // rows are read where they lie too, when K's rows need no widening (`direct`): the copy loop is then
  // only the prefetches, issued a span ahead at once instead of one key's worth per copied row. On
  // Zen 4, batch-1 decode steps of the Q8_0 model, 4 alternating pairs: 8.6 -> 7.7 ms (contexts
  // 128-928), 6.9 -> 6.7 ms (128-228).
  const bool in_place = std::is_same_v<C, float> && L.head_dim == Dp;
  const bool pool_tiles = k_tiles_in_pool<C>(tile_path, L);  // V's rows are read there too
  // NOTE: not on the tiles unless they load from the pool: a tile loads its 16 K rows at one stride, which the
  // staged rows have and a chunk's rows across blocks do not
  const bool direct = std::is_same_v<K, C> && w.num_heads == 1 && !in_place && !pool_tiles && !tile_path;
  const int64_t span = w.num_heads * L.head_dim;
  thread_local std::vector<K> k_stage;
  thread_local std::vector<C> v_stage;
  k_stage.resize(size_t(SPAN * span));
  v_stage.resize(size_t(SPAN * span));
  K* ks = k_stage.data();
  C* vs = v_stage.data();
  const float* kr[SPAN];  // the fp32 K and V rows of the span's keys, for the current head
  const float* vr[SPAN];
  // NOTE: a bf16 pool's V rows (head_dim whole vectors) are widened in registers by the values' loop, not
  // copied out widened first: the same fp32 values, without a store and a reload per key, head and row
  const bool v_bf16 = W == 16 && std::is_same_v<C, c10::BFloat16> && !in_place && L.head_dim == Dp;
  const c10::BFloat16* vb[SPAN];
  // P.V on pairs (PV_PAIRS): every key's V row as bf16 in vb, a zero row where no key lies; an 8-bit pool's
  // widened (exact) into v_wide
  const bool pv_pairs = PV_PAIRS && bf16_path && pv_pairs_here();
  alignas(64) c10::BFloat16 v_wide[PV_PAIRS && is_fp8<C>() ? SPAN * Dp : 1];
  alignas(64) uint32_t v_pairs[PV_PAIRS ? KC / 2 * Dp : 1];
  int64_t offs[SPAN];
  // NOTE: chunks at multiples of KEY_CHUNK, as a prefill tile's; the keys before the window's start are masked, never read
  for (int64_t key0 = first_key - first_key % KC; key0 < num_keys; key0 += SPAN) {
    const int nk = int(std::min<int64_t>(SPAN, num_keys - key0));
    const int t0 = int(std::max<int64_t>(0, first_key - key0));
    const int num_chunks = (nk + KC - 1) / KC;
    for (int t = t0; t < nk; ++t) {
      if (key0 + t + PREFETCH_KEYS < num_keys) {  // NOTE: ahead only: nothing before first_key is touched
        prefetch_keys(k_cache, v_cache, sv, key0 + t + PREFETCH_KEYS, 1, w.first_head, span * int64_t(sizeof(C)), L);
      }
      offs[t] = kv_offset(sv, key0 + t, w.first_head, L);
      if (in_place || pool_tiles || direct) continue;
      copy_k(k_cache + offs[t], ks + t * span, span);
      std::memcpy(vs + t * span, v_cache + offs[t], span * sizeof(C));
    }
    for (int hh = 0; hh < w.num_heads; ++hh) {
      for (int t = 0; t < num_chunks * KC; ++t) {
        if (t < t0 || t >= nk) {
          k_rows[t] = reinterpret_cast<const K*>(ZERO_ROW);
          kr[t] = ZERO_ROW;
          vb[t] = reinterpret_cast<const c10::BFloat16*>(ZERO_ROW);
          continue;
        }
        const C* k_pool = k_cache + offs[t] + hh * L.head_dim;  // the key's rows in the pool
        const C* v_pool = v_cache + offs[t] + hh * L.head_dim;
        if (in_place) {
          kr[t] = fp32_row(k_pool);
          vr[t] = fp32_row(v_pool);
          continue;
        }
        if (pool_tiles) {
          vb[t] = reinterpret_cast<const c10::BFloat16*>(v_pool);
          continue;
        }
        const K* k_staged = ks + t * span + hh * L.head_dim;
        const C* v_row = direct ? v_pool : vs + t * span + hh * L.head_dim;
        if constexpr (std::is_same_v<K, C>)
          k_rows[t] = direct ? k_pool : k_staged;
        else
          k_rows[t] = k_staged;  // NOTE: `direct` is false where K's rows are widened
        if (!bf16_path) to_float<K, NV>(k_rows[t], kf + t * Dp, int(L.head_dim));
        kr[t] = kf + t * Dp;
        if (v_bf16) {
          vb[t] = reinterpret_cast<const c10::BFloat16*>(v_row);
          continue;
        }
        if constexpr (PV_PAIRS && is_fp8<C>()) {
          if (pv_pairs) {
            copy_k(v_row, v_wide + t * Dp, L.head_dim);
            vb[t] = v_wide + t * Dp;
            continue;
          }
        }
        to_float<C, NV>(v_row, vfb + t * Dp, int(L.head_dim));
        vr[t] = vfb + t * Dp;
      }
      if (tile_path) {  // the head's rows' scores, chunk by chunk (rows of keys outside [t0, nk) are masked below)
        const int r0 = hh * group;
        const int64_t row_bytes = span * int64_t(sizeof(K));
        const void* chunks[NC];
        for (int cc = 0; cc < num_chunks; ++cc) {  // NOTE: a chunk's keys outside [t0, nk) lie in its block too
          const int64_t key = key0 + cc * KC;
          chunks[cc] = pool_tiles ? static_cast<const void*>(k_cache + kv_offset(sv, key, w.first_head + hh, L))
                                  : static_cast<const void*>(ks + cc * KC * span + hh * L.head_dim);
        }
        const int64_t stride = pool_tiles ? L.cache_stride_tok * int64_t(sizeof(C)) : row_bytes;
        for (int g0 = r0 - r0 % 16; g0 < r0 + group; g0 += 16) {
          qk_scores(chunks, stride, q_pairs + (g0 / 16) * (Dp / 2) * 16, Dp / 32, num_chunks,
                    chunk_scores + (g0 / 16) * SCORES);
        }
      }
      // K^T, W keys x W columns at a time; the chunks past the span's keys are zeros
      for (int cc = 0; cc < NC && !tile_path; ++cc) {
        float* kTc = kT + cc * Dp * KC;
        if (cc >= num_chunks) {
          std::fill(kTc, kTc + cols * KC, 0.f);
          continue;
        }
        for (int c = 0; c < CH; ++c) {
          for (int b = 0; b < cols / W; ++b) {
            vf x[W];
            for (int i = 0; i < W; ++i) {
              const int t = cc * KC + c * W + i;
              x[i] = load((bf16_path ? reinterpret_cast<const float*>(k_rows[t]) : kr[t]) + b * W);
            }
            transpose(x);
            for (int j = 0; j < W; ++j) store(kTc + (b * W + j) * KC + c * W, x[j]);
          }
        }
      }
      for (int r = hh * group; r < (hh + 1) * group; ++r) {
        vf* s = srows[r - hh * group];  // the span's scores, W keys per vector
        for (int i = 0; i < NC * CH; ++i) s[i] = vf{};
        if constexpr (bf16_dot<T, K, NV>()) {
#if ATTNSERVE_BF16_DOT
          if (tile_path) {  // the row's column of each chunk's scores
            const float* column = chunk_scores + (r / 16) * SCORES + r % 16;
            const __m512i keys = (__m512i)(LANES * 16);  // key t's score lies 16 floats after key t - 1's
            for (int cc = 0; cc < num_chunks; ++cc)
              for (int c = 0; c < CH; ++c)
                s[cc * CH + c] = (vf)_mm512_i32gather_ps(keys, column + (cc * KC + c * W) * 16, 4) * scale;
          } else if (bf16_path) {  // per pair of dims: the row's pair, broadcast, against each key's pair
            const T* qr = q + token * L.q_stride_t + (first_qhead + r) * L.q_stride_h;
            __m512 st[NC];
            for (int cc = 0; cc < NC; ++cc) st[cc] = _mm512_setzero_ps();
            for (int j = 0; j < Dp / 2; ++j) {
              int32_t pair;
              std::memcpy(&pair, qr + 2 * j, sizeof pair);
              const __m512bh qj = (__m512bh)_mm512_set1_epi32(pair);
              for (int cc = 0; cc < NC; ++cc)
                st[cc] = _mm512_dpbf16_ps(st[cc], qj, load_bf16_pairs(kT + cc * Dp * KC + j * KC));
            }
            for (int cc = 0; cc < NC; ++cc) s[cc] = (vf)st[cc] * scale;
          }
#endif
        }
        if (!bf16_path) {
          const float* qr = qf + r * Dp;
          vf sc[NC * CH];
          for (int i = 0; i < NC * CH; ++i) sc[i] = vf{};
          for (int d = 0; d < Dp; ++d) {
            const vf qd = splat(qr[d]);
            for (int cc = 0; cc < NC; ++cc)
              for (int c = 0; c < CH; ++c)
                sc[cc * CH + c] = fmadd(qd, load(kT + cc * Dp * KC + d * KC + c * W), sc[cc * CH + c]);
          }
          for (int i = 0; i < NC * CH; ++i) s[i] = sc[i];
        }
      }
      // the online softmax, chunk by chunk: every row's weights, then the values, each V row loaded once for
      // all the head's rows. NOTE: per row the same steps in the same order as one row at a time
      for (int cc = 0; cc < num_chunks; ++cc) {
        vi valid[CH];  // lanes of keys in [t0, nk)
        for (int c = 0; c < CH; ++c) {
          const vi key = LANES + (cc * KC + c * W);
          valid[c] = (key >= t0) & (key < nk);
        }
        float correction[MAX_TILE_ROWS];
        for (int i = 0; i < group; ++i) {
          const int r = hh * group + i;
          vf* s = srows[i];
          vf smax = splat(NEG_INF);
          for (int c = 0; c < CH; ++c) {
            vf& x = s[cc * CH + c];
            if (capped) x = var.cap(x);  // before the masked lanes' -inf: tanh would make it finite
            x = valid[c] ? x : splat(NEG_INF);
            smax = vmax(smax, x);
          }
          const float m_old = mrow[r], m_new = std::max(m_old, hmax(smax));
          correction[i] = m_old == NEG_INF ? 0.f : exp_neg(splat(m_old - m_new))[0];
          vf psum = vf{};
          for (int c = 0; c < CH; ++c) {
            const vf p = valid[c] ? exp_neg(s[cc * CH + c] - m_new) : vf{};
            store(pf + i * KC + c * W, p);
            psum += p;
          }
          mrow[r] = m_new;
          lrow[r] = lrow[r] * correction[i] + hsum(psum);
        }
        const int first = std::max(t0, cc * KC), end = std::min(nk, (cc + 1) * KC);
        float* a = acc + hh * group * Dp;
        if (pv_pairs) {  // NOTE: all the chunk's pairs, as a prefill tile takes them (masked keys add zeros)
          value_pairs<NV>(vb + cc * KC, v_pairs);
          add_value_pairs<NV>(a, group, correction, pf, v_pairs);
        } else if (v_bf16)
          add_values<NV>(a, group, correction, pf, vb, first, end, cc * KC);
        else
          add_values<NV>(a, group, correction, pf, vr, first, end, cc * KC);
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    float* a = acc + r * Dp;
    const float inv = v_scale / lrow[r];
    for (int j = 0; j < NV; ++j) store(a + j * W, load(a + j * W) * inv);
    from_float(a, out + token * L.out_stride_t + (first_qhead + r) * L.out_stride_h, int(L.head_dim));
  }
}

// A prefill tile: up to W query rows of one KV head, one row per vector lane, so scores, the
// online softmax and the accumulators are all lane-wise. Per key, a row's score is Dp FMAs against
// the key's elements broadcast; causality is a per-lane compare. Each chunk's sum is folded in a
// decode's order (the file's head: batch invariance).
template <typename T, typename C, int NV>
void attend_rows(const WorkItem& w, const SeqView& sv, const T* q, T* out, const C* k_cache, const C* v_cache,
                 const Layout& L, float scale, float v_scale, const Variant& var) {
  // DB: accumulator vectors kept in registers at a time, beside the chunk's W score vectors
  constexpr int Dp = NV * W, DB = W == 8 ? 4 : 8;
  static_assert(Dp % DB == 0);
  const int group = int(L.num_heads / L.num_kv_heads);
  const int D = int(L.head_dim);

  alignas(64) float qT[Dp * W];  // [d][lane]
  alignas(64) float accT[Dp * W];  // [d][lane]
  constexpr int KC = KEY_CHUNK, CH = KC / W;
  alignas(64) float kf[KC * Dp];
  alignas(64) float vfb[KC * Dp];
  alignas(64) float row[Dp];
  alignas(64) uint32_t qT2[(Dp / 2) * W];  // bf16 path: [dim pair][lane], q's raw bf16 pairs
  using K = KRow<T, C>;
  alignas(64) K kb[std::is_same_v<K, C> ? 1 : KC * Dp];  // widened K rows, where they are widened
  const K* k_rows[KC];
  const bool bf16_path = bf16_dot<T, K, NV>() && L.head_dim == Dp;
  constexpr bool TILED = QK_TILES && bf16_dot<T, K, NV>();
  const bool tile_path = TILED && bf16_path;  // q.k on the tiles
  const bool pool_tiles = k_tiles_in_pool<C>(tile_path, L);
  alignas(64) uint16_t k_tile[TILED ? KC * Dp : 1];  // tile path: the chunk's K rows, side by side
  alignas(64) float chunk_scores[TILED ? KC * W : 1];
  const bool pv_pairs = PV_PAIRS && bf16_path && pv_pairs_here();  // P.V on bf16 pairs: V's rows where they lie
  const C* v_rows[KC];
  alignas(64) uint32_t v_pairs[PV_PAIRS ? KC / 2 * Dp : 1];
  vi pos;  // each lane's token position; -1 for unused lanes (no key is visible)
  vi lo;  // each lane's first visible key (its window's start)
  vf m = splat(NEG_INF), lsum = vf{};  // the online softmax's running max and sum, per lane
  int64_t last = 0, first_key = std::numeric_limits<int64_t>::max();
  for (int l = 0; l < W; ++l) {
    if (l >= w.num_rows) {
      pos[l] = -1;
      lo[l] = 0;
      for (int d = 0; d < Dp; ++d) qT[d * W + l] = 0.f;
      for (int j = 0; j < Dp / 2; ++j) qT2[j * W + l] = 0;
      continue;
    }
    const int r = w.first_row + l;
    const int64_t token = r / group;
    pos[l] = int32_t(sv.position(token));
    lo[l] = int32_t(var.first_key(pos[l]));
    last = std::max<int64_t>(last, pos[l]);
    first_key = std::min<int64_t>(first_key, lo[l]);
    const int64_t qhead = int64_t(w.first_head) * group + r % group;
    m[l] = var.start_max(qhead);
    lsum[l] = var.start_sum(qhead);
    const T* qr = q + (sv.query_start + token) * L.q_stride_t + qhead * L.q_stride_h;
    if (bf16_path) {
      for (int j = 0; j < Dp / 2; ++j) std::memcpy(qT2 + j * W + l, qr + 2 * j, sizeof(uint32_t));
      continue;
    }
    to_float<T, NV>(qr, row, D);
    for (int d = 0; d < Dp; ++d) qT[d * W + l] = row[d] * scale;
  }
  std::fill(accT, accT + Dp * W, 0.f);
  const int64_t num_keys = last + 1, head = w.first_head;
  const bool windowed = var.window > 0, capped = var.softcap > 0.f;

  // NOTE: from the chunk of the earliest row's window start (chunks at multiples of KEY_CHUNK, as a
  // decode's); keys before that start are masked, never read (load_chunk prefetches ahead only)
  for (int64_t key0 = first_key - first_key % KC; key0 < num_keys; key0 += KC) {
    const int nk = int(std::min<int64_t>(KC, num_keys - key0));
    const int t0 = int(std::max<int64_t>(0, first_key - key0));
    load_chunk<C, K, NV>(k_cache, v_cache, sv, key0, t0, nk, head, L, bf16_path ? nullptr : kf, vfb, k_rows, kb,
                         pv_pairs ? v_rows : nullptr);
    vf s[KC];
    for (int t = 0; t < KC; ++t) s[t] = vf{};
    if constexpr (bf16_dot<T, K, NV>()) {
#if ATTNSERVE_BF16_DOT
      if (pool_tiles) {  // the chunk's K rows where they lie
        const void* chunk[1] = {k_cache + kv_offset(sv, key0, head, L)};
        qk_scores(chunk, L.cache_stride_tok * int64_t(sizeof(C)), qT2, Dp / 32, 1, chunk_scores);
        for (int t = 0; t < KC; ++t) s[t] = load(chunk_scores + t * W) * scale;
      } else if (tile_path) {
        for (int t = 0; t < KC; ++t) std::memcpy(k_tile + t * Dp, k_rows[t], Dp * sizeof(uint16_t));
        const void* chunk[1] = {k_tile};
        qk_scores(chunk, Dp * int64_t(sizeof(uint16_t)), qT2, Dp / 32, 1, chunk_scores);
        for (int t = 0; t < KC; ++t) s[t] = load(chunk_scores + t * W) * scale;
      } else if (bf16_path) {  // per pair of dims: the lanes' q pairs against each key's pair, broadcast
        // NOTE: all KEY_CHUNK keys, into sums of their own: fixed trip counts keep them in registers
        __m512 st[KC];
        for (int t = 0; t < KC; ++t) st[t] = _mm512_setzero_ps();
        for (int j = 0; j < Dp / 2; ++j) {
          const __m512bh qj = load_bf16_pairs(qT2 + j * W);
          for (int t = 0; t < KC; ++t) {
            int32_t pair;
            std::memcpy(&pair, k_rows[t] + 2 * j, sizeof pair);
            st[t] = _mm512_dpbf16_ps(st[t], qj, (__m512bh)_mm512_set1_epi32(pair));
          }
        }
        for (int t = 0; t < KC; ++t) s[t] = (vf)st[t];
        for (int t = 0; t < KC; ++t) s[t] *= scale;
      }
#endif
    }
    if (!bf16_path) {
      for (int c = 0; c < CH; ++c) {  // W keys at a time: their W sums of their own stay in registers
        vf sc[W];
        for (int t = 0; t < W; ++t) sc[t] = vf{};
        for (int d = 0; d < Dp; ++d) {
          const vf qd = load(qT + d * W);
          for (int t = 0; t < W; ++t) sc[t] = fmadd(qd, splat(kf[(c * W + t) * Dp + d]), sc[t]);
        }
        for (int t = 0; t < W; ++t) s[c * W + t] = sc[t];
      }
    }
    if (capped) {
      for (int t = 0; t < nk; ++t) s[t] = var.cap(s[t]);
    }
    vf chunk_max = splat(NEG_INF);
    for (int t = 0; t < KC; ++t) {
      // NOTE: causality: key key0 + t is visible to the lanes whose token sits at or after it
      // (and, in a window, whose window starts at or before it)
      const int32_t key = int32_t(key0 + t);
      const vi visible = t >= nk ? vi{} : windowed ? ((pos >= key) & (lo <= key)) : (pos >= key);
      s[t] = visible ? s[t] : splat(NEG_INF);
      chunk_max = vmax(chunk_max, s[t]);
    }
    const vf m_new = vmax(m, chunk_max);
    const auto seen = m_new > splat(NEG_INF);  // lanes with at least one visible key so far
    const vf correction = seen ? exp_neg(m - m_new) : vf{};
    for (int t = 0; t < KC; ++t) {
      s[t] = (seen && s[t] > splat(NEG_INF)) ? exp_neg(s[t] - m_new) : vf{};
    }
    // the chunk's sum as a decode takes it: keys l, W + l, ... per lane position l, then halves folded
    vf part[W];
    for (int l = 0; l < W; ++l) {
      part[l] = vf{};
      for (int c = 0; c < CH; ++c) part[l] += s[c * W + l];
    }
    for (int h = W / 2; h >= 1; h /= 2) {
      for (int l = 0; l < h; ++l) part[l] += part[l + h];
    }
    lsum = lsum * correction + part[0];
    m = m_new;
    if constexpr (PV_PAIRS && std::is_same_v<C, c10::BFloat16>) {
      if (pv_pairs) {
        value_pairs<NV>(reinterpret_cast<const c10::BFloat16* const*>(v_rows), v_pairs);
        add_value_pair_lanes<NV, DB>(accT, correction, s, v_pairs);
        continue;
      }
    }
    for (int d0 = 0; d0 < Dp; d0 += DB) {
      vf a[DB];
      for (int j = 0; j < DB; ++j) a[j] = load(accT + (d0 + j) * W) * correction;
      for (int t = t0; t < nk; ++t) {
        const float* vr = vfb + t * Dp + d0;
        for (int j = 0; j < DB; ++j) a[j] = fmadd(s[t], splat(vr[j]), a[j]);
      }
      for (int j = 0; j < DB; ++j) store(accT + (d0 + j) * W, a[j]);
    }
  }

  for (int l = 0; l < w.num_rows; ++l) {
    const int r = w.first_row + l;
    const int64_t token = r / group;
    const int64_t qhead = int64_t(w.first_head) * group + r % group;
    const float inv = v_scale / lsum[l];
    for (int d = 0; d < D; ++d) row[d] = accT[d * W + l] * inv;
    from_float(row, out + (sv.query_start + token) * L.out_stride_t + qhead * L.out_stride_h, D);
  }
}

// One row of n K or V elements into the pool: copied, or divided by the scale and stored in 8 bits.
template <typename T, typename C>
inline void store_row(const T* src, C* dst, int64_t n, float inv_scale) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, n * sizeof(C));
  } else {
    uint8_t* d = reinterpret_cast<uint8_t*>(dst);
    alignas(64) float row[W];
    for (int64_t i = 0; i < n; i += W) {
      const int m = int(std::min<int64_t>(W, n - i));
      to_float<T, 1>(src + i, row, m);
      const vb code = float_to_fp8<C>(load(row) * inv_scale);
      std::memcpy(d + i, &code, m);
    }
  }
}

template <typename T, typename C>
void write_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                 const int64_t* slots, const Layout& L, float k_inv_scale, float v_inv_scale) {
  const int64_t num_tokens = k.size(0), bs = L.block_size;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  C* kc = static_cast<C*>(k_cache.data_ptr());
  C* vc = static_cast<C*>(v_cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t dst = (slots[t] >> L.block_shift) * L.cache_stride_block + (slots[t] & (bs - 1)) * L.cache_stride_tok;
    for (int64_t h = 0; h < L.num_kv_heads; ++h) {
      store_row(kp + t * k.stride(0) + h * k.stride(1), kc + dst + h * L.cache_stride_head, L.head_dim, k_inv_scale);
      store_row(vp + t * v.stride(0) + h * v.stride(1), vc + dst + h * L.cache_stride_head, L.head_dim, v_inv_scale);
    }
  }
}

template <typename T, typename C, int NV>
void attend_all(const T* q, T* out, const C* kc, const C* vc, const std::vector<WorkItem>& items,
                const int32_t* tables, const int32_t* lens, const int32_t* starts, const Layout& L, float scale,
                float v_scale, const Variant& var) {
  const int64_t num_items = int64_t(items.size());
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), int(num_items)));
#pragma omp parallel num_threads(num_threads)
  {
    configure_qk_tiles();  // per thread, once a call (both no-ops in a build without tiles)
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const WorkItem& w = items[i];
      const SeqView sv{tables + w.seq * L.table_stride, lens[w.seq], starts[w.seq], starts[w.seq + 1] - starts[w.seq]};
      // NOTE: an 8-bit pool's prompts come here widened (run: C is T), so its rows path is never built
      if (!std::is_same_v<T, C> || sv.num_queries == 1) {
        attend_decode<T, C, NV>(w, sv, q, out, kc, vc, L, scale, v_scale, var);
      } else if constexpr (std::is_same_v<T, C>) {
        attend_rows<T, C, NV>(w, sv, q, out, kc, vc, L, scale, v_scale, var);
      }
    }
    release_qk_tiles();
  }
}

// The fewest HEAD_DIM_STEPs of HeadDimSteps that hold `steps`.
template <int... S>
constexpr int padded_steps(int steps, std::integer_sequence<int, S...>) {
  int padded = MAX_HEAD_DIM_STEPS;
  ((padded = S >= steps && S < padded ? S : padded), ...);
  return padded;
}

// One instantiation per padded head_dim: S = head_dim / HEAD_DIM_STEP, rounded up to HeadDimSteps.
template <typename T, typename C, int... S>
void dispatch_head_dim(int steps, std::integer_sequence<int, S...> all, const at::Tensor& q, at::Tensor& out,
                       const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<WorkItem>& items,
                       const int32_t* tables, const int32_t* lens, const int32_t* starts, const Layout& L,
                       float scale, float v_scale, const Variant& var) {
  const C* kc = static_cast<const C*>(k_cache.data_ptr());
  const C* vc = static_cast<const C*>(v_cache.data_ptr());
  const int padded = padded_steps(steps, all);
  ((padded == S ? attend_all<T, C, S * HEAD_DIM_STEP / W>(q.data_ptr<T>(), out.data_ptr<T>(), kc, vc, items, tables,
                                                         lens, starts, L, scale, v_scale, var)
                : void()), ...);
}

// n 8-bit values -> n values of T (exact: bf16 and fp32 hold every e4m3 / e5m2 value).
template <typename T, typename C>
inline void widen(const C* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    copy_k(src, dst, n);
  } else {
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
    int64_t i = 0;
    for (; i + W <= n; i += W) store(dst + i, fp8_to_float<C>(s + i));
    for (; i < n; ++i) dst[i] = fp8_one(src[i]);
  }
}

template <typename T, typename C>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
         const at::Tensor& slot_mapping, at::Tensor& out, const std::vector<WorkItem>& items,
         const int32_t* tables, int64_t num_seqs, const int32_t* lens, const int32_t* starts, const Layout& L,
         float scale, float k_scale, float v_scale, const Variant& var) {
  write_cache<T, C>(k, v, k_cache, v_cache, slot_mapping.data_ptr<int64_t>(), L, 1.f / k_scale, 1.f / v_scale);
  const int steps = int((L.head_dim + HEAD_DIM_STEP - 1) / HEAD_DIM_STEP);
  constexpr HeadDimSteps all_steps{};
  // NOTE: K's scale multiplies every score, so it folds into the query scale; V's into the output
  const float qk_scale = scale * k_scale;
  if constexpr (std::is_same_v<T, C>) {
    dispatch_head_dim<T, C>(steps, all_steps, q, out, k_cache, v_cache, items, tables, lens, starts, L, qk_scale,
                            v_scale, var);
  } else {
    // NOTE: every query tile of a prompt reads all its keys, so an 8-bit pool's prompt blocks are
    // widened once, into a pool of q's dtype of their own (exact), instead of once per tile.
    // Decodes read each key once: they widen in place.
    std::vector<WorkItem> decodes, prompts;
    for (const WorkItem& w : items) (starts[w.seq + 1] - starts[w.seq] == 1 ? decodes : prompts).push_back(w);
    dispatch_head_dim<T, C>(steps, all_steps, q, out, k_cache, v_cache, decodes, tables, lens, starts, L, qk_scale,
                            v_scale, var);
    if (prompts.empty()) return;
    std::vector<int32_t> wide_tables(tables, tables + num_seqs * L.table_stride);
    std::vector<int32_t> sources;  // wide block b holds pool block sources[b]
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int32_t nq = starts[s + 1] - starts[s];
      if (nq == 1) continue;
      // NOTE: from the block of the first query's window start: the blocks before it are stale
      // and never read (their table entries stay as they are, unused)
      const int64_t first_block = var.first_key(lens[s] - nq) >> L.block_shift;
      for (int64_t j = first_block; j < (lens[s] + L.block_size - 1) / L.block_size; ++j) {
        wide_tables[s * L.table_stride + j] = int32_t(sources.size());
        sources.push_back(tables[s * L.table_stride + j]);
      }
    }
    const std::vector<int64_t> shape{int64_t(sources.size()), k_cache.size(1), k_cache.size(2), k_cache.size(3)};
    at::Tensor wide_k = at::empty(shape, q.options());
    at::Tensor wide_v = at::empty(shape, q.options());
    const int64_t block = L.cache_stride_block;  // elements per block: the pools are contiguous
    const C* kc = static_cast<const C*>(k_cache.data_ptr());
    const C* vc = static_cast<const C*>(v_cache.data_ptr());
    T* wk = wide_k.data_ptr<T>();
    T* wv = wide_v.data_ptr<T>();
    at::parallel_for(0, int64_t(sources.size()), 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        widen(kc + sources[b] * block, wk + b * block, block);
        widen(vc + sources[b] * block, wv + b * block, block);
      }
    });
    dispatch_head_dim<T, T>(steps, all_steps, q, out, wide_k, wide_v, prompts, wide_tables.data(), lens, starts, L, qk_scale,
                            v_scale, var);
  }
}

// The cache's storage type: the queries' own, or an 8-bit float.
template <typename T>
void run_storage(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slot_mapping, at::Tensor& out,
                 const std::vector<WorkItem>& items, const int32_t* tables, int64_t num_seqs, const int32_t* lens,
                 const int32_t* starts, const Layout& L, float scale, float k_scale, float v_scale,
                 const Variant& var) {
  switch (k_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return run<T, c10::Float8_e4m3fn>(q, k, v, k_cache, v_cache, slot_mapping, out, items, tables, num_seqs, lens,
                                        starts, L, scale, k_scale, v_scale, var);
    case at::kFloat8_e5m2:
      return run<T, c10::Float8_e5m2>(q, k, v, k_cache, v_cache, slot_mapping, out, items, tables, num_seqs, lens,
                                      starts, L, scale, k_scale, v_scale, var);
    default:
      return run<T, T>(q, k, v, k_cache, v_cache, slot_mapping, out, items, tables, num_seqs, lens, starts, L, scale,
                       k_scale, v_scale, var);
  }
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start_loc, int64_t max_query_len,
                               int64_t max_seq_len, double scale, double k_scale, double v_scale, int64_t window,
                               double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be (T, heads, head_dim)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous (num_blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have one shape");
  const auto storage = k_cache.scalar_type();
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k and v must share one dtype");
  TORCH_CHECK(v_cache.scalar_type() == storage, "k_cache and v_cache must share one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q: float32 or bfloat16 only");
  TORCH_CHECK(storage == q.scalar_type() || storage == at::kFloat8_e4m3fn || storage == at::kFloat8_e5m2,
              "the cache holds q's dtype or an 8-bit float");
  TORCH_CHECK(storage != q.scalar_type() || (k_scale == 1.0 && v_scale == 1.0), "scales apply to 8-bit caches only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "metadata must be contiguous");
  const int64_t block_size = k_cache.size(1);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  Layout L{q.size(1), k_cache.size(2), q.size(2), block_size, __builtin_ctzll(uint64_t(block_size)),
           q.stride(0), q.stride(1), 0, 0,
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0)};
  TORCH_CHECK(k_cache.size(3) == L.head_dim && k.size(1) == L.num_kv_heads && L.num_heads % L.num_kv_heads == 0,
              "head shapes disagree");
  TORCH_CHECK(L.head_dim <= MAX_HEAD_DIM_STEPS * HEAD_DIM_STEP, "head_dim above ", MAX_HEAD_DIM_STEPS * HEAD_DIM_STEP);
  const int group = int(L.num_heads / L.num_kv_heads);
  TORCH_CHECK(group <= MAX_TILE_ROWS, "more than ", MAX_TILE_ROWS, " query heads per KV head");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && slot_mapping.size(0) == q.size(0),
              "one slot per new token");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "one row per sequence");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap: 0 (off) or positive");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == L.num_heads &&
                         sinks->is_contiguous() && sinks->device().is_cpu()),
              "sinks: a contiguous float32 (num_heads,) tensor");
  const Variant var{window, float(softcap), softcap > 0.0 ? float(1.0 / softcap) : 0.f,
                    sinks ? sinks->data_ptr<float>() : nullptr};
  auto out = at::empty({q.size(0), L.num_heads, L.head_dim}, q.options());
  L.out_stride_t = out.stride(0);
  L.out_stride_h = out.stride(1);

  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == q.size(0), "query_start_loc must span all tokens");
  // NOTE: a decode takes all its KV heads in one item (whole block rows, in order) when there are
  // enough sequences to keep every thread busy; otherwise one head each. Prefill rows go W a tile.
  const bool whole_rows = num_seqs >= 2 * at::get_num_threads() && L.num_heads <= MAX_TILE_ROWS;
  std::vector<WorkItem> items;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t nq = starts[s + 1] - starts[s];
    TORCH_CHECK(nq >= 1 && nq <= lens[s], "each sequence needs 1..seq_len new tokens");
    TORCH_CHECK((lens[s] + L.block_size - 1) / L.block_size <= block_tables.size(1), "block table too short");
    if (nq == 1) {
      const int32_t per_item = whole_rows ? int32_t(L.num_kv_heads) : 1;
      const int64_t keys = lens[s] - var.first_key(lens[s] - 1);
      for (int32_t h = 0; h < L.num_kv_heads; h += per_item) {
        items.push_back({s, h, per_item, 0, group, keys * per_item * group});
      }
      continue;
    }
    const int32_t num_rows = nq * group;
    for (int32_t r0 = 0; r0 < num_rows; r0 += W) {
      const int32_t n = std::min<int32_t>(W, num_rows - r0);
      const int64_t last = lens[s] - nq + (r0 + n - 1) / group;  // the tile's last row's position
      const int64_t keys = last + 1 - var.first_key(lens[s] - nq + r0 / group);  // keys the tile reads
      for (int32_t h = 0; h < L.num_kv_heads; ++h) items.push_back({s, h, 1, r0, n, keys * W});
    }
  }
  // NOTE: costliest first, handed out dynamically, so no long tile is left to run alone at the end
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  if (q.scalar_type() == at::kBFloat16) {
    run_storage<c10::BFloat16>(q, k, v, k_cache, v_cache, slot_mapping, out, items, tables, num_seqs, lens, starts, L,
                               float(scale), float(k_scale), float(v_scale), var);
  } else {
    run_storage<float>(q, k, v, k_cache, v_cache, slot_mapping, out, items, tables, num_seqs, lens, starts, L, float(scale),
                       float(k_scale), float(v_scale), var);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
}
