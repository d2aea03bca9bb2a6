"""Quantized weights served end to end: a mixed-type GGUF (every block format models/quant_formats.py
decodes) and RTN int8 / int4 of an HF checkpoint give HF transformers' greedy tokens, when transformers runs
exactly the weights they hold (dequantized), through batching, preemption, chunked prefill and the prefix
cache, on the native (server/engine/native_decoder.py), the compiled and the eager step."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from torch import nn

from models.checkpoint import read_checkpoint
from models.loader import load_for_serving, model_from_checkpoint
from models.native.libraries import available
from models.quant_formats import quantize_rtn
from models.quant_linear import QuantEmbedding, QuantLinear
from models.tokenizer import load_tokenizer
from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.gguf_blocks import quantize_blocks
from tests.reference import assert_greedy_close, load_hf, memoised_greedy
from tests.tiny import CORPUS, mixed_prompts
from tests.tiny_gguf import MIXED, TOKENIZER_FILES, make_tiny_llama_256, reference_dir, write_tiny_gguf

pytestmark = pytest.mark.isa  # make test-isa runs this file again under the AVX2 cap

NUM_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
# fp32 on both sides, the same weights: only the order of the sums differs (logits ~1e-5 apart here)
FP32_LOGPROB_TOL = 1e-3


# ---- quantize_blocks ---------------------------------------------------------------------------
# rms(dequantized - w) / rms(w) for gaussian weights: round to nearest over a block's range
REL_RMS = {T.Q8_0: 0.008, T.Q6_K: 0.03, T.Q5_0: 0.05, T.Q5_1: 0.05, T.Q5_K: 0.05,
           T.Q4_0: 0.1, T.Q4_1: 0.1, T.Q4_K: 0.1}
STEPS = {T.Q8_0: 254, T.Q6_K: 62, T.Q4_0: 16, T.Q5_0: 32, T.Q4_1: 15, T.Q4_K: 15, T.Q5_1: 31, T.Q5_K: 31}


@pytest.mark.parametrize("t", sorted(REL_RMS, key=lambda t: t.name), ids=lambda t: t.name)
def test_quantize_blocks_is_sane(t):
    rng = np.random.default_rng(t.value)
    n, k = 24, 512
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[1] = 0  # all zero
    w[2] = 0.0123  # constant
    w[3] *= np.float32(100)  # big weights
    w[4] *= np.float32(1e-3)  # small ones
    w[5, :256] = np.abs(w[5, :256])  # one sign only (the K-quants' min is then 0)
    w[6, :256] = -np.abs(w[6, :256])
    w[7] += 0.2  # an offset
    raw = quantize_blocks(w, t)
    block, type_size = GGML_QUANT_SIZES[t]
    assert raw.dtype == np.uint8 and raw.shape == (n, k // block * type_size)
    deq = np.asarray(gguf.quants.dequantize(raw, t), dtype=np.float32).reshape(n, k)
    assert np.isfinite(deq).all()
    assert (deq[1] == 0).all()
    # a constant comes back, to the rounding of fp16 scales (K-quants': d = scale / 63 is an fp16 subnormal here)
    assert np.abs(deq[2] - w[2]).max() <= 5e-3 * 0.0123
    for i in range(n):
        rel = np.sqrt(np.mean((deq[i] - w[i]) ** 2) / np.mean(w[i] ** 2)) if i != 1 else 0.0
        assert rel <= REL_RMS[t], f"row {i}: relative rms error {rel:.4f} > {REL_RMS[t]}"
    # round to nearest: every element within half a (sub-)block step of its weight (+ scale rounding), where
    # step = span / STEPS; Q4_0 / Q5_0 map the signed max to code 0 as ggml does, so the other end may clip
    # by up to one step
    group = 16 if t == T.Q6_K else 32
    span = np.abs(w).reshape(n, -1, group).max(axis=-1, keepdims=True) * 2  # (N, K/g, 1): >= the range
    bound = span / STEPS[t] * (1.001 if t in (T.Q4_0, T.Q5_0) else 0.55)
    assert (np.abs(deq - w).reshape(n, -1, group) <= bound + 1e-9).all()
    # where gguf has its own quantizer (ggml's reference RTN for the legacy types): no worse than it
    try:
        theirs = np.asarray(gguf.quants.dequantize(gguf.quants.quantize(w, t), t)).reshape(n, k)
    except NotImplementedError:
        return
    ours_err, their_err = np.sqrt(np.mean((deq - w) ** 2)), np.sqrt(np.mean((theirs - w) ** 2))
    assert ours_err <= their_err * 1.02, (ours_err, their_err)


def test_quantize_blocks_rejects_bad_shapes():
    with pytest.raises(ValueError, match="k % 256"):
        quantize_blocks(np.zeros((2, 288), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="2-D"):
        quantize_blocks(np.zeros(64, np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="fp16"):
        quantize_blocks(np.full((1, 32), 1e9, np.float32), T.Q8_0)


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    """A directory holding model.gguf (MIXED types) and the tokenizer; reference_dir() beside it."""
    root = tmp_path_factory.mktemp("quantized")
    hf = make_tiny_llama_256(root / "hf")
    write_tiny_gguf(root / "mixed", hf, MIXED)
    return root / "mixed"


_LAYER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight")


def rtn_reference(src: Path, scheme: str, out: Path) -> Path:
    """`src` (an HF checkpoint) with each decoder-layer linear weight replaced by its `scheme` RTN
    quantization dequantized: what serving `src` with quantization=`scheme` computes with."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    replaced = [name for name in tensors if _LAYER_LINEAR.fullmatch(name)]
    num_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert len(replaced) == 7 * num_layers
    for name in replaced:
        tensors[name] = quantize_rtn(tensors[name].float(), scheme).dequantize().contiguous()
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def sources(mixed_gguf, tiny_checkpoints, tmp_path_factory):
    """name -> (what the engine loads, its quantization, the HF checkpoint of the weights it computes with)."""
    root = tmp_path_factory.mktemp("rtn")
    llama = tiny_checkpoints["llama"]  # hidden 64: int4 groups of 32
    cache: dict[str, tuple[Path, str, Path]] = {}

    def get(name: str) -> tuple[Path, str, Path]:
        if name not in cache:
            if name == "gguf":
                cache[name] = (mixed_gguf, "auto", reference_dir(mixed_gguf))
            else:
                scheme = name.removeprefix("llama-")
                cache[name] = (llama, scheme, rtn_reference(llama, scheme, root / scheme))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def oracle(sources):
    """(source, dtype) -> memoised HF greedy continuation and top logprobs, on the reference weights."""
    cache = {}

    def get(name: str, dtype: str):
        if (name, dtype) not in cache:
            cache[(name, dtype)] = memoised_greedy(load_hf(sources(name)[2], dtype=getattr(torch, dtype)), NUM_TOKENS)
        return cache[(name, dtype)]
    return get


# ---- the mixed GGUF, as loaded ----------------------------------------------------------------------
EXPECTED_KINDS = {  # module -> kind: fused projections concatenate their parts' formats
    "layers.0.attn.qkv_proj": "Q4_K+Q6_K+Q8_0", "layers.0.attn.o_proj": "Q4_0",
    "layers.0.mlp.gate_up_proj": "Q4_1+Q5_K", "layers.0.mlp.down_proj": "Q5_0",
    "layers.1.attn.qkv_proj": "Q4_K+Q6_K+Q8_0", "layers.1.attn.o_proj": "Q5_1",
    "layers.1.mlp.gate_up_proj": "Q4_1+Q5_K", "layers.1.mlp.down_proj": "Q5_0",
    "lm_head": "Q6_K", "embed": "Q8_0",
}


def test_mixed_gguf_loads_quantized_and_answers(mixed_gguf):
    assert not (mixed_gguf / "config.json").exists()  # the directory reads as its single .gguf
    assert available("quant_linear")
    model = load_for_serving(mixed_gguf, dtype="float32", quantization="auto", activations="exact")
    formats = {t.name for t in MIXED.values()}
    assert len(formats) == 8 and set(model.quantization.split("+")) == formats
    assert model.cpu_path.quantization == model.quantization
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert {name: m.kind for name, m in quantized.items()} == EXPECTED_KINDS
    assert isinstance(model.embed, QuantEmbedding)
    assert all(m.mode == "packed" for m in quantized.values() if isinstance(m, QuantLinear))  # the C++ kernel
    assert not [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]  # nothing left dense

    # the bytes: codes + group scales, against the same weights in fp32 (untied: embed and lm_head both count)
    ref = read_checkpoint(reference_dir(mixed_gguf))
    fp32_bytes = sum(4 * t.numel() for t in ref.tensors.values())
    assert model.weight_bytes() < fp32_bytes / 2.5, (model.weight_bytes(), fp32_bytes)

    # the same file through model_from_checkpoint: kept quantized, and dequantized up front; same logits
    kept = model_from_checkpoint(read_checkpoint(mixed_gguf, keep_quantized=True), torch.float32)
    dense = model_from_checkpoint(read_checkpoint(mixed_gguf), torch.float32)
    assert kept.quantization == model.quantization and dense.quantization == "none"
    ids = torch.tensor(load_tokenizer(mixed_gguf)(CORPUS)["input_ids"][:48])
    with torch.no_grad():
        logits = [m.compute_logits(m(ids, torch.arange(len(ids)))) for m in (model, kept, dense)]
    assert torch.allclose(logits[0], logits[1], atol=1e-4) and torch.allclose(logits[0], logits[2], atol=1e-4)

    engine = LLMEngine(EngineConfig(model=str(mixed_gguf), quantization="auto", dtype="float32", num_blocks=64,
                                    block_size=4, enforce_eager=True, activations="exact"))
    assert engine.info.quantization == model.quantization and engine.weight_bytes == model.weight_bytes()
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0][0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.text and out.text == tok.decode(list(out.token_ids), skip_special_tokens=True)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_quantization_names_each_format_once(mixed_gguf):
    model = model_from_checkpoint(read_checkpoint(mixed_gguf, keep_quantized=True), torch.float32)
    assert model.quantization == "+".join(sorted(t.name for t in set(MIXED.values())))


# ---- greedy parity -------------------------------------------------------------------------------
def run_and_check(engine, prompts, expected):
    """HF's tokens up to a first difference that is a near-tie; in fp32 that tie is within rounding, and
    every logprob before it equals HF's to rounding."""
    fp32 = engine.config.dtype == "float32"
    results = engine.generate(prompts, GREEDY)
    for prompt, group in zip(prompts, results):
        what = f"prompt of {len(prompt)} tokens"
        theirs, their_tops = expected(prompt)
        ours = list(group[0].token_ids)
        our_tops = [dict(lp.top) for lp in group[0].logprobs]
        assert len(ours) == NUM_TOKENS and group[0].finish_reason == "length"
        assert_greedy_close(ours, our_tops, theirs, their_tops, what)
        if fp32:
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), NUM_TOKENS)
            for i in range(same):
                assert abs(our_tops[i][ours[i]] - their_tops[i][ours[i]]) <= FP32_LOGPROB_TOL, (what, i)
            if same < NUM_TOKENS:  # a tie in fp32: within what summation order moves
                a, b = ours[same], theirs[same]
                assert abs(their_tops[same][a] - their_tops[same][b]) <= FP32_LOGPROB_TOL, (what, same)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # every block back after every request
    assert not engine.scheduler.running and not engine.scheduler.waiting


CASES = [("gguf", "native", "float32"), ("gguf", "compiled", "float32"), ("gguf", "eager", "float32"),
         ("gguf", "native", "bfloat16"), ("gguf", "compiled", "bfloat16"), ("gguf", "eager", "bfloat16"),
         ("llama-int8", "native", "float32"), ("llama-int8", "eager", "float32"),
         ("llama-int4", "native", "float32"), ("llama-int4", "eager", "float32")]


def parity_engine(path: Path, quantization: str, dtype: str, step: str, activations: str, **kw) -> LLMEngine:
    """A pool too small for 10 requests and a token budget below the prompts, unless `kw` says otherwise."""
    kw = {"num_blocks": 48, "max_num_batched_tokens": 24, **kw}
    return LLMEngine(EngineConfig(
        model=str(path), quantization=quantization, dtype=dtype, block_size=4, max_num_seqs=10,
        enforce_eager=step == "eager", native_decoder=step == "native", activations=activations, **kw))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_activations_give_each_request_the_tokens_it_gets_alone(dtype, sources):
    """8-bit activations (--activations int8) on the mixed GGUF: batching, preemption, chunked prefill
    and prefix hits leave every greedy token as the request gets it alone in an ample pool."""
    path, _, _ = sources("gguf")
    engine = parity_engine(path, "auto", dtype, "native", "int8")
    assert engine.cpu_path.activations.startswith("int8-") and "+exact" not in engine.cpu_path.activations
    tok = engine.tokenizer
    prompts = [tok(CORPUS)["input_ids"][:30] + t for t in mixed_prompts(tok, 10, seed=6, min_len=5, max_len=60)]
    batched = [list(g[0].token_ids) for g in engine.generate(prompts, GREEDY)]
    s = engine.scheduler
    assert s.num_preemptions > 0 and s.num_partial_prefills > 0 and s.num_prefix_hits > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    alone = parity_engine(path, "auto", dtype, "native", "int8", num_blocks=256, max_num_batched_tokens=512,
                          enable_prefix_caching=False)
    assert [[list(alone.generate([p], GREEDY)[0][0].token_ids)] for p in prompts] == [[b] for b in batched]


@pytest.mark.parametrize("source, step, dtype", CASES, ids=["-".join(c) for c in CASES])
def test_greedy_parity(source, step, dtype, sources, oracle):
    """One engine per case, loading the checkpoint itself: 10 requests at once sharing a 30-token prefix,
    a pool too small for them (preemption), a token budget below the prompts (chunked prefill); then
    one prompt twice (prefix-cache hits on all but its last block). Exact activations: HF's arithmetic."""
    path, quantization, _ = sources(source)
    expected = oracle(source, dtype)
    engine = parity_engine(path, quantization, dtype, step, "exact")
    assert engine.model.quantization != "none" and engine.info.quantization == engine.model.quantization
    if quantization != "auto":
        assert engine.model.quantization == quantize_rtn(torch.zeros(1, 64), quantization).kind
    assert engine.runner.step == step and (engine.runner.forward is engine.model) == (step == "eager")
    tok = engine.tokenizer

    system = tok(CORPUS)["input_ids"][:30]
    prompts = [system + t for t in mixed_prompts(tok, 10, seed=6, min_len=5, max_len=60)]
    run_and_check(engine, prompts, expected)
    s = engine.scheduler
    assert s.num_preemptions > 0 and s.num_partial_prefills > 0 and s.num_prefix_hits > 0
    assert engine.num_steps < 10 * NUM_TOKENS / 2  # they ran together

    prompt = tok(CORPUS)["input_ids"][40:80]  # exactly 10 blocks of 4
    run_and_check(engine, [prompt], expected)
    before = s.num_prefix_hits
    run_and_check(engine, [prompt], expected)
    assert s.num_prefix_hits - before == 36  # the last block is recomputed for its logits
