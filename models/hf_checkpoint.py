"""A checkpoint in memory, as every reader returns it (checkpoint.py for safetensors, gguf_file.py for GGUF)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping


@dataclass
class HFCheckpoint:
    """An HF checkpoint in memory: config dicts and tensors under HF parameter names."""

    config: dict[str, Any]
    tensors: dict[str, Any]  # torch.Tensor, or models.quant_formats.QuantizedTensor kept from a GGUF
    generation_config: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None
    # saved as a bare decoder (HF's `AutoModel`: architectures `Qwen2Model`, names without `model.`), the
    # common form of an embedding model's checkpoint: it may have no LM head (then it cannot generate)
    base_model: bool = False


class LazyTensors(Mapping):
    """Tensors read from their file when looked up, each time: a tensor-parallel rank cuts its part
    from one matrix at a time and never holds the whole model (models/weights.py). `shapes`: each one's
    (shape, GGUF type where it stays quantized, else None), known without reading it."""

    def __init__(self, readers: dict[str, Callable[[], Any]],
                 shapes: dict[str, tuple[tuple[int, ...], Any]] | None = None) -> None:
        self.readers = readers
        self.shapes = shapes or {}

    def __getitem__(self, name: str) -> Any:
        return self.readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self.readers)

    def __len__(self) -> int:
        return len(self.readers)
