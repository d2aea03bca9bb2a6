"""The LoRA delta inside every model step: a packed batch of base rows and rows of several adapters gives
each row PEFT's logits (fp32) on the eager, compiled and native steps, base rows the base model's, and a
step with no adapter row runs no LoRA code."""
from __future__ import annotations

import pytest
import torch

from kvcache.paged_attention import AttentionMetadata, PagedAttention
from kvcache.storage import KVCacheSpec, PagedKVCache
from models import load_model, load_tokenizer
from models.attention import DenseAttention
from models.loader import load_for_serving
from models.lora import LoraMetadata, LoraSlots, LoraStep, lora_shapes
from models.lora_format import read_adapter
from models.parallel import Shard, TensorParallelGroup, parallelize
from server.engine.compilation import compiled_graphs
from server.engine.model_runner import ModelRunner
from server.engine.native_decoder import NativeDecoder
from server.engine.request import Request
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import ScheduledSeq, SchedulerOutput
from tests.lora_helpers import make_adapter, peft_model
from tests.reference import load_hf
from tests.test_quantized_greedy import rtn_reference

PROMPTS = ["The capital of France is", "Beautiful is better than ugly. Explicit is", "0 1 2 3",
           "Keys and values are cached in blocks", "A step with no adapter row runs no LoRA code"]
BLOCK = 4


def slots_of(model, adapters: dict) -> LoraSlots:
    """Slots 0.. hold `adapters` in order; one slot stays empty."""
    slots = LoraSlots(lora_shapes(model.config, len(adapters) + 1, 16), model.dtype)
    for slot, path in enumerate(adapters.values()):
        slots.install(slot, read_adapter(str(path)))
    return slots


def oracle_logits(models: list, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's logits (len, V) from its own HF or PEFT model, concatenated."""
    with torch.no_grad():
        return torch.cat([m(torch.tensor([p])).logits[0] for m, p in zip(models, prompts)])


@pytest.fixture(scope="module")
def qwen2_adapter(tiny_checkpoints, tmp_path_factory):
    """q/k/v biases under an adapter on all 7 modules."""
    return make_adapter(tiny_checkpoints["qwen2"], tmp_path_factory.mktemp("lora-qwen2") / "all8", seed=3,
                        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_packed_batch_gives_each_row_its_adapters_logits(arch, tiny_checkpoints, lora_adapters, qwen2_adapter):
    """The eager model (plain linears) over a dense packed batch: base rows, then one prompt per adapter."""
    path = tiny_checkpoints[arch]
    adapters = dict(lora_adapters) if arch == "llama" else {"all8": qwen2_adapter}
    model, tok = load_model(path, "float32"), load_tokenizer(path)
    slots = slots_of(model, adapters)
    names = [None, *adapters, None]
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:len(names)]]
    lens = tuple(len(p) for p in prompts)
    flat, positions = torch.tensor([t for p in prompts for t in p]), torch.cat([torch.arange(n) for n in lens])
    meta = LoraMetadata.of([None if n is None else list(adapters).index(n)
                            for n, k in zip(names, lens) for _ in range(k)])
    with torch.inference_mode():
        plain = model.compute_logits(model(flat, positions, DenseAttention(lens)))
        ours = model.compute_logits(model(flat, positions, DenseAttention(lens), lora=LoraStep(slots, meta)))
    base = load_hf(path)
    expected = oracle_logits([base if n is None else peft_model(path, adapters[n]) for n in names], prompts)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    starts = torch.tensor((0, *lens)).cumsum(0).tolist()
    for i, n in enumerate(names):
        rows = slice(starts[i], starts[i + 1])
        if n is None:  # base rows: what the model computes without LoRA, bit for bit
            assert torch.equal(ours[rows], plain[rows])
        else:  # the adapter moved them
            assert (ours[rows] - plain[rows]).abs().max() > 0.1, n


def schedule(reqs: list[Request], computed: list[int], tables: list[list[int]]) -> SchedulerOutput:
    return SchedulerOutput(tuple(ScheduledSeq(r, r.num_tokens - c, c, (tuple(t),))
                                 for r, c, t in zip(reqs, computed, tables)))


def runner_setup(step: str, tiny_checkpoints, lora_adapters, tmp_path_factory):
    """(our model for `step`, the HF checkpoint of the weights it computes with): the native decoder runs
    int8 RTN codes (PEFT then runs on their dequantized copy), the others the fp32 weights."""
    llama = tiny_checkpoints["llama"]
    if step != "native":
        return load_for_serving(llama, dtype="float32", quantization="none"), llama
    model = load_for_serving(llama, dtype="float32", quantization="int8", activations="exact")
    return model, rtn_reference(llama, "int8", tmp_path_factory.mktemp("lora-rtn") / "int8")


@pytest.mark.parametrize("step", ["eager", "compiled", "native"])
def test_runner_steps_mix_adapters_and_base_rows(step, tiny_checkpoints, lora_adapters, tmp_path_factory):
    """ModelRunner over the paged pool: a prefill of base and adapter rows, then decodes (the K/V written
    under each adapter is read back), then a step of base rows only, which calls the model without `lora`.
    Compiled: both graphs compile at start and no step compiles again."""
    model, reference = runner_setup(step, tiny_checkpoints, lora_adapters, tmp_path_factory)
    cfg, tok = model.config, load_tokenizer(tiny_checkpoints["llama"])
    slots = slots_of(model, lora_adapters)
    cache = PagedKVCache(KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, BLOCK), 64)
    runner = ModelRunner(model, cache, compile=step != "eager", native=step == "native", lora_slots=slots)
    assert runner.step == step
    graphs = compiled_graphs()
    calls: list[dict] = []
    forward = runner.forward
    runner.forward = lambda *args, **kw: calls.append(kw) or forward(*args, **kw)

    names = [None, "all8", "attn4", "mlp16", None]
    reqs = []
    for i, (name, prompt) in enumerate(zip(names, PROMPTS)):
        req = Request(f"r{i}", tok(prompt)["input_ids"], SamplingParams(max_tokens=4, temperature=0), None)
        req.lora_slot = None if name is None else list(lora_adapters).index(name)
        reqs.append(req)
    sizes = [-(-(r.num_tokens + 3) // BLOCK) for r in reqs]  # the prompt and 3 more tokens
    tables = [list(range(sum(sizes[:i]), sum(sizes[:i + 1]))) for i in range(len(reqs))]
    base = load_hf(reference)
    models = [base if n is None else peft_model(reference, lora_adapters[n]) for n in names]
    tol = 1e-4 if step != "native" else 1e-3  # native: int8 codes, summed in another order than HF's dequantized
    computed = [0] * len(reqs)
    for n in range(3):  # the prefill, then two decodes (the first leaves a base request out)
        scheduled = [i for i in range(len(reqs)) if (n, i) != (1, 0)]
        batch = runner.prepare(schedule([reqs[i] for i in scheduled], [computed[i] for i in scheduled],
                                        [tables[i] for i in scheduled]))
        assert batch.lora is not None and batch.lora.seg_slot.tolist() == [0, 1, 2]
        logits = runner.submit(batch).logits  # (R, V): each request's last row
        expected = oracle_logits([models[i] for i in scheduled], [reqs[i].all_token_ids for i in scheduled])
        last = torch.tensor([len(reqs[i].all_token_ids) for i in scheduled]).cumsum(0) - 1
        torch.testing.assert_close(logits.float(), expected[last], atol=tol, rtol=tol)
        assert "lora" in calls[-1]
        for i, row in zip(scheduled, logits.argmax(-1).tolist()):
            computed[i] = reqs[i].num_tokens
            reqs[i].all_token_ids.append(row)

    base_only = [0, 4]  # no adapter row: no LoRA code runs
    batch = runner.prepare(schedule([reqs[i] for i in base_only], [computed[i] for i in base_only],
                                    [tables[i] for i in base_only]))
    assert batch.lora is None
    logits = runner.submit(batch).logits
    assert calls[-1] == {}
    expected = oracle_logits([base, base], [reqs[i].all_token_ids for i in base_only])
    last = torch.tensor([len(reqs[i].all_token_ids) for i in base_only]).cumsum(0) - 1
    torch.testing.assert_close(logits.float(), expected[last], atol=tol, rtol=tol)
    assert compiled_graphs() == graphs  # warm-up compiled both graphs (nothing compiles for eager or native)


def test_the_native_decoder_adds_the_deltas_where_the_model_does(tiny_checkpoints, lora_adapters):
    """bf16 with bf16 slots and int8 activations: the C++ layer loop calls the same delta op at the same
    places (q/k/v before RoPE, o before the residual, gate|up before SwiGLU, down), so it rounds as eager."""
    model = load_for_serving(tiny_checkpoints["llama"], dtype="bfloat16", quantization="int8", activations="int8")
    cfg = model.config
    slots = slots_of(model, lora_adapters)
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, BLOCK)
    ids = torch.arange(5, 23)  # (18,): four sequences of 6, 4, 5 and 3 tokens
    lens = [6, 4, 5, 3]
    meta = AttentionMetadata.build(lens, [0] * 4, [[0, 1], [2], [3, 4], [5]], BLOCK)
    lora = LoraStep(slots, LoraMetadata.of([s for s, n in zip([2, None, 0, 1], lens) for _ in range(n)]))
    decoder, positions = NativeDecoder(model, slots), torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        native, eager, plain = (forward(ids, positions, PagedAttention(PagedKVCache(spec, 8), meta), **kw)
                                for forward, kw in ((decoder, {"lora": lora}), (model, {"lora": lora}), (decoder, {})))
    assert (native == eager).float().mean() > 0.99, (native == eager).float().mean()
    assert torch.equal(native[6:10], plain[6:10])  # the base sequence's rows
    assert all((native[a:b] - plain[a:b]).abs().max() > 0.1 for a, b in ((0, 6), (10, 15), (15, 18)))
    with pytest.raises(ValueError, match="not built with"):
        NativeDecoder(model)(ids, torch.arange(18), PagedAttention(PagedKVCache(spec, 8), meta), lora=lora)


def test_lora_with_tensor_parallelism_is_refused(tiny_checkpoints, lora_adapters):
    """A rank's linears hold its shard's features, the slots whole adapters: refused, not wrong."""
    model = load_model(tiny_checkpoints["llama"], "float32")
    slots = slots_of(model, lora_adapters)
    parallelize(model, Shard(0, 2), TensorParallelGroup(None, 2, 0))
    with pytest.raises(ValueError, match="tensor parallelism"), torch.inference_mode():
        model(torch.arange(4), torch.arange(4), lora=LoraStep(slots, LoraMetadata.of([0] * 4)))
