"""Refusals: pickle weights, unknown architectures, incomplete checkpoints."""
import json
import shutil

import pytest
import torch

from models import load_model
from models.checkpoint import UnsafeWeightsError


def test_pickle_bin_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeWeightsError, match="refusing to load pickle"):
        load_model(tmp_path)


def test_pickle_file_path_is_refused(tmp_path):
    torch.save({"x": torch.zeros(1)}, tmp_path / "model.pt")
    with pytest.raises(UnsafeWeightsError, match="safetensors"):
        load_model(tmp_path / "model.pt")


def test_unknown_architecture_names_supported_ones(tiny_checkpoints, tmp_path):
    d = tmp_path / "t5"
    shutil.copytree(tiny_checkpoints["qwen2"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "t5", ["T5ForConditionalGeneration"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture 't5'.*supported: llama, mistral, qwen2, gpt2, gpt_bigcode"):
        load_model(d)


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["qwen2"], d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(d)


def test_missing_directory_and_unknown_name(tmp_path):
    from models import resolve_model

    with pytest.raises(FileNotFoundError, match="no model 'nope'"):
        resolve_model("nope")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_unsupported_dtype():
    from models.loader import parse_dtype

    with pytest.raises(ValueError, match="float32 or bfloat16"):
        parse_dtype("float16")
