"""Every decoder layer of a Llama-family model in one C++ call (models/csrc/decoder.cpp).

A batch-1 decode step of the default model is ~270 small operations. Compiled, each still costs
microseconds of Python, guards and dispatch in torch.compile's wrapper: perf on the engine (AVX2, 2
threads) found ~40% of the main thread there. `NativeDecoder` runs the layer loop, the norms, RoPE
and SwiGLU in C++ around the same packed quantized-linear and paged-attention kernels, so a step
costs its kernels. It covers RMSNorm + RoPE + SwiGLU models whose layer linears are packed
quantized (models/quant_linear.py) and whose attention is the C++ paged kernel; anything else runs
compiled (compilation.py). It is one way to run a step, beside the compiled and eager ones
(model_runner.py `choose_step`). With LoRA slots, each linear's output gets its adapter rows' deltas
from the same op the Python model's `LoraStep` calls (models/csrc/lora.cpp).
"""
from __future__ import annotations

import torch

from kvcache import ops
from kvcache.paged_attention import PagedAttention
from models.lora import LoraSlots, LoraStep
from models.lora_format import MODULES
from models.native.libraries import available
from models.parallel import RowParallel
from models.quant_linear import QuantLinear
from models.rope import rope_cos_sin
from models.transformer import DecoderLM


def unsupported(model: DecoderLM, lora: bool = False) -> str | None:
    """Why `model` (with LoRA slots where `lora`) cannot run as a NativeDecoder, or None when it can."""
    cfg = model.config
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return "runs on CPU in float32 or bfloat16 only"
    if (cfg.norm, cfg.mlp, cfg.activation, cfg.position) != ("rmsnorm", "swiglu", "silu", "rope"):
        return "layers other than RMSNorm + RoPE + SwiGLU"
    if cfg.attention_variants or cfg.block_norms != "pre" or cfg.embed_scale or cfg.final_softcap:
        return f"attention variants or block forms it does not implement ({', '.join(cfg.attention_variants)})"
    if not ops.cpu_backend().startswith("native"):
        return "no C++ paged-attention kernel"
    # NOTE: a base model's checkpoint has no LM head (embeddings only) and runs here all the same
    if model.embed is None or model.layer_range != range(cfg.num_layers):
        return "a pipeline stage (it runs every layer from embedding to final norm)"
    if _communicator(model) is False:
        return "tensor-parallel all-reduces over gloo (only shared memory is called from C++)"
    for layer in model.layers:
        for linear in _linears(layer):
            if not (isinstance(linear, QuantLinear) and linear.mode == "packed"):
                return "layer linears that are not packed quantized"
    if not available("decoder"):
        return "the C++ decoder library is unavailable (see the warning above)"
    if lora and _communicator(model) is not None:
        return "LoRA with tensor parallelism"
    if lora and not available("lora"):
        return "the C++ LoRA library is unavailable (see the warning above)"
    return None


def _linears(layer) -> tuple:
    """A layer's four linears, a tensor-parallel rank's unwrapped from their all-reduce."""
    return tuple(m.inner if isinstance(m, RowParallel) else m
                 for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))


def _communicator(model: DecoderLM):
    """None without tensor parallelism; a rank's shared-memory communicator; False if it all-reduces over gloo."""
    o_proj = model.layers[0].attn.o_proj
    if not isinstance(o_proj, RowParallel):
        return None
    return o_proj.tp.shm if o_proj.tp.shm is not None else False


class NativeDecoder:
    """Called as DecoderLM is: (input_ids, positions, PagedAttention) -> final hidden states (T, C).

    NOTE: holds the model's own tensors, not copies; the model must not change after this is built."""

    def __init__(self, model: DecoderLM, lora_slots: LoraSlots | None = None) -> None:
        reason = unsupported(model, lora=lora_slots is not None)
        if reason is not None:
            raise ValueError(f"this model cannot run as a NativeDecoder: {reason}")
        cfg = model.config
        self.model = model
        self.head_dim = cfg.head_dim
        self.stack = torch.classes.attnserve.DecoderStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                          cfg.intermediate_size, cfg.norm_eps,
                                                          model.final_norm.weight.detach())
        shm = _communicator(model)
        if shm is not None:  # a tensor-parallel rank: its partial sums all-reduced inside the C++ loop
            self.stack.set_all_reduce(shm.handle)
        for layer in model.layers:
            tensors: list[torch.Tensor] = []
            sizes: list[int] = []
            for linear in _linears(layer):
                parts = linear.parts if linear.parts is not None else [linear]
                sizes.append(len(parts))
                for part in parts:
                    bias = part.bias.detach() if part.bias is not None else torch.empty(0)  # NOTE: empty = no bias
                    tensors += [part.codes, part.scales, part.offsets, bias]
                    sizes += [part.bits, part.group_size, part.out_features, int(part.int8_activations)]
            self.stack.add_layer(layer.attn_norm.weight.detach(), layer.mlp_norm.weight.detach(), tensors, sizes)
        self.lora_slots = lora_slots
        self.rope_tables = (torch.empty(0, cfg.head_dim), torch.empty(0, cfg.head_dim))  # cos, sin for positions [0, P)
        if lora_slots is not None:
            keys = [(layer, m) for layer in range(cfg.num_layers) for m in MODULES]
            self.stack.set_lora([lora_slots.a[k] for k in keys], [lora_slots.bt[k] for k in keys],
                                [lora_slots.ranks[k] for k in keys])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                 lora: LoraStep | None = None, prompt_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`prompt_tokens`: (T,) bool, the rows that are prompt tokens, which the int8-activation linears then
        take on their prompt kernel (models/native/cpu_path.py PROMPT_KERNELS); None: every row on the int8 one."""
        model, m, cache = self.model, attention.meta, attention.cache
        if lora is not None and lora.slots is not self.lora_slots:  # NOTE: the stack holds the slots it was built with
            raise ValueError("a LoRA step over slots this NativeDecoder was not built with")
        rows = (lora.meta.rows, lora.meta.seg_start, lora.meta.seg_slot) if lora is not None else (None, None, None)
        x = model.embed(input_ids)  # (T, C)
        cos, sin = self._rope(positions, m.max_seq_len, x.dtype)  # (T, D) each
        return self.stack.forward(x, cos, sin, cache.k, cache.v,
                                  m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc, m.max_query_len,
                                  m.max_seq_len, cache.scales.k, cache.scales.v, *rows, prompt_tokens)  # (T, C)

    def _rope(self, positions: torch.Tensor, num_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin rows (T, D) of `positions` (all below num_positions): rows of tables of every position
        so far, grown by doubling, instead of a dozen small ops a step (~0.07 ms of a 6 ms batch-1 step here). NOTE:
        rope_cos_sin's values, the same bits as a step's own call (elementwise ops on the same positions)."""
        cos, sin = self.rope_tables
        if len(cos) < num_positions or cos.dtype != dtype:
            size = max(num_positions, 2 * len(cos), 1024)
            cos, sin = rope_cos_sin(torch.arange(size, device=positions.device), self.model.inv_freq, dtype)  # (P, 1, D)
            self.rope_tables = cos.view(size, self.head_dim), sin.view(size, self.head_dim)
            cos, sin = self.rope_tables
        return cos.index_select(0, positions), sin.index_select(0, positions)
