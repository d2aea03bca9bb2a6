"""LoRA adapters made in the test with HF PEFT (random A and B), and PEFT as the oracle."""
from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# name -> PEFT LoraConfig keys: different ranks, targets, scalings (the tiny llama's adapters)
ADAPTERS = {
    "all8": {"r": 8, "lora_alpha": 16, "target_modules": [*ATTENTION, *MLP]},
    "attn4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "mlp16": {"r": 16, "lora_alpha": 8, "target_modules": list(MLP), "use_rslora": True,
              "rank_pattern": {"down_proj": 2}},
}


def make_adapter(base: Path, out: Path, seed: int = 0, b_std: float = 0.5, **config) -> Path:
    """A PEFT LoRA adapter of the HF checkpoint `base` with random (non-zero) A and B, saved as
    safetensors to `out`. B ~ N(0, b_std): larger than PEFT's random init, so that greedy tokens change."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    peft.save_pretrained(str(out), safe_serialization=True)
    return out


def peft_model(base: Path, adapter: Path, dtype=torch.float32):
    """The oracle: HF's base model with PEFT's adapter on it, in `dtype`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
    return PeftModel.from_pretrained(model, str(adapter)).eval()
