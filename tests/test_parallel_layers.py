"""Tensor and pipeline parallelism (models/parallel.py) against the unsharded model, on real gloo
process groups: each sharded decoder layer alone, whole models' logits, pipeline stages handing on
hidden states, what a rank reads and holds, and quantized GGUF shards.

The ranks run in spawned processes (tests/parallel_helpers.py); one spawn of 2 and one of 4 ranks
serve every multi-process check, since starting a process costs seconds on 2 cores.
"""
from collections import Counter
from pathlib import Path

import pytest
import torch

from models.attention import DenseAttention
from models.checkpoint import read_checkpoint
from models.hf_config import config_from_hf
from models.loader import model_from_checkpoint
from models.parallel import Shard, TensorParallelGroup, _cols, check, feature_unit, head_shards, parallelize, split
from models.quant_formats import QuantizedTensor, quantize_rtn
from models.rope import rope_cos_sin
from tests.parallel_helpers import TOKENS, gguf_logits, gpt2_like, layer_outputs, llama, load, run_ranks, stage_logits

pytestmark = pytest.mark.isa  # make test-isa runs this file again under the AVX2 cap

TOLERANCE = 1e-5  # fp32: the all-reduce sums the partial products in another order


# --- pure functions ----------------------------------------------------------------------------------


def test_split_covers_in_near_equal_runs_of_whole_units():
    for unit in (1, 2, 32):
        for n in range(0, 40 * unit, unit):
            for parts in range(1, 7):
                bounds = split(n, parts, unit)
                sizes = [b - a for a, b in bounds]
                assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == n
                assert all(bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1))
                assert all(s % unit == 0 for s in sizes)
                assert max(sizes) - min(sizes) <= unit
                assert sizes == sorted(sizes, reverse=True)  # the extra units go to the first parts
    assert split(9, 2) == [(0, 5), (5, 9)]
    assert split(128, 3, 32) == [(0, 64), (64, 96), (96, 128)]


def test_feature_unit_keeps_quantization_groups_whole_where_it_can():
    assert feature_unit(512, 2) == 256  # k-quant super-blocks
    assert feature_unit(11008, 4) == 256
    assert feature_unit(256, 2) == 32  # one super-block cannot go to two ranks
    assert feature_unit(128, 4) == 32
    assert feature_unit(128, 5) == 1  # 4 groups over 5 ranks
    assert feature_unit(100, 2) == 1


def test_head_shards_mha_gqa_and_mqa():
    def table(heads, kv, tp):
        return [(s.q, s.kv) for s in head_shards(heads, kv, tp)]

    assert table(4, 4, 2) == [((0, 2), (0, 2)), ((2, 4), (2, 4))]
    assert table(8, 4, 2) == [((0, 4), (0, 2)), ((4, 8), (2, 4))]
    assert table(8, 4, 4) == [((0, 2), (0, 1)), ((2, 4), (1, 2)), ((4, 6), (2, 3)), ((6, 8), (3, 4))]
    assert table(9, 3, 2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]  # K/V heads 2 + 1, their query groups whole
    assert table(8, 1, 2) == [((0, 4), (0, 1)), ((4, 8), (0, 1))]  # MQA: the K/V head on every rank
    assert table(8, 1, 4) == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (0, 1)), ((6, 8), (0, 1))]
    assert table(8, 2, 4) == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]


@pytest.mark.parametrize("heads,kv,tp", [(6, 2, 4), (3, 3, 4), (4, 2, 3), (2, 1, 4)])
def test_head_shards_refuses_what_cannot_split(heads, kv, tp):
    with pytest.raises(ValueError, match="K/V heads"):
        head_shards(heads, kv, tp)


def test_every_query_head_keeps_its_kv_head():
    """Over every layout head_shards accepts: each rank's query heads, read through the rank's local
    GQA grouping, reach the K/V head they read in the whole model."""
    for kv in range(1, 9):
        for heads in range(kv, 17, kv):
            for tp in range(1, 9):
                try:
                    shards = head_shards(heads, kv, tp)
                except ValueError:
                    assert kv < tp and (tp % kv or heads % tp)
                    continue
                assert len(shards) == tp
                assert [s.q for s in shards] == split(heads, tp, heads // kv) if kv >= tp else split(heads, tp)
                for s in shards:
                    local_q, local_kv = s.q[1] - s.q[0], s.kv[1] - s.kv[0]
                    assert local_q > 0 and local_kv > 0 and local_q % local_kv == 0
                    for j in range(local_q):
                        assert s.kv[0] + j // (local_q // local_kv) == (s.q[0] + j) // (heads // kv)


def test_pipeline_stages_hold_runs_of_whole_layers():
    def stages(pp):
        return [Shard(0, 1, p, pp).layers(30) for p in range(pp)]

    assert stages(2) == [range(0, 15), range(15, 30)]
    assert stages(3) == [range(0, 10), range(10, 20), range(20, 30)]
    assert stages(4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert [Shard.of_rank(r, 2, 2) for r in (1, 2)] == [Shard(1, 2, 0, 2), Shard(0, 2, 1, 2)]
    with pytest.raises(ValueError):
        Shard(2, 2)


def _config(hf_class: str, **overrides):
    import transformers

    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=384)
    return config_from_hf(getattr(transformers, hf_class)(**{**fields, **overrides}).to_dict())


def test_check_refuses_olmo2_qk_norm_and_more_stages_than_layers():
    olmo2 = _config("Olmo2Config")
    assert olmo2.qk_norm == "all"
    with pytest.raises(ValueError, match="OLMo 2"):
        check(olmo2, Shard(0, 2))
    check(olmo2, Shard(0, 1, 0, 2))  # pipeline stages hold whole layers: no head is cut
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        check(_config("LlamaConfig"), Shard(0, 1, 0, 3))
    with pytest.raises(ValueError, match="K/V heads"):
        check(_config("LlamaConfig", num_attention_heads=6, hidden_size=96), Shard(0, 4))


# --- sharded modules on real process groups ------------------------------------------------------------

# name -> (query heads, K/V heads, tied embeddings): MHA, GQA (K/V heads divisible by 2 and 4),
# GQA with 3 K/V heads over 2 ranks (2 + 1), MQA (the K/V head copied to every rank)
LLAMAS = {"mha": (4, 4, True), "gqa": (8, 4, False), "gqa_uneven": (6, 3, True), "mqa": (8, 1, False)}
# (checkpoint, TP size) -> (query heads, K/V heads) of each rank's layers
LAYER_CASES = {("mha", 2): [(2, 2), (2, 2)], ("gqa", 2): [(4, 2), (4, 2)], ("gqa_uneven", 2): [(4, 2), (2, 1)],
               ("mqa", 2): [(4, 1), (4, 1)], ("gqa", 4): [(2, 1)] * 4, ("mqa", 4): [(2, 1)] * 4}
# name -> (checkpoint, TP, PP, the last stage's layers) run through stage_logits
PIPELINES = {"pp2": ("gqa_uneven", 1, 2, range(2, 3)), "tp2pp2": ("mha", 2, 2, range(2, 3)),
             "gpt2_tp2": ("gpt2", 2, 1, range(0, 2)), "gpt_bigcode_tp2": ("gpt_bigcode", 2, 1, range(0, 2))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel")
    paths = {name: llama(root / name, heads, kv, tie) for name, (heads, kv, tie) in LLAMAS.items()}
    return paths | {arch: gpt2_like(root / arch, arch) for arch in ("gpt2", "gpt_bigcode")}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (hidden 256, 4 heads / 2 K/V heads) as GGUF: every matrix Q8_0, and a mix of every
    type the reader decodes (4-bit Q4_0, Q4_1, Q4_K among them)."""
    from tests.tiny_gguf import MIXED, Q8_0, make_tiny_llama_256, write_tiny_gguf

    root = tmp_path_factory.mktemp("parallel-gguf")
    hf = make_tiny_llama_256(root / "hf")
    return {"q8_0": write_tiny_gguf(root / "q8_0", hf, Q8_0), "mixed": write_tiny_gguf(root / "mixed", hf, MIXED)}


@pytest.fixture(scope="module")
def layer_inputs(checkpoints) -> dict[str, list[torch.Tensor]]:
    """Per checkpoint, one random input per decoder layer, (T, hidden)."""
    g = torch.Generator().manual_seed(1)
    return {name: [torch.randn(len(TOKENS), 16 * heads, generator=g) for _ in range(3)]
            for name, (heads, _, _) in LLAMAS.items()}


def _jobs(world: int, checkpoints, layer_inputs, ggufs=None) -> dict[str, tuple]:
    jobs = {f"layers-{name}": (layer_outputs, checkpoints[name], layer_inputs[name])
            for name, tp in LAYER_CASES if tp == world}
    jobs.update({name: (stage_logits, checkpoints[ck], tp, pp) for name, (ck, tp, pp, _) in PIPELINES.items()
                 if tp * pp == world})
    jobs.update({f"gguf-{name}": (gguf_logits, path) for name, path in (ggufs or {}).items()})
    return jobs


@pytest.fixture(scope="module")
def two_ranks(checkpoints, layer_inputs, ggufs) -> dict[str, list]:
    return run_ranks(2, _jobs(2, checkpoints, layer_inputs, ggufs))


@pytest.fixture(scope="module")
def four_ranks(checkpoints, layer_inputs) -> dict[str, list]:
    return run_ranks(4, _jobs(4, checkpoints, layer_inputs))


def _ranks(request, world: int) -> dict[str, list]:
    return request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[world])


@pytest.mark.parametrize("name,tp", list(LAYER_CASES), ids=[f"{n}-tp{tp}" for n, tp in LAYER_CASES])
def test_sharded_layers_equal_the_whole_model(request, checkpoints, layer_inputs, name, tp):
    """Each decoder layer alone (its own input, so an error cannot hide in a later layer), then the
    whole model through the vocabulary-parallel embedding and the gathered LM head."""
    ranks = _ranks(request, tp)[f"layers-{name}"]
    full = load(checkpoints[name])
    positions = torch.arange(len(TOKENS))
    rope = rope_cos_sin(positions, full.inv_freq, torch.float32)
    with torch.inference_mode():
        expected = [layer(x, rope, DenseAttention((len(TOKENS),))) for layer, x in zip(full.layers, layer_inputs[name])]
        logits = full.logits(full(TOKENS, positions))
    assert [r["heads"][0] for r in ranks] == LAYER_CASES[name, tp]
    for rank in ranks:
        for i, (got, want) in enumerate(zip(rank["layers"], expected)):
            assert (got - want).abs().max() <= TOLERANCE, f"layer {i}"
        assert rank["logits"].shape == logits.shape
        assert (rank["logits"] - logits).abs().max() <= TOLERANCE
        assert torch.equal(rank["logits"].argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_and_tensor_parallel_logits_equal_the_whole_model(request, checkpoints, name):
    """Stages hand their hidden states on by send/recv (the earlier stage holds the extra layer); the
    last stage's logits are the whole model's: a tied table there is its own copy, GPT-2's learned
    positions are added on the first stage only and its row-parallel biases once."""
    ck, tp, pp, last = PIPELINES[name]
    ranks = _ranks(request, tp * pp)[name]
    full = load(checkpoints[ck])
    with torch.inference_mode():
        logits = full.logits(full(TOKENS, torch.arange(len(TOKENS))))
    layers = full.config.num_layers
    assert [r["layers"] for r in ranks] == [Shard.of_rank(i, tp, pp).layers(layers) for i in range(tp * pp)]
    assert ranks[-1]["layers"] == last
    for i, rank in enumerate(ranks):
        if Shard.of_rank(i, tp, pp).pp_rank < pp - 1:
            assert rank["logits"] is None
        else:
            assert (rank["logits"] - logits).abs().max() <= TOLERANCE
            assert torch.equal(rank["logits"].argmax(-1), logits.argmax(-1))


# --- what a rank reads and holds -----------------------------------------------------------------------


def _counted(path: Path, **kwargs):
    """A lazy checkpoint whose reads are counted by HF tensor name."""
    ckpt = read_checkpoint(path, lazy=True, **kwargs)
    reads = Counter()

    def counting(name, read):
        def counted():
            reads[name] += 1
            return read()
        return counted

    ckpt.tensors.readers = {name: counting(name, read) for name, read in ckpt.tensors.readers.items()}
    return ckpt, reads


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


@pytest.mark.parametrize("pp", [2, 3])
def test_a_stage_reads_only_its_own_layers(checkpoints, pp):
    ckpt_path = checkpoints["gqa_uneven"]
    layer_names = {n for n in read_checkpoint(ckpt_path, lazy=True).tensors if _layer_of(n) is not None}
    for shard in [Shard(r, 2, p, pp) for p in range(pp) for r in range(2)]:
        ckpt, reads = _counted(ckpt_path)
        model_from_checkpoint(ckpt, shard=shard)
        mine = shard.layers(3)
        assert {_layer_of(n) for n in reads} - {None} == set(mine)
        assert {n for n in layer_names if _layer_of(n) in mine} <= set(reads)  # all of its own, none other
        assert max(reads.values()) == 1  # each tensor read once, cut as it comes


def test_a_gguf_stage_reads_only_its_own_layers(ggufs):
    for pp_rank in range(2):
        ckpt, reads = _counted(ggufs["mixed"], keep_quantized=True)
        model_from_checkpoint(ckpt, shard=Shard(0, 2, pp_rank, 2))
        assert {_layer_of(n) for n in reads} - {None} == {pp_rank}
        assert max(reads.values()) == 1


def _linear_bytes(model) -> int:
    return sum(p.nbytes for name, p in model.named_parameters() if name.endswith("_proj.weight"))


@pytest.mark.parametrize("name", list(LLAMAS))
def test_a_tp_rank_holds_its_part_of_the_weights(checkpoints, name):
    full = model_from_checkpoint(read_checkpoint(checkpoints[name]))
    ranks = [model_from_checkpoint(read_checkpoint(checkpoints[name], lazy=True), shard=Shard(r, 2)) for r in (0, 1)]
    mine, whole = [_linear_bytes(m) for m in ranks], _linear_bytes(full)
    if name == "mqa":  # the one K/V head on both ranks: more than half each
        assert all(whole / 2 < m < whole for m in mine)
    else:
        assert sum(mine) == whole
    if name in ("mha", "gqa"):  # heads and features split evenly: half the model, plus the norms
        assert all(0.45 < m.weight_bytes() / full.weight_bytes() < 0.55 for m in ranks)


def test_a_tied_table_is_held_once_per_rank(checkpoints):
    full = model_from_checkpoint(read_checkpoint(checkpoints["mha"]))
    table = full.embed.weight
    for r, (a, b) in enumerate(split(full.config.vocab_size, 2)):
        model = model_from_checkpoint(read_checkpoint(checkpoints["mha"], lazy=True), shard=Shard(r, 2))
        assert model.lm_head.weight is model.embed.weight
        assert torch.equal(model.embed.weight, table[a:b])
        assert model.weight_bytes() == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
        parallelize(model, Shard(r, 2), TensorParallelGroup(None, 2, r))  # no collective runs here
        assert model.lm_head.weight is model.embed.weight
    last = model_from_checkpoint(read_checkpoint(checkpoints["mha"], lazy=True), shard=Shard(0, 1, 1, 2))
    assert last.embed is None and torch.equal(last.lm_head.weight, table)  # the last stage's own copy


def test_row_parallel_biases_are_added_by_rank_0_only(checkpoints):
    full = model_from_checkpoint(read_checkpoint(checkpoints["gpt2"]))
    for r in (0, 1):
        model = model_from_checkpoint(read_checkpoint(checkpoints["gpt2"], lazy=True), shard=Shard(r, 2))
        for whole, part in zip(full.layers, model.layers):
            for mine, theirs in ((part.attn.o_proj.bias, whole.attn.o_proj.bias),
                                 (part.mlp.down_proj.bias, whole.mlp.down_proj.bias)):
                assert torch.equal(mine, theirs if r == 0 else torch.zeros_like(theirs))
            a, b = split(full.config.intermediate_size, 2, feature_unit(full.config.intermediate_size, 2))[r]
            assert torch.equal(part.mlp.up_proj.bias, whole.mlp.up_proj.bias[a:b])


# --- quantized GGUF shards -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q8_0", "mixed"])
def test_gguf_shards_stay_quantized_and_match_tp1(two_ranks, ggufs, name):
    whole = load(ggufs[name])
    with torch.inference_mode():
        logits = whole.logits(whole(TOKENS, torch.arange(len(TOKENS))))
    assert whole.quantization != "none"
    for rank in two_ranks[f"gguf-{name}"]:
        assert rank["quantization"] == whole.quantization
        assert rank["linears"] == ["QuantLinear"] * 4
        # NOTE: the quantized kernels sum each shard's products in their own order
        assert (rank["logits"] - logits).abs().max() <= 1e-4
        assert torch.equal(rank["logits"].argmax(-1), logits.argmax(-1))


def test_a_column_cut_inside_a_quantization_group_is_served_dense():
    g = torch.Generator().manual_seed(0)
    for scheme in ("int4", "int8"):  # groups of 32 with offsets; one group per row, no offsets
        t = quantize_rtn(torch.randn(8, 128, generator=g), scheme)
        whole = t.dequantize()
        for a, b in ((0, 64), (32, 96), (16, 80), (0, 128)):
            part = _cols(t, a, b)
            on_groups = a % t.group_size == 0 and b % t.group_size == 0
            assert isinstance(part, QuantizedTensor) == on_groups
            assert torch.equal(part.dequantize() if on_groups else part, whole[:, a:b])
