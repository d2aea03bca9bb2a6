"""The decoder-only Transformer: embeddings, pre-norm blocks, final norm, LM head."""
from __future__ import annotations

import torch
from torch import nn

from models.attention import AttentionFn, CausalSelfAttention, DenseAttention
from models.config import ModelConfig
from models.layers import MLP, make_norm
from models.rope import rope_cos_sin, rope_inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attention: AttentionFn) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, attention)
        return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nn.Module):
    """Works on packed tokens: all sequences of a step concatenated into one (T,) stream.

    Positions are explicit and the attention function carries the step's layout and
    cache, so the same module serves dense reference runs and paged serving.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if cfg.position == "learned" else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.position == "rope":
            with torch.device("cpu"):  # NOTE: computed for real even under a meta device (models/loader.py)
                self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope), persistent=False)
        else:
            self.inv_freq = None
        self.cpu_path = None  # set once by models.cpu_path.prepare: how this machine runs the model
        self.quantization = "none"  # the linears' weight format: none, int8, int4_g32, or a GGUF's types

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def weight_bytes(self) -> int:
        """Bytes the weights take in memory as served (tied and shared tensors counted once)."""
        seen: dict[int, int] = {}
        for t in [*self.parameters(), *self.buffers()]:
            if t.is_mkldnn:  # NOTE: oneDNN's packed weights have no storage to share; each is its own
                seen[id(t)] = t.nbytes
            elif t.device.type != "meta":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden)."""
        if attention is None:
            attention = DenseAttention((input_ids.shape[0],))
        x = self.embed(input_ids)  # (T, C)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            rope = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, attention)
        return self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> fp32 logits (N, vocab). Callers pass only the rows they sample from."""
        return self.lm_head(hidden).float()
