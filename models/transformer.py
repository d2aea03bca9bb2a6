"""The decoder-only Transformer: embeddings, pre-norm blocks, final norm, LM head."""
from __future__ import annotations

import torch
from torch import nn

from models.attention import AttentionFn, CausalSelfAttention, DenseAttention
from models.config import ModelConfig
from models.layers import MLP, make_norm
from models.lora import LoraStep
from models.parallel import RowParallel
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
        self.mlp = MLP(cfg, layer_idx)
        self.mlp_post_norm = make_norm(cfg) if post else nn.Identity()
        self.residual_scale = cfg.residual_scale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attention: AttentionFn,
                lora: LoraStep | None = None) -> torch.Tensor:
        x = x + self._scaled(self.attn_post_norm(self.attn(self.attn_norm(x), rope, attention, lora)))
        return x + self._scaled(self.mlp_post_norm(self.mlp(self.mlp_norm(x), lora)))

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

    def __init__(self, cfg: ModelConfig, layers: range | None = None, vocab_rows: int | None = None) -> None:
        """`layers`: a pipeline stage's run (the embedding only on the first stage, the final norm and
        LM head only on the last); `vocab_rows`: a tensor-parallel rank's slice of the vocabulary."""
        super().__init__()
        self.config = cfg
        self.layer_range = range(cfg.num_layers) if layers is None else layers
        first, last = self.layer_range.start == 0, self.layer_range.stop == cfg.num_layers
        rows = vocab_rows or cfg.vocab_size
        self.embed = nn.Embedding(rows, cfg.hidden_size) if first else None
        learned = cfg.position == "learned" and first
        self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if learned else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in self.layer_range)
        self.final_norm = make_norm(cfg) if last else nn.Identity()
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False) if last else None
        if cfg.tie_word_embeddings and first and last:
            self.lm_head.weight = self.embed.weight
        self.other_ropes, self.rope_index = _rope_layout(cfg)
        self.register_buffer("inv_freq", None, persistent=False)
        self.register_buffer("layer_inv_freqs", None, persistent=False)
        self.set_rope_frequencies(torch.device("cpu"))
        self.cpu_path = None  # set once by models.cpu_linear.prepare: how this machine runs the model
        self.quantization = "none"  # the linears' weight format: none, int8, int4_g32, or a GGUF's types

    def set_rope_frequencies(self, device: torch.device | str) -> None:
        """RoPE inverse frequencies, computed for real on `device` (also under a meta device,
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
        return self._anchor().dtype

    @property
    def device(self) -> torch.device:
        return self._anchor().device

    def _anchor(self) -> torch.Tensor:
        """A weight in the model's dtype: the embedding's, or (a later pipeline stage) a norm's."""
        if self.embed is not None:
            return self.embed.weight
        return next(p for p in self.parameters() if p.is_floating_point())

    def weight_bytes(self) -> int:
        """Bytes the weights take in memory as served (tied and shared tensors counted once)."""
        seen: dict[int, int] = {}
        for t in [*self.parameters(), *self.buffers()]:
            if t.is_mkldnn:  # oneDNN's packed weights have no storage to share; each is its own
                seen[id(t)] = t.nbytes
            elif t.device.type != "meta":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn | None = None,
                hidden: torch.Tensor | None = None, *, lora: LoraStep | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden). A later pipeline stage takes
        the previous stage's `hidden` (T, hidden) instead of embedding ids; an earlier one returns its
        last layer's output, before the final norm. `lora`: the step's adapter rows and their deltas."""
        if lora is not None and any(isinstance(layer.attn.o_proj, RowParallel) for layer in self.layers):
            # NOTE: a rank's q/k/v and gate/up are its shard's columns and o/down's input its shard's
            # features, while the slots hold whole adapters: the deltas would not fit
            raise ValueError("LoRA adapters with tensor parallelism are not supported")
        if attention is None:
            attention = DenseAttention((input_ids.shape[0],))
        cfg = self.config
        if hidden is not None:
            x = hidden
        else:
            x = self.embed(input_ids)  # (T, C)
            if cfg.embed_scale is not None:  # NOTE: rounded to the model's dtype first, as Gemma does
                x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        tables: list = []
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        elif cfg.position == "rope":
            extra = [] if self.layer_inv_freqs is None else list(self.layer_inv_freqs)
            tables = [rope_cos_sin(positions, f, x.dtype) for f in [self.inv_freq, *extra]]
        rope_index = self.rope_index[self.layer_range.start:self.layer_range.stop] or [None] * len(self.layers)
        for layer, k in zip(self.layers, rope_index):
            x = layer(x, None if k is None else tables[k], attention, lora)
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
