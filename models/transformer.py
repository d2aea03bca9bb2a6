"""The decoder-only Transformer: embeddings, pre-norm blocks, final norm, LM head."""
from __future__ import annotations

import torch
from torch import nn

from models.attention import AttentionFn, CausalSelfAttention, DenseAttention
from models.config import ModelConfig
from models.layers import MLP, make_norm
from models.rope import rope_cos_sin, rope_inv_freq


class DecoderLayer(nn.Module):
    """Attention and MLP, each a residual branch with its norm before (pre), after (post, OLMo 2)
    or both (sandwich, Gemma)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        pre, post = cfg.block_norms in ("pre", "sandwich"), cfg.block_norms in ("post", "sandwich")
        self.attn_norm = make_norm(cfg) if pre else nn.Identity()
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.attn_post_norm = make_norm(cfg) if post else nn.Identity()
        self.mlp_norm = make_norm(cfg) if pre else nn.Identity()
        self.mlp = MLP(cfg)
        self.mlp_post_norm = make_norm(cfg) if post else nn.Identity()
        self.residual_scale = cfg.residual_scale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attention: AttentionFn) -> torch.Tensor:
        x = x + self._scaled(self.attn_post_norm(self.attn(self.attn_norm(x), rope, attention)))
        return x + self._scaled(self.mlp_post_norm(self.mlp(self.mlp_norm(x))))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale


def _rope_layout(cfg: ModelConfig) -> tuple[list, tuple[int | None, ...]]:
    """The RoPEs other than the model's (Gemma 3's windowed layers, Granite SWA's per-layer bases),
    and per layer which table it rotates by: 0 the model's, k > 0 other k - 1, None none (NoPE)."""
    if cfg.position != "rope":
        return [], ()
    ropes = [cfg.layer_rope(i) for i in range(cfg.num_layers)]
    others = list(dict.fromkeys(r for r in ropes if r is not None and r != cfg.rope))
    return others, tuple(None if r is None else 0 if r == cfg.rope else 1 + others.index(r) for r in ropes)


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
        self.other_ropes, self.rope_index = _rope_layout(cfg)
        self.register_buffer("inv_freq", None, persistent=False)
        self.register_buffer("layer_inv_freqs", None, persistent=False)
        self.set_rope_frequencies(torch.device("cpu"))
        self.cpu_path = None  # set once by models.cpu_path.prepare: how this machine runs the model
        self.quantization = "none"  # the linears' weight format: none, int8, int4_g32, or a GGUF's types

    def set_rope_frequencies(self, device: torch.device | str) -> None:
        """RoPE inverse frequencies, computed for real on `device` (NOTE: also under a meta device,
        where the loader builds the model's skeleton)."""
        cfg = self.config
        if cfg.position != "rope":
            return
        with torch.device(device):
            self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope)
            if self.other_ropes:
                self.layer_inv_freqs = torch.stack([rope_inv_freq(cfg.head_dim, r) for r in self.other_ropes])  # (K, D/2)

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
        cfg = self.config
        x = self.embed(input_ids)  # (T, C)
        if cfg.embed_scale is not None:  # NOTE: rounded to the model's dtype first, as Gemma does
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        tables: list = []
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            extra = [] if self.layer_inv_freqs is None else list(self.layer_inv_freqs)
            tables = [rope_cos_sin(positions, f, x.dtype) for f in [self.inv_freq, *extra]]
        for layer, k in zip(self.layers, self.rope_index or [None] * len(self.layers)):
            x = layer(x, None if k is None else tables[k], attention)
        return self.final_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> logits (N, vocab) in the model's dtype, soft-capped where the model says."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling is not None:
            logits = logits / self.config.logits_scaling
        if self.config.final_softcap is not None:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> fp32 logits (N, vocab). Callers pass only the rows they sample from."""
        return self.logits(hidden).float()
