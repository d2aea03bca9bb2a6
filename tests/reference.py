"""Greedy decoding oracles: HF transformers, and our model with no cache at all."""
from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """HF forward with its own KV cache, greedy, exactly `num_tokens` new tokens (EOS does not stop it)."""
    out, past, step = [], None, torch.tensor([prompt])
    for _ in range(num_tokens):
        res = hf_model(input_ids=step, cache=past, use_cache=True)
        past = res.cache
        out.append(int(res.logits[0, -1].argmax()))
        step = torch.tensor([[out[-1]]])
    return out


@torch.no_grad()
def dense_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Our model re-run over the whole sequence each step: no cache, nothing to get wrong."""
    ids = list(prompt)
    for _ in range(num_tokens):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):]


def load_hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
