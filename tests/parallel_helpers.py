"""Rank-side code for tests/test_parallel_layers.py: real gloo process groups in spawned processes.

Each rank returns what it computed (tensors, sizes) and the test compares it with the unsharded model
in the parent, so that every assertion reads in the test and a rank only does its own part.
"""
from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = torch.tensor([5, 17, 42, 99, 3, 250, 7, 383, 0, 120, 64])  # 383: a row of the last vocabulary slice


def llama(out: Path, heads: int, kv_heads: int, tie: bool) -> Path:
    """A random tiny Llama, 3 layers (3 stages, or 2 + 1), with these head counts (head_dim 16). Its
    vocabulary (389, more rows than the tokenizer's 384, as padded HF vocabularies have) splits unevenly
    over 2 and 4 ranks. Small weights (logits of a few units) keep fp32's rounding well inside 1e-5."""
    from transformers import LlamaConfig

    return _save(out, LlamaConfig(vocab_size=389, hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                                  initializer_range=0.05, rms_norm_eps=1e-5, tie_word_embeddings=tie, eos_token_id=2,
                                  bos_token_id=1, pad_token_id=0))


def gpt2_like(out: Path, arch: str) -> Path:
    """tests/tiny.py's GPT-2 (MHA) or GPTBigCode (MQA): learned positions, biases everywhere;
    weights smaller than its, as `llama`'s."""
    from tests.tiny import hf_config

    cfg = hf_config(arch, 384, 2, 1)
    cfg.initializer_range = 0.1
    return _save(out, cfg)


def _save(out: Path, cfg) -> Path:
    """A random model of `cfg` with its norms not all ones and its biases not zero (HF starts them so,
    and a norm or bias sharded wrongly would not show), and tests/tiny.py's tokenizer."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import train_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    train_tokenizer().save_pretrained(out)
    return out


def run_ranks(world: int, jobs: dict[str, tuple]) -> dict[str, list]:
    """Each job `name: (target, *args)` run in turn as `target(rank, world, *args)` by `world` spawned
    processes joined in one gloo group (one spawn for many checks: starting a process costs seconds);
    name -> what each rank returned, by rank. A rank's exception fails the caller."""
    from loadtests.servers import free_port  # NOTE: here, not at the top: the ranks need not import httpx

    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(world, port, out, jobs), nprocs=world, join=True)
        results = [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]
    return {name: [r[name] for r in results] for name in jobs}


def _entry(rank: int, world: int, port: int, out: str, jobs: dict[str, tuple]) -> None:
    torch.set_num_threads(1)  # NOTE: up to 4 ranks share the test machine's 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results = {name: target(rank, world, *args) for name, (target, *args) in jobs.items()}
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out) / f"{rank}.pt")


def load(path: Path, shard=None):
    from models.loader import load_for_serving

    return load_for_serving(path, "float32", quantization="auto" if str(path).endswith(".gguf") else "none",
                            shard=shard)


def joined(path: Path, shard, tp_group=None):
    """This rank's shard of the model at `path`, its collectives joined (over the whole world by default)."""
    from models.parallel import TensorParallelGroup, parallelize

    model = load(path, shard)
    parallelize(model, shard, TensorParallelGroup(tp_group or dist.group.WORLD, shard.tp_size, shard.tp_rank))
    return model


def layer_outputs(rank: int, world: int, path: Path, inputs: list[torch.Tensor]) -> dict:
    """Each sharded decoder layer's output for its own input (so a layer is checked alone), then the
    whole TP model's logits."""
    from models.attention import DenseAttention
    from models.parallel import Shard
    from models.rope import rope_cos_sin

    model = joined(path, Shard(rank, world))
    positions = torch.arange(inputs[0].shape[0])
    rope = rope_cos_sin(positions, model.inv_freq, torch.float32)
    attention = DenseAttention((len(positions),))
    with torch.inference_mode():
        layers = [layer(x, rope, attention) for layer, x in zip(model.layers, inputs)]
        logits = model.logits(model(TOKENS, torch.arange(len(TOKENS))))
    heads = [(layer.attn.num_heads, layer.attn.num_kv_heads) for layer in model.layers]
    return {"layers": layers, "logits": logits, "heads": heads}


def stage_logits(rank: int, world: int, path: Path, tp: int, pp: int) -> dict:
    """A TP x PP rank's part of one forward pass: stages hand their hidden states on with send/recv;
    the last stage's ranks return the logits."""
    from models.parallel import Shard

    shard = Shard.of_rank(rank, tp, pp)
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]  # every rank makes every group
    model = joined(path, shard, groups[shard.pp_rank])
    hidden = None
    with torch.inference_mode():
        if shard.pp_rank > 0:
            hidden = torch.empty(len(TOKENS), model.config.hidden_size)
            dist.recv(hidden, src=rank - tp)
        out = model(TOKENS, torch.arange(len(TOKENS)), hidden=hidden)
        if shard.pp_rank < pp - 1:
            dist.send(out.contiguous(), dst=rank + tp)
            return {"layers": model.layer_range, "logits": None}
        return {"layers": model.layer_range, "logits": model.logits(out)}


def gguf_logits(rank: int, world: int, path: Path) -> dict:
    """A TP rank's logits of a quantized GGUF, and which modules hold the linears."""
    from models.parallel import Shard

    model = joined(path, Shard(rank, world))
    with torch.inference_mode():
        logits = model.logits(model(TOKENS, torch.arange(len(TOKENS))))
    layer = model.layers[0]
    linears = [type(m).__name__ for m in (layer.attn.qkv_proj, layer.attn.o_proj.inner, layer.mlp.gate_up_proj,
                                          layer.mlp.down_proj.inner)]
    return {"logits": logits, "quantization": model.quantization, "linears": linears}

