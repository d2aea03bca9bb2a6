"""The 8-bit KV cache: exact widening in the kernel, attention over the stored (rounded) K/V against
the written-out formula, pool sizing, calibration, the engine's invariants, and greedy agreement
with a bf16 cache on the default model."""
import copy
import json
import math

import pytest
import torch

from kvcache import ops
from kvcache.paged_attention import AttentionMetadata, PagedAttention
from kvcache.quant import HEADROOM, KVScales, calibrate, calibration_ids, dequantize, power_of_two_scale, quantize
from kvcache.storage import KVCacheSpec, PagedKVCache
from models.attention import DenseAttention, reference_attention
from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.reference import first_divergences

pytestmark = [pytest.mark.kernel, pytest.mark.tiles]  # make test-isa runs this file again under the AVX2 cap, on the portable build and on emulated AMX tiles

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def codes(dtype: torch.dtype) -> torch.Tensor:
    """Every value a pool can hold: the format's finite normals and zero (writes flush subnormals)."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return x[torch.isfinite(x) & ((x == 0) | (x.abs() >= torch.finfo(dtype).tiny))]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("head_dim", [64, 8])  # whole vectors; the scalar tail only
def test_kernel_stores_and_widens_every_value_exactly(dtype, head_dim):
    """One-token sequences, so each output row is its own V as stored and read back: every
    representable value (times the scale) survives both ways bit for bit, and a value below the
    smallest normal is flushed to zero, as `quantize` does."""
    scale = 2.0 ** -3
    vals = torch.cat([codes(dtype), torch.tensor([torch.finfo(dtype).tiny / 2, -torch.finfo(dtype).tiny / 3])])
    n = -(-vals.numel() // head_dim)
    v = torch.zeros(n * head_dim)
    v[:vals.numel()] = vals * scale
    v = v.view(n, 1, head_dim)  # n sequences of one token, 1 KV head
    cache = PagedKVCache(KVCacheSpec(1, 1, head_dim, dtype, 16), n, scales=KVScales((1.0,), (scale,)))
    meta = AttentionMetadata.build([1] * n, [0] * n, [[i] for i in range(n)], 16)
    q = torch.randn(n, 2, head_dim)
    out = PagedAttention(cache, meta)(0, q, torch.zeros_like(v), v)
    expected = dequantize(quantize(v, scale, dtype), scale, torch.float32)
    assert torch.equal(out, expected.expand(n, 2, head_dim))
    flat = out[:, 0].flatten()[:vals.numel()]
    assert torch.equal(flat[:-2], vals[:-2] * scale) and flat[-2:].tolist() == [0.0, 0.0]
    stored = cache.v[0][:, 0].view(torch.uint8).flatten()  # slot 0 of each sequence's block
    assert torch.equal(stored, quantize(v, scale, dtype).view(torch.uint8).flatten())  # the Python rounding


def fp8_step(seq_lens, new_lens, heads, kv_heads, head_dim, block_size, dtype, q_dtype=torch.float32, seed=0):
    """A pool holding each sequence's earlier K/V in 8 bits; one step through PagedAttention.
    Returns (output, expected, cache, inputs): expected is the formula over the K/V as stored."""
    g = torch.Generator().manual_seed(seed)
    scales = KVScales((2.0 ** -4,), (2.0 ** -6,))
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    cache = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, dtype, block_size), num_blocks, scales=scales)
    free = iter(torch.randperm(num_blocks, generator=g).tolist())
    tables = [[next(free) for _ in range(-(-n // block_size))] for n in seq_lens]
    qs = [torch.randn(n, heads, head_dim, generator=g).to(q_dtype) for n in seq_lens]
    ks = [(torch.randn(n, kv_heads, head_dim, generator=g) * 3).to(q_dtype) for n in seq_lens]
    vs = [(torch.randn(n, kv_heads, head_dim, generator=g) / 4).to(q_dtype) for n in seq_lens]
    for t, k, v, total, new in zip(tables, ks, vs, seq_lens, new_lens):
        for pos in range(total - new):
            cache.k[0][t[pos // block_size], pos % block_size] = quantize(k[pos], scales.k[0], dtype)
            cache.v[0][t[pos // block_size], pos % block_size] = quantize(v[pos], scales.v[0], dtype)
    meta = AttentionMetadata.build(new_lens, [f - n for f, n in zip(seq_lens, new_lens)], tables, block_size)
    q, k, v = (torch.cat([x[-n:] for x, n in zip(xs, new_lens)]) for xs in (qs, ks, vs))
    before = copy.deepcopy(cache)
    out = PagedAttention(cache, meta)(0, q, k, v)
    expected = []
    for qq, kk, vv, n in zip(qs, ks, vs, new_lens):
        kd = dequantize(quantize(kk, scales.k[0], dtype), scales.k[0], torch.float64)  # what the pool holds
        vd = dequantize(quantize(vv, scales.v[0], dtype), scales.v[0], torch.float64)
        o, _ = reference_attention(qq.double().transpose(0, 1), kd.transpose(0, 1), vd.transpose(0, 1))
        expected.append(o.transpose(0, 1)[-n:])
    return out, torch.cat(expected), (before, meta, q, k, v, cache)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 24), (4, 4, 80)])
def test_step_matches_the_formula_over_the_stored_kv(dtype, heads, kv_heads, head_dim):
    """Decodes, a chunk over cached tokens and fresh prompts, across block edges: the op equals the
    reference attention over the rounded K/V (scales folded in exactly)."""
    lens, new = [50, 17, 64, 9, 1, 33], [1, 17, 30, 1, 1, 1]
    out, expected, _ = fp8_step(lens, new, heads, kv_heads, head_dim, 16, dtype, seed=head_dim)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", FP8)
def test_bf16_queries_over_an_8bit_pool(dtype):
    out, expected, _ = fp8_step([70, 33, 18], [1, 33, 6], 9, 3, 64, 16, dtype, q_dtype=torch.bfloat16, seed=5)
    assert out.dtype == torch.bfloat16 and (out.double() - expected).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", FP8)
def test_kernel_equals_the_sdpa_gather_path(dtype):
    """The C++ kernel against the fallback (also the CUDA path for 8-bit pools): same bytes written,
    same output."""
    out, _, (before, meta, q, k, v, cache) = fp8_step([40, 23, 8], [1, 23, 4], 8, 2, 32, 8, dtype, seed=3)
    s = before.scales
    theirs = ops.sdpa_paged_attention(q, k, v, before.k[0],
                                      before.v[0], meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                                      1 / math.sqrt(q.shape[-1]), s.k[0], s.v[0])
    assert torch.equal(before.k[0].view(torch.uint8), cache.k[0].view(torch.uint8))
    assert torch.equal(before.v[0].view(torch.uint8), cache.v[0].view(torch.uint8))
    assert (out - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("dtype,rel", [(torch.float8_e4m3fn, 2.0 ** -4), (torch.float8_e5m2, 2.0 ** -3)])
def test_quantize_rounds_to_half_an_ulp_and_saturates(dtype, rel):
    fmax = torch.finfo(dtype).max
    assert power_of_two_scale(fmax / HEADROOM, dtype) == 1.0
    assert power_of_two_scale(fmax / HEADROOM + 1, dtype) == 2.0
    x = torch.logspace(-3, 0.8, 1000) * torch.tensor([1.0, -1.0]).repeat(500)  # normal range at scale 2^-6
    scale = 2.0 ** -6
    back = dequantize(quantize(x, scale, dtype), scale, torch.float32)
    assert ((back - x).abs() / x.abs()).max() <= rel  # half of the mantissa's last place
    big = quantize(torch.tensor([1e9, -1e9, float(fmax) * 2]), 1.0, dtype).float()
    assert big.tolist() == [fmax, -fmax, fmax]  # saturated, never NaN


def test_pool_sizing_follows_the_dtype():
    """Same budget: an 8-bit pool buys 2x the blocks of bf16 and 4x those of fp32, and holds them
    in the same bytes."""
    budget = 2**30
    spec = {dt: KVCacheSpec(30, 3, 64, dt, 16) for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                                          torch.float8_e5m2)}
    assert [s.bytes_per_token for s in spec.values()] == [46080, 23040, 11520, 11520]
    blocks = {dt: s.num_blocks_for(budget) for dt, s in spec.items()}
    assert blocks[torch.float8_e4m3fn] == blocks[torch.float8_e5m2] == 5825 == budget // (16 * 11520)
    assert (blocks[torch.bfloat16], blocks[torch.float32]) == (2912, 1456)
    small = KVCacheSpec(2, 3, 8, torch.float8_e4m3fn, 16)
    cache = PagedKVCache(small, num_blocks=5)
    assert cache.nbytes == 5 * small.bytes_per_block == 5 * 16 * 2 * 2 * 3 * 8
    with pytest.raises(ValueError, match="8-bit KV cache only"):
        PagedKVCache(KVCacheSpec(1, 1, 8, torch.bfloat16), 2, scales=KVScales((0.5,), (1.0,)))


def test_calibration_gives_power_of_two_scales_with_headroom(tiny_checkpoints):
    from models import load_model, load_tokenizer

    path = tiny_checkpoints["llama"]
    model, tok = load_model(path, torch.float32), load_tokenizer(path)
    ids = calibration_ids(tok, model.config.vocab_size)
    scales = calibrate(model, ids, torch.float8_e4m3fn)
    assert scales == calibrate(model, ids, torch.float8_e4m3fn)  # fixed, whatever else runs
    fmax = torch.finfo(torch.float8_e4m3fn).max
    seen: dict[int, tuple[float, float]] = {}
    dense = DenseAttention((len(ids),))

    def record(layer, q, k, v, variant=None, sinks=None):
        seen[layer] = (k.abs().max().item(), v.abs().max().item())
        return dense(layer, q, k, v, variant, sinks)
    with torch.inference_mode():
        model(torch.tensor(ids), torch.arange(len(ids)), record)
    assert len(seen) == model.config.num_layers
    for i, (k_amax, v_amax) in seen.items():
        for amax, s in ((k_amax, scales.k[i]), (v_amax, scales.v[i])):
            assert math.log2(s).is_integer() and amax * HEADROOM <= fmax * s < 2 * amax * HEADROOM
    assert len(calibration_ids(None, 100)) == len(ids) and max(calibration_ids(None, 100)) < 100


def greedy(engine, prompts, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [list(g[0].token_ids) for g in engine.generate(prompts, params)], params


def test_engine_with_an_8bit_pool_keeps_the_serving_invariants(tiny_checkpoints):
    """Usage bytes follow the dtype exactly; batching, prefix caching and preemption leave an fp8
    greedy output unchanged; no block is held after."""
    path = str(tiny_checkpoints["llama"])
    e = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_dtype="fp8_e5m2", block_size=4,
                               kv_cache_memory=64 * 2 * 2 * 2 * 16 * 4, enforce_eager=True))
    spec = e.kv_spec
    assert spec.bytes_per_token == 2 * 2 * 2 * 16 and e.cache.num_blocks == 64  # 4x an fp32 pool of that budget
    assert e.info.kv_cache_dtype == "fp8_e5m2" and e.cache.nbytes == 64 * spec.bytes_per_block
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i, 11] for i in range(6)]
    alone = [greedy(e, [p])[0][0] for p in prompts]
    batched, params = greedy(e, prompts)
    assert batched == alone
    again = e.generate([prompts[0]], params)[0][0]  # its blocks are in the prefix cache now
    assert list(again.token_ids) == alone[0] and again.stats.num_cached_tokens > 0
    assert again.stats.peak_kv_bytes == again.stats.peak_blocks * spec.bytes_per_block
    assert again.stats.peak_blocks == -(-(len(prompts[0]) + 12 - 1) // 4)
    tight = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_dtype="fp8_e5m2", block_size=4,
                                   num_blocks=12, enforce_eager=True, enable_prefix_caching=False))
    squeezed, _ = greedy(tight, prompts)
    assert squeezed == alone and tight.scheduler.num_preemptions > 0
    assert e.kv.num_used_blocks == 0 and tight.kv.num_used_blocks == 0


CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash table is.",
                "Give me three tips for better sleep.", "What is 17 times 23?", "Who wrote Romeo and Juliet?",
                "Translate 'good morning' into Spanish.", "Describe a cat in two sentences."]
# Where an 8-bit cache's greedy answer first leaves the bf16 cache's, the two candidates must have
# been close in the bf16 run: the model's bf16 logits often tie to within one bf16 step (0.125 near
# 25), so 8-bit rounding flips near-ties, and which ones depends on the order of each matmul's sums
# (oneDNN or panel linears, each ISA's kernels). Measured 2026-12-01 over these 8 prompts x 32
# tokens, the largest gap at a first divergence in the bf16 run's logprobs: AVX512-BF16 0.62 (e4m3)
# and 0.38 (e5m2), ATTNSERVE_CPU_ISA=avx2 0.38 and 0.69. The leading tokens that agree moved between
# builds from 87 to 118 of 256 (e4m3) and from 76 to 100 (e5m2), so their sum is only bounded loosely.
# Measured again 2026-12-04 with the batch-invariant kernel (Zen 4): AVX512-BF16 0.25 and 0.25; under
# ATTNSERVE_CPU_ISA=avx2 0.44 (e4m3) and 2.38 (e5m2), the e5m2 one at the last digit of "17 * 23 = 38",
# where the bf16 run spread its weight over the digits (its pick at -1.31, e5m2's 7th at -3.69): e5m2
# keeps 2 mantissa bits to e4m3's 3, so its bounds are wider. Leading tokens that agree, of 256: 81 and
# 90 (AVX512-BF16), 108 and 61 (avx2). A broken 8-bit path diverges at once, to tokens the bf16 run gave
# no weight. Perplexity (docs/attention.md) is the quality measure.
# Measured 2026-12-06 (Zen 4) under ATTNSERVE_CPU_ISA=generic, the portable build's sums: 0.38 (e4m3) and
# 2.75 (e5m2), the e5m2 one the same flip as avx2's (the last digit of "17 * 23 = 38": the bf16 run's pick
# at -1.11, e5m2's at -3.86); the other seven prompts' first divergences 0.0-0.5. Leading tokens that
# agree, of 256: 83 (e5m2). Hence e5m2's bound of 3.0: that one digit, not the path, sets it.
FLIP_GAP = {"fp8_e4m3": 1.0, "fp8_e5m2": 3.0}  # logprob gap in the bf16 run at a first divergence
MIN_AGREEMENT = {"fp8_e4m3": 64, "fp8_e5m2": 48}  # leading tokens that agree, of 256


@pytest.mark.slow
def test_default_model_greedy_tokens_agree_with_a_bf16_cache(default_model_dir):
    from tests.test_default_model import chat_ids

    runs = {}
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=10)
    for kv in ("auto", "fp8_e4m3", "fp8_e5m2"):
        # NOTE: the bf16 weights the flip bound was measured on: this test is about the cache, and
        # its gap bound is empirical (the Q4_1 file as stored flips e5m2 at a gap of 1.25)
        e = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="bfloat16", kv_cache_dtype=kv,
                                   kv_cache_memory="64MiB", enforce_eager=True, quantization="none"))
        prompts = [chat_ids(e.tokenizer, p) for p in CHAT_PROMPTS]
        runs[kv] = [g[0] for g in e.generate(prompts, params)]
        assert e.kv.num_used_blocks == 0
    report = {}
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        leading, gaps = first_divergences(runs["auto"], runs[kv])
        report[kv] = {"leading": leading, "largest_gap": max(gaps, default=0.0)}
        assert max(gaps, default=0.0) <= FLIP_GAP[kv], report
        assert sum(leading) >= MIN_AGREEMENT[kv], report
    print(json.dumps(report))


def test_cli_generate_and_serve_take_the_kv_cache_dtype(tiny_checkpoints, capsys, tmp_path):
    from server.cli import _engine_config, build_parser, main

    for command in (["generate", "--prompt", "hi"], ["serve"]):
        args = build_parser().parse_args([*command, "--kv-cache-dtype", "fp8_e5m2"])
        assert _engine_config(args).kv_cache_dtype == "fp8_e5m2"
    assert _engine_config(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--kv-cache-dtype", "int8"])

    path = str(tiny_checkpoints["llama"])
    prompt = [5, 6, 7, 8, 9, 10, 11]
    cfg = EngineConfig(model=path, dtype="float32", kv_cache_dtype="fp8_e4m3", num_blocks=32, block_size=4,
                       enforce_eager=True)
    expected, _ = greedy(LLMEngine(cfg), [prompt])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": prompt}))
    assert main(["generate", "--model", path, "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3", "--num-blocks", "32",
                 "--block-size", "4", "--enforce-eager", "--prompt-file", str(prompts), "--max-tokens", "12",
                 "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"] == expected[0]
