"""Decoder-only Transformers built from one MHA/GQA/MQA attention class."""
from models.attention import CausalSelfAttention, DenseAttention, reference_attention
from models.config import ModelConfig, RopeConfig
from models.loader import load_model, load_tokenizer
from models.registry import resolve_model
from models.transformer import DecoderLM

__all__ = [
    "CausalSelfAttention", "DecoderLM", "DenseAttention", "ModelConfig", "RopeConfig",
    "load_model", "load_tokenizer", "reference_attention", "resolve_model",
]
