"""LoRA beyond the tiny Llama: Gemma 2 (soft-caps, sliding window, post-norms), Phi-3 (fused qkv_proj and
gate_up_proj in the checkpoint, so PEFT targets them whole), GPT-2 (Conv1D: fan_in_fan_out, a non-gated
MLP) on the step serving chooses for them, and the shipped Q4_1 default model through the engine. PEFT
(fp32) on the weights the step computes with is the oracle."""
from __future__ import annotations

import pytest
import torch

from kvcache.storage import KVCacheSpec, PagedKVCache
from models import load_tokenizer
from models.gguf_file import read_gguf
from models.loader import load_for_serving
from models.registry import default_gguf_path
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.compilation import compiled_graphs
from server.engine.lora_manager import adapter_ref
from server.engine.model_runner import ModelRunner
from server.engine.request import Request
from tests.lora_helpers import ATTENTION, MLP, make_adapter, peft_model
from tests.reference import assert_greedy_close, load_hf
from tests.test_lora_model import PROMPTS, oracle_logits, schedule, slots_of
from tests.tiny import WINDOW

BLOCK = 4
# arch -> two adapters (name -> PEFT LoraConfig keys) with different ranks, targets and scalings
VARIANTS = {
    "gemma2": {"all8": {"r": 8, "lora_alpha": 16, "target_modules": [*ATTENTION, *MLP]},
               "qvd4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                        "use_rslora": True}},
    # the checkpoint's fused linears: one PEFT module each, every piece of our fused output at once
    "phi3": {"fused8": {"r": 8, "lora_alpha": 16, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]},
             "qkv4": {"r": 4, "lora_alpha": 4, "target_modules": ["qkv_proj", "down_proj"],
                      "rank_pattern": {"down_proj": 2}}},
    # Conv1D: c_attn is q|k|v, "c_proj" names both attn.c_proj (o) and mlp.c_proj (down), c_fc is up
    "gpt2": {"all8": {"r": 8, "lora_alpha": 16, "target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True,
                      "rank_pattern": {"attn.c_proj": 2}},
             "mlp4": {"r": 4, "lora_alpha": 8, "target_modules": ["c_fc", "mlp.c_proj"], "fan_in_fan_out": True}},
}


@pytest.fixture(scope="module")
def variant_adapters(tiny_checkpoints, variant_checkpoints, tmp_path_factory):
    """arch -> (its HF checkpoint, name -> its PEFT adapter directory)."""
    root = tmp_path_factory.mktemp("lora-variants")
    out = {}
    for arch, adapters in VARIANTS.items():
        path = tiny_checkpoints[arch] if arch == "gpt2" else variant_checkpoints[arch]
        out[arch] = (path, {name: make_adapter(path, root / f"{arch}-{name}", seed=i, **cfg)
                            for i, (name, cfg) in enumerate(adapters.items())})
    return out


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_compiled_steps_mix_two_adapters_and_base_rows(arch, variant_adapters):
    """ModelRunner over the paged pool on the compiled step (what serving chooses for these fp32 models):
    a prefill of base rows and both adapters' rows, then two decodes reading back the K/V each adapter
    wrote. Every row's logits are its own PEFT model's (or the base's), and the greedy token with them."""
    path, adapters = variant_adapters[arch]
    model, tok = load_for_serving(path, dtype="float32", quantization="auto"), load_tokenizer(path)
    cfg = model.config
    slots = slots_of(model, adapters)
    cache = PagedKVCache(KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, BLOCK), 96)
    runner = ModelRunner(model, cache, lora_slots=slots)
    assert runner.step == "compiled"
    graphs = compiled_graphs()

    names = [None, *adapters, None]
    # the first adapter's prompt fills Gemma 2's sliding window (24 tokens); its decodes run past it
    long = tok(" ".join(PROMPTS))["input_ids"][:WINDOW]
    assert len(long) == WINDOW
    prompts = [tok(PROMPTS[0])["input_ids"], long, *(tok(p)["input_ids"] for p in PROMPTS[1:3])]
    reqs = []
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0), None)
        req.lora_slot = None if name is None else list(adapters).index(name)
        reqs.append(req)
    sizes = [-(-(r.num_tokens + 3) // BLOCK) for r in reqs]
    tables = [list(range(sum(sizes[:i]), sum(sizes[:i + 1]))) for i in range(len(reqs))]
    base = load_hf(path)
    models = [base if n is None else peft_model(path, adapters[n]) for n in names]
    computed = [0] * len(reqs)
    for _ in range(3):  # the prefill, then two decodes
        batch = runner.prepare(schedule(reqs, computed, tables))
        assert batch.lora is not None and batch.lora.seg_slot.tolist() == [0, 1]
        logits = runner.submit(batch).logits.float()  # (R, V): each request's last row
        expected = oracle_logits(models, [r.all_token_ids for r in reqs])
        expected = expected[torch.tensor([r.num_tokens for r in reqs]).cumsum(0) - 1]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()
        for i, row in enumerate(logits.argmax(-1).tolist()):
            computed[i] = reqs[i].num_tokens
            reqs[i].all_token_ids.append(row)
    # the adapters moved their rows: the base model's logits on the same tokens are elsewhere
    plain = oracle_logits([base] * 2, [reqs[i].all_token_ids for i in (1, 2)])
    ends = torch.tensor([reqs[i].num_tokens for i in (1, 2)]).cumsum(0) - 1
    assert ((plain[ends] - expected[1:3]).abs().amax(-1) > 0.1).all()
    assert compiled_graphs() == graphs  # warm-up compiled both graphs (with and without the deltas)


# ---- the shipped default model: Q4_1 GGUF, served quantized ------------------------------------------
DEFAULT_PROMPTS = ["Name three colors.", "Write a haiku about the sea."]  # prompts whose answer this adapter changes
DEFAULT_TOKENS = 12


@pytest.fixture(scope="module")
def default_adapter(default_model_dir, tmp_path_factory):
    """Rank 8 on all seven modules of the default model, B small: it moves tokens, the model stays sane."""
    return make_adapter(default_model_dir, tmp_path_factory.mktemp("lora-default") / "all8", seed=5, b_std=0.1,
                        r=8, lora_alpha=16, target_modules=[*ATTENTION, *MLP])


@torch.no_grad()
def forced_greedy(hf, prompt: list[int], ours: list[int], top: int = 5) -> tuple[list[int], list[dict[int, float]]]:
    """HF's greedy pick and its `top` logprobs after each prefix of `ours`, in one forward: up to the first
    token where the two differ this is HF's own greedy run, all that assert_greedy_close reads."""
    logprobs = hf(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:].float().log_softmax(-1)
    values, ids = logprobs.topk(top)  # (len(ours), top)
    return logprobs.argmax(-1).tolist(), [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def test_default_q4_1_model_serves_an_adapter_beside_the_base(default_model_dir, default_adapter):
    """The engine as served (`--quantization auto`: Q4_1 codes, the native decoder) with the adapter's and
    base rows in one batch: the adapter's greedy tokens are PEFT's on the GGUF's dequantized weights (fp32)
    up to a near-tie, the base rows HF's, and the two differ."""
    from peft import PeftModel  # noqa: PLC0415 - the oracle's dependency, imported where used as tests/lora_helpers.py does

    engine = LLMEngine(EngineConfig(model="default", quantization="auto", max_loras=2, kv_cache_memory="64MiB"))
    assert "Q4_1" in engine.model.quantization.split("+") and engine.runner.step == "native"
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for p in DEFAULT_PROMPTS]
    ref = adapter_ref("all8", str(default_adapter))
    params = SamplingParams(max_tokens=DEFAULT_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    results = [g[0] for g in engine.generate(prompts * 2, params, lora=[ref] * len(prompts) + [None] * len(prompts))]
    assert engine.kv.num_used_blocks == 0 and engine.stats().resident_loras == ("all8",)

    # HF's Llama on the GGUF's weights dequantized to fp32 by our reader (the same logits as transformers' own
    # GGUF loader, which takes twice as long; tests/test_default_model.py compares the two)
    hf = load_hf(default_model_dir)
    keys = hf.load_state_dict(read_gguf(default_gguf_path()).tensors, strict=False)
    assert keys.missing_keys == ["lm_head.weight"] and not keys.unexpected_keys  # tied to embed_tokens
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    tuned, base = results[:len(prompts)], results[len(prompts):]
    for prompt, out in zip(prompts, base):
        assert_greedy_close(list(out.token_ids), [dict(lp.top) for lp in out.logprobs],
                            *forced_greedy(hf, prompt, list(out.token_ids)), f"base row of {len(prompt)} tokens")
    peft = PeftModel.from_pretrained(hf, str(default_adapter)).eval()  # NOTE: wraps `hf` in place: base rows first
    for prompt, out, plain in zip(prompts, tuned, base):
        assert_greedy_close(list(out.token_ids), [dict(lp.top) for lp in out.logprobs],
                            *forced_greedy(peft, prompt, list(out.token_ids)), f"adapter row of {len(prompt)} tokens")
        assert out.token_ids != plain.token_ids  # the adapter changed the answer
