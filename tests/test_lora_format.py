"""PEFT adapters read without torch, checked against a model's shapes, and installed into slots whose
delta equals PEFT's module by module (tests/lora_helpers.py's adapters of the tiny llama)."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.hf_config import config_from_hf
from models.lora import LoraMetadata, LoraSlots, LoraStep, lora_shapes
from models.lora_format import WEIGHTS, AdapterError, cache_salt, check_adapter, read_adapter
from tests.lora_helpers import ADAPTERS, make_adapter, peft_model
from tests.tiny import make_checkpoint


def shapes_of(checkpoint: Path, max_loras: int = 3, max_lora_rank: int = 16):
    return lora_shapes(config_from_hf(json.loads((checkpoint / "config.json").read_text())), max_loras, max_lora_rank)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> Path:
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return path


def test_reads_ranks_targets_and_scales(lora_adapters):
    all8, attn4, mlp16 = (read_adapter(str(lora_adapters[n])) for n in ("all8", "attn4", "mlp16"))
    assert all8.max_rank == 8 and len(all8.deltas) == 2 * 7
    assert all8.targets == tuple(sorted({("qkv", 0), ("qkv", 1), ("qkv", 2), ("o", 0), ("gate_up", 0),
                                         ("gate_up", 1), ("down", 0)}, key=str))
    assert {d.scale for d in all8.deltas} == {16 / 8}
    assert attn4.max_rank == 4 and {(d.module, d.piece) for d in attn4.deltas} == {("qkv", 0), ("qkv", 2), ("o", 0)}
    assert {d.scale for d in attn4.deltas} == {8 / 4}
    # use_rslora: alpha / sqrt(r); rank_pattern {"down_proj": 2} matches ...mlp.down_proj by PEFT's rule
    by_module = {(d.module, d.piece): d for d in mlp16.deltas if d.layer == 0}
    assert by_module["down", 0].rank == 2 and by_module["down", 0].scale == pytest.approx(8 / 2 ** 0.5)
    assert by_module["gate_up", 1].rank == 16 and by_module["gate_up", 1].scale == pytest.approx(8 / 4)
    assert mlp16.max_rank == 16
    assert len({all8.digest, attn4.digest, mlp16.digest}) == 3
    assert cache_salt(all8.digest) != cache_salt(attn4.digest) and len(cache_salt(all8.digest)) == 16


def test_digest_follows_weights_and_scale(lora_adapters, tmp_path):
    before = read_adapter(str(lora_adapters["attn4"])).digest
    assert read_adapter(str(lora_adapters["attn4"])).digest == before
    moved = copy(lora_adapters["attn4"], tmp_path / "a")
    assert read_adapter(str(moved)).digest == before  # of the contents, not the path
    tensors = load_file(moved / WEIGHTS)
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] += 1.0
    save_file(tensors, moved / WEIGHTS)
    changed = read_adapter(str(moved)).digest
    assert changed != before
    edit_config(moved, lora_alpha=9)
    assert read_adapter(str(moved)).digest not in (before, changed)


def test_errors_each_to_its_status(lora_adapters, tiny_checkpoints, tmp_path):
    def error(path, shapes=None) -> AdapterError:
        with pytest.raises(AdapterError) as e:
            spec = read_adapter(str(path))
            check_adapter(spec, shapes or shapes_of(tiny_checkpoints["llama"]))
        return e.value

    low_cap = shapes_of(tiny_checkpoints["llama"], max_lora_rank=8)
    check_adapter(read_adapter(str(lora_adapters["all8"])), low_cap)
    e = error(lora_adapters["mlp16"], low_cap)
    assert (e.status, e.param) == (400, "lora_path") and "rank 16" in str(e)
    assert error(tmp_path / "absent").status == 404
    missing = copy(lora_adapters["attn4"], tmp_path / "missing")
    (missing / WEIGHTS).unlink()
    assert error(missing).status == 404
    no_config = copy(lora_adapters["attn4"], tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    assert error(no_config).status == 404
    pickled = copy(lora_adapters["attn4"], tmp_path / "pickled")
    (pickled / WEIGHTS).rename(pickled / "adapter_model.bin")
    e = error(pickled)
    assert e.status == 400 and "pickle refused" in str(e)
    # the llama's adapter on the mistral (one KV head, not two): k/v's B rows differ
    e = error(lora_adapters["all8"], shapes_of(tiny_checkpoints["mistral"]))
    assert e.status == 400 and "another base" in str(e)
    assert error(edit_config(copy(lora_adapters["attn4"], tmp_path / "dora"), use_dora=True)).status == 400
    assert error(edit_config(copy(lora_adapters["attn4"], tmp_path / "mts"), modules_to_save=["lm_head"])).status == 400
    assert error(edit_config(copy(lora_adapters["attn4"], tmp_path / "bias"), bias="all")).status == 400
    # a rank in the file that its config does not give
    assert error(edit_config(copy(lora_adapters["attn4"], tmp_path / "r"), r=5)).status == 400


def test_refuses_lm_head_and_bad_headers(lora_adapters, tmp_path):
    head = copy(lora_adapters["attn4"], tmp_path / "head")
    tensors = load_file(head / WEIGHTS)
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(256, 4)
    save_file(tensors, head / WEIGHTS)
    with pytest.raises(AdapterError, match="LM head"):
        read_adapter(str(head))
    bad = copy(lora_adapters["attn4"], tmp_path / "bad")
    (bad / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(AdapterError, match="header") as e:
        read_adapter(str(bad))
    assert e.value.status == 400
    ints = copy(lora_adapters["attn4"], tmp_path / "ints")
    save_file({k: v.to(torch.int32) for k, v in load_file(ints / WEIGHTS).items()}, ints / WEIGHTS)
    with pytest.raises(AdapterError, match="dtype"):
        read_adapter(str(ints))


PEFT_MODULES = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o": ("self_attn", ("o_proj",)),
                "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}


@torch.no_grad()
def test_installed_delta_equals_peft(lora_adapters, tiny_checkpoints):
    """Every adapter in its own slot, rows of the three and of the base mixed in one call: each row's
    delta is PEFT's module output less the base layer's, fp32."""
    base = tiny_checkpoints["llama"]
    slots = LoraSlots(shapes_of(base), torch.float32)
    names = list(ADAPTERS)
    for slot, name in enumerate(names):
        slots.install(slot, read_adapter(str(lora_adapters[name])))
    row_slots = [2, None, 0, 1, 0, None, 2, 1, 1]
    step = LoraStep(slots, LoraMetadata.of(row_slots))
    oracles = [peft_model(base, lora_adapters[name]) for name in names]
    torch.manual_seed(0)
    for layer in range(slots.shapes.num_layers):
        for module, (parent, peft_names) in PEFT_MODULES.items():
            x = torch.randn(len(row_slots), slots.shapes.in_features(module))
            y = torch.randn(len(row_slots), sum(slots.shapes.splits(module)))
            expected = y.clone()
            for row, slot in enumerate(row_slots):
                if slot is None:
                    continue
                block = getattr(oracles[slot].base_model.model.model.layers[layer], parent)
                deltas = []
                for n in peft_names:
                    m = getattr(block, n)
                    base_layer = m.get_base_layer() if hasattr(m, "get_base_layer") else m  # untargeted: nn.Linear
                    deltas.append(m(x[row:row + 1]) - base_layer(x[row:row + 1]))
                expected[row] += torch.cat(deltas, dim=1)[0]
            out = step.apply(layer, module, x, y.clone())
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            base_rows = [i for i, s in enumerate(row_slots) if s is None]
            assert torch.equal(out[base_rows], y[base_rows])  # bit for bit


def test_a_slot_installed_over_holds_only_the_new_adapter(lora_adapters, tiny_checkpoints):
    """Installing over a slot resets its ranks only (the weights behind rank 0 are never read): the deltas
    must be the new adapter's alone, as in a fresh slot."""
    shapes = shapes_of(tiny_checkpoints["llama"], max_loras=1)
    reused, fresh = LoraSlots(shapes, torch.float32), LoraSlots(shapes, torch.float32)
    reused.install(0, read_adapter(str(lora_adapters["all8"])))
    reused.install(0, read_adapter(str(lora_adapters["attn4"])))
    fresh.install(0, read_adapter(str(lora_adapters["attn4"])))
    assert reused.ranks[0, "gate_up"].tolist() == [[0, 0]] and reused.ranks[0, "qkv"].tolist() == [[4, 0, 4]]
    meta = LoraMetadata.of([0, 0, 0])
    torch.manual_seed(0)
    for module in ("qkv", "o", "gate_up", "down"):
        x = torch.randn(3, shapes.in_features(module))  # (T, in)
        y = torch.randn(3, sum(shapes.splits(module)))  # (T, out)
        got = LoraStep(reused, meta).apply(1, module, x, y.clone())
        assert torch.equal(got, LoraStep(fresh, meta).apply(1, module, x, y.clone())), module
        assert torch.equal(got, y) == (module in ("gate_up", "down")), module  # attn4 targets q, v, o only


# Fused and non-gated bases: Phi-3's qkv_proj / gate_up_proj (one A for every piece, B's rows split),
# GPT-2's Conv1D c_attn / c_proj / c_fc (fan_in_fan_out; an MLP with no gate)
FUSED = {
    "phi3": ({"r": 8, "lora_alpha": 16, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]},
             lambda m, i: m.model.layers[i], {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"),
                                              "gate_up": ("mlp", "gate_up_proj"), "down": ("mlp", "down_proj")}),
    "gpt2": ({"r": 4, "lora_alpha": 4, "target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True},
             lambda m, i: m.transformer.h[i], {"qkv": ("attn", "c_attn"), "o": ("attn", "c_proj"),
                                               "gate_up": ("mlp", "c_fc"), "down": ("mlp", "c_proj")}),
}


@pytest.mark.parametrize("arch", FUSED)
@torch.no_grad()
def test_fused_and_conv1d_targets_equal_peft(arch, tmp_path):
    config, layer_of, modules = FUSED[arch]
    base = make_checkpoint(tmp_path / "base", arch)
    adapter = make_adapter(base, tmp_path / "adapter", **config)
    spec = read_adapter(str(adapter))
    assert {(d.module, d.piece) for d in spec.deltas} == (
        {("qkv", None), ("o", 0), ("gate_up", None), ("down", 0)} if arch == "phi3"
        else {("qkv", None), ("o", 0), ("gate_up", 1), ("down", 0)})
    slots = LoraSlots(shapes_of(base, max_loras=2), torch.float32)
    slots.install(1, spec)
    assert slots.ranks[0, "gate_up"].tolist()[1] == ([8, 8] if arch == "phi3" else [4])
    oracle = peft_model(base, adapter)
    row_slots = [1, None, 1]
    step = LoraStep(slots, LoraMetadata.of(row_slots))
    torch.manual_seed(0)
    for layer in range(slots.shapes.num_layers):
        for module, (parent, name) in modules.items():
            x = torch.randn(3, slots.shapes.in_features(module))
            y = torch.zeros(3, sum(slots.shapes.splits(module)))
            m = getattr(getattr(layer_of(oracle.base_model.model, layer), parent), name)
            want = m(x) - m.get_base_layer()(x)
            want[1] = 0
            torch.testing.assert_close(step.apply(layer, module, x, y), want, rtol=1e-5, atol=1e-5)
