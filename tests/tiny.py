"""Tiny random checkpoints in HF layout, made offline: transformers config + a BPE trained here."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = """Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules. Although practicality beats purity.
Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity, refuse the temptation to guess.
There should be one and preferably only one obvious way to do it. Now is better than never.
The capital of France is Paris. The quick brown fox jumps over the lazy dog. Attention is all you need.
Keys and values are cached in blocks of sixteen tokens; queries attend to every earlier position.
Shall I compare thee to a summer's day? Thou art more lovely and more temperate.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 hello world user assistant system
"""
ARCHS = ("llama", "mistral", "qwen2", "gpt2", "gpt_bigcode")
WINDOW = 24  # the windowed tiny models' sliding window: prompts run below, at and past it
# Attention variants (issue 23): each name is a tiny checkpoint of the model type before its "-"
VARIANT_ARCHS = ("qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "mistral-window", "qwen2-window", "granite_swa")


def model_type(arch: str) -> str:
    return arch.split("-")[0]


def train_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(arch: str, vocab_size: int, eos: int, bos: int, kv_heads: int | None = None):
    import transformers as T

    common = dict(vocab_size=vocab_size, eos_token_id=eos, bos_token_id=bos, pad_token_id=0)
    llama_like = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-5, **common)
    gpt_like = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.3, **common)
    if arch == "llama":  # GQA, tied embeddings, llama3 RoPE scaling
        return T.LlamaConfig(num_key_value_heads=kv_heads or 2, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **llama_like)
    if arch == "mistral":  # MQA, linear RoPE scaling
        return T.MistralConfig(num_key_value_heads=kv_heads or 1, sliding_window=None, rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, **llama_like)
    if arch == "qwen2":  # GQA with q/k/v bias
        return T.Qwen2Config(num_key_value_heads=kv_heads or 2, **llama_like)
    if arch == "gpt2":  # MHA, learned positions, LayerNorm, GELU, Conv1D
        return T.GPT2Config(**gpt_like)
    if arch == "gpt_bigcode":  # MQA
        return T.GPTBigCodeConfig(multi_query=(kv_heads or 1) == 1, **gpt_like)
    return _variant_config(arch, llama_like, kv_heads)


def _variant_config(arch: str, llama_like: dict, kv_heads: int | None):
    """The issue-23 model types. Soft-caps are small so that random weights reach them; Gemma's
    embeddings are untied (tied and scaled, a random tiny model repeats its last token)."""
    import transformers as T

    kv = kv_heads or 2
    if arch == "qwen3":  # QK-norm per head; a sliding layer after a global one
        return T.Qwen3Config(num_key_value_heads=kv, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                             max_window_layers=1, **llama_like)
    if arch == "gemma2":  # soft-capped scores and logits, query pre-scale, sliding / global alternating
        return T.Gemma2Config(num_key_value_heads=kv, head_dim=16, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0, sliding_window=WINDOW,
                              tie_word_embeddings=False, hidden_activation="gelu_pytorch_tanh", **llama_like)
    if arch == "gemma3_text":  # QK-norm, two sliding layers per global one, a local RoPE base
        cfg = dict(llama_like, num_hidden_layers=3)
        return T.Gemma3TextConfig(num_key_value_heads=kv, head_dim=16, query_pre_attn_scalar=16,
                                  sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention",
                                                                      "full_attention"],
                                  rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                      "factor": 8.0},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                                  tie_word_embeddings=False, **cfg)
    if arch == "phi3":  # fused qkv and gate/up in the checkpoint
        return T.Phi3Config(num_key_value_heads=kv, sliding_window=None, **llama_like)
    if arch == "olmo2":  # norms after attention and MLP; q and k normalised over all heads
        return T.Olmo2Config(num_key_value_heads=kv, **llama_like)
    if arch == "mistral-window":  # every layer sliding
        return T.MistralConfig(num_key_value_heads=kv, sliding_window=WINDOW, **llama_like)
    if arch == "granite_swa":  # learned sinks; a global layer then three sliding ones; a NoPE layer; multipliers
        cfg = dict(llama_like, num_hidden_layers=4)
        return T.GraniteSWAConfig(num_key_value_heads=kv, sliding_window=WINDOW, layer_rope_theta=[1e4, 1e4, 0, 5e5],
                                  attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.7,
                                  logits_scaling=1.5, **cfg)
    if arch == "qwen2-window":  # the layers from max_window_layers on slide
        return T.Qwen2Config(num_key_value_heads=kv, use_sliding_window=True, sliding_window=WINDOW,
                             max_window_layers=1, **llama_like)
    raise ValueError(arch)


def make_checkpoint(out: Path, arch: str, seed: int = 0, kv_heads: int | None = None,
                    max_shard_size: str | None = None) -> Path:
    """Write a random `arch` model + trained tokenizer to `out`; returns `out`."""
    from transformers import AutoModelForCausalLM

    tok = train_tokenizer()
    eos, bos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    cfg = hf_config(arch, len(tok), eos, bos, kv_heads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # learned sinks start at 0: give them weight, so that tests see them
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.normal_(0.0, 2.0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    tok.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type(arch)
    return out


def mixed_prompts(tok, count, seed=0, min_len=3, max_len=90):
    """`count` runs of CORPUS's tokens of random lengths: prompts that differ in length and text."""
    rng = random.Random(seed)
    ids = tok(CORPUS)["input_ids"]
    out = []
    for _ in range(count):
        n = rng.randint(min_len, max_len)
        start = rng.randint(0, len(ids) - n)
        out.append(ids[start:start + n])
    return out


# ---- reasoning models (tests/test_reasoning.py, and the Responses / Messages APIs' thinking) ----
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
R1_TEMPLATE = CHAT_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")


def thinking_prompt(tok, **kw) -> list[int]:
    """The prompt "hello world" as a user turn, through the tokenizer's chat template."""
    return tok.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True, **kw)["input_ids"]


def greedy_continuation(model, ids, n) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def make_thinking_checkpoint(out: Path, r1: bool) -> Path:
    """qwen3: `<think>` / `</think>` added tokens; each tag's LM-head row a little longer than that of
    a token greedy decoding picks (the first answer token, a later thinking token), so the model opens a
    thinking and closes it after a few tokens. r1: plain-text tags, the template opens the thinking."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM

    tok = train_tokenizer()
    if not r1:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = R1_TEMPLATE if r1 else QWEN3_TEMPLATE
    eos, bos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("qwen3", len(tok), eos, bos), dtype=torch.float32)
    if not r1:
        start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
        rows, prompt = model.lm_head.weight.data, thinking_prompt(tok)
        rows[start] = 1.05 * rows[greedy_continuation(model, prompt, 1)[0]]
        rows[end] = 1.05 * rows[greedy_continuation(model, prompt + [start], 5)[4]]
        made = greedy_continuation(model, prompt, 12)
        assert made[0] == start and end in made[2:], made  # the construction holds: a thinking, opened and closed
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
