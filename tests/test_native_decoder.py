"""server/engine/native_decoder.py: the layer stack in one C++ call computes what the Python model's layers
compute (the same linear and attention kernels; norms, RoPE and SwiGLU rounded op by op as eager
rounds them), writes the same K/V into the pool, and covers exactly the models it says it covers."""
from __future__ import annotations

import pytest
import torch

from kvcache.paged_attention import AttentionMetadata, PagedAttention
from kvcache.storage import KVCacheSpec, PagedKVCache
from models.loader import load_for_serving, serving_dtype
from models.rope import rope_cos_sin
from server.engine.native_decoder import NativeDecoder, unsupported
from tests.tiny_gguf import MIXED, make_tiny_llama_256, write_tiny_gguf

pytestmark = [pytest.mark.kernel, pytest.mark.tiles]  # make test-isa runs this file again under the AVX2 cap, on the portable build and on emulated AMX tiles

BLOCK = 4
# two prompts prefilled together; then both decode while a third prompt's first chunk prefills
STEPS = [([7, 5], [0, 0]), ([1, 1, 3], [7, 5, 0]), ([1, 1, 1], [8, 6, 3])]
TABLES = [[0, 1, 2], [3, 4], [5]]


def run_steps(forward, model, cache: PagedKVCache, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for query_lens, context_lens in STEPS:
        ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=gen)
        positions = torch.cat([torch.arange(c, c + n) for n, c in zip(query_lens, context_lens)])
        meta = AttentionMetadata.build(query_lens, context_lens, TABLES[:len(query_lens)], BLOCK)
        with torch.inference_mode():
            outs.append(forward(ids, positions, PagedAttention(cache, meta)))  # (T, C)
    return outs


CASES = [("llama", "int4", "float32", "exact"), ("llama", "int8", "float32", "exact"),
         ("mistral", "int4", "float32", "exact"), ("qwen2", "int8", "float32", "exact"),
         ("llama", "int4", "bfloat16", "exact"), ("qwen2", "int8", "bfloat16", "exact"),
         ("llama", "int4", "float32", "int8"), ("qwen2", "int8", "bfloat16", "int8")]


@pytest.mark.parametrize("arch, scheme, dtype, activations", CASES, ids=["-".join(c) for c in CASES])
def test_native_decoder_equals_the_model(tiny_checkpoints, arch, scheme, dtype, activations):
    """GQA (llama: llama3 RoPE, tied), MQA (mistral: linear RoPE), q/k/v biases (qwen2); prefill, decode
    and both in one step; exact and int8 activations (models/csrc/q8_linear.cpp)."""
    model = load_for_serving(tiny_checkpoints[arch], dtype=dtype, quantization=scheme, activations=activations)
    assert unsupported(model) is None
    assert (model.cpu_path.activations == "exact") == (activations == "exact"), model.cpu_path
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HF initialises norm weights to ones, which would hide where a product is rounded
        for layer in model.layers:
            for norm in (layer.attn_norm, layer.mlp_norm):
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, BLOCK)
    ours_cache, their_cache = PagedKVCache(spec, 8), PagedKVCache(spec, 8)
    ours = run_steps(NativeDecoder(model), model, ours_cache, seed=1)
    theirs = run_steps(model, model, their_cache, seed=1)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype == model.dtype
        if dtype == "float32" and activations == "int8":
            # NOTE: a last-bit difference in a sum's order can flip an input's rounding to int8, which
            # moves the outputs it feeds by one int8 step (1/127 of its block's largest value) times w:
            # most values stay equal, none moves far (a wrong kernel moves them all)
            assert torch.isclose(a, b, atol=1e-4, rtol=1e-4).float().mean() >= 0.8
            torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)
        elif dtype == "float32":  # the same sums, some in another order
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        else:  # rounded where eager rounds, summed in double as eager's RMSNorm: (nearly) every bit the same
            assert (a == b).float().mean() > 0.99, (a == b).float().mean()
    for layer in range(cfg.num_layers):  # the same K/V written to the same slots
        for mine, theirs_ in ((ours_cache.k[layer], their_cache.k[layer]), (ours_cache.v[layer], their_cache.v[layer])):
            tol = 0.02 if dtype == "bfloat16" else 1e-4 if activations == "exact" else 0.05
            torch.testing.assert_close(mine.float(), theirs_.float(), atol=tol, rtol=tol)
            assert mine[:6].abs().sum() > 0  # the blocks the steps used were written


def test_a_fused_matrix_of_mixed_gguf_types_runs_in_its_parts(tmp_path):
    """MIXED's q/k/v (Q4_K, Q6_K, Q8_0) and gate/up (Q4_1, Q5_K): on the int8 kernel each run of one type keeps its
    own form (QuantLinear.parts), and the C++ stack calls each part and joins their outputs as the model does."""
    hf = make_tiny_llama_256(tmp_path / "hf")
    write_tiny_gguf(tmp_path / "mixed", hf, MIXED)
    model = load_for_serving(tmp_path / "mixed", dtype="float32", quantization="auto", activations="int8")
    qkv, gate_up = model.layers[0].attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    assert [p.kind for p in qkv.parts] == ["Q4_K", "Q6_K", "Q8_0"] and [p.kind for p in gate_up.parts] == ["Q4_1", "Q5_K"]
    assert qkv.parts[0].scales.dtype == torch.uint8 and qkv.parts[1].bits == 6  # records; six-bit codes
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, BLOCK)
    ours = run_steps(NativeDecoder(model), model, PagedKVCache(spec, 8), seed=2)
    theirs = run_steps(model, model, PagedKVCache(spec, 8), seed=2)
    for a, b in zip(ours, theirs):  # as the int8 cases above: a last-bit difference can flip an int8 rounding
        assert torch.isclose(a, b, atol=1e-4, rtol=1e-4).float().mean() >= 0.8
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_rows_come_from_tables_with_the_values_of_the_step_s_own_call(tiny_checkpoints, dtype):
    """The decoder's RoPE rows are rows of tables it grows as positions come (past their first 1,024): the same
    bits as rope_cos_sin on the step's positions, decode, prefill and a jump past the table alike."""
    model = load_for_serving(tiny_checkpoints["llama"], dtype=dtype, quantization="int4")
    decoder = NativeDecoder(model)
    for positions in (torch.tensor([5]), torch.arange(0, 37), torch.tensor([1023, 3, 900]), torch.arange(1000, 1100),
                      torch.tensor([5000]), torch.arange(17, 30)):
        cos, sin = decoder._rope(positions, int(positions.max()) + 1, model.dtype)
        want_cos, want_sin = rope_cos_sin(positions, model.inv_freq, model.dtype)  # (T, 1, D)
        assert torch.equal(cos, want_cos[:, 0]) and torch.equal(sin, want_sin[:, 0]), positions
    assert len(decoder.rope_tables[0]) == 5001  # grown to the largest position asked for, not beyond


def test_models_it_does_not_cover_say_why(tiny_checkpoints):
    gpt2 = load_for_serving(tiny_checkpoints["gpt2"], dtype="float32", quantization="int8")
    assert unsupported(gpt2) == "layers other than RMSNorm + RoPE + SwiGLU"
    dense = load_for_serving(tiny_checkpoints["llama"], dtype="float32", quantization="none")
    assert unsupported(dense) == "layer linears that are not packed quantized"
    with pytest.raises(ValueError, match="not packed quantized"):
        NativeDecoder(dense)


def test_a_step_with_the_wrong_pool_is_an_error(tiny_checkpoints):
    model = load_for_serving(tiny_checkpoints["llama"], dtype="float32", quantization="int8")
    cfg = model.config
    short = PagedKVCache(KVCacheSpec(cfg.num_layers - 1, cfg.num_kv_heads, cfg.head_dim, model.dtype, BLOCK), 8)
    with pytest.raises(RuntimeError, match="one cache and scale per layer"):
        run_steps(NativeDecoder(model), model, short, seed=0)


def test_the_default_model_in_its_serving_dtype_is_eager(default_model_dir):
    """30 layers, in the dtype `auto` serves here. bf16 (AVX512-BF16): a rounding that differed from
    eager's in one element in a thousand (RMSNorm summed in fp32 where ATen sums in double) left 18%
    of the final hidden values equal to eager's, and an 8-bit KV cache amplified that into another
    answer; now they are eager's. fp32 (AVX2 and below): eager's to the order of the sums, with exact
    activations: there a last-bit difference in a sum's order can flip an input's rounding to int8 (one
    step of 1/127 of its block's largest value), which 30 layers carry to ~0.5 (the tiny cases above
    check int8 activations in fp32)."""
    fp32 = serving_dtype(default_model_dir) == "float32"
    model = load_for_serving(default_model_dir, dtype="auto", quantization="auto",
                             activations="exact" if fp32 else "auto")
    assert unsupported(model) is None
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, BLOCK)
    ours = run_steps(NativeDecoder(model), model, PagedKVCache(spec, 8), seed=2)
    theirs = run_steps(model, model, PagedKVCache(spec, 8), seed=2)
    for a, b in zip(ours, theirs):
        if model.dtype == torch.bfloat16:
            assert (a == b).float().mean() > 0.99, (a == b).float().mean()
        else:
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
