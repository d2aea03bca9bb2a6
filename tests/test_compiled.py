"""The compiled model step (and the native decoder): the same greedy tokens as the eager one on the
default model, and one graph for every step shape. That a new process loads the compiled step from
the disk cache is tests/test_bench_engine.py's: its --startup run counts inductor's hits and misses."""
from pathlib import Path

import pytest

from models import load_tokenizer
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.compilation import compiled_graphs
from tests.reference import assert_greedy_close

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a careful assistant for a theatre company. Answer in one short paragraph, name the play "
          "and the act when you can, and never invent a quotation you are not sure of.")
QUESTIONS = ["Who is Hamlet's father?", "Where does Macbeth meet the witches?", "What is the capital of France?",
             "Why does Juliet drink the potion?", "Name two of King Lear's daughters.", "Who kills Tybalt?"]


def chat(tok, question):
    return tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


# CI: the native decoder (the step the default model serves on) in fp32. Exhaustive (make test-all):
# the compiled step on the default model, whose graph over Q4_1 linears is
# tests/test_quantized_greedy.py's gguf-compiled-* on a tiny GGUF, and bf16, whose native decoder and
# compiled step over GGUF codes are that file's gguf-{native,compiled}-bfloat16
STEPS = [pytest.param("float32", "native", id="float32-native"),
         *(pytest.param(dtype, step, id=f"{dtype}-{step}", marks=pytest.mark.exhaustive)
           for dtype, step in (("float32", "compiled"), ("bfloat16", "native"), ("bfloat16", "compiled")))]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,step", STEPS)
def test_compiled_and_eager_give_the_same_greedy_tokens(default_model_dir, dtype, step):
    """A batch that hits the prefix cache and, with a small KV pool, preempts; through the compiled step
    or the native decoder (server/engine/native_decoder.py: the default model's Q4_1 layers) against eager.
    fp32: identical tokens. bf16: fused kernels sum their reductions in another order, so a bf16 ulp can
    flip a near-tie; tokens are identical up to a first difference that must be a near-tie both ways.
    fp32 runs exact activations: with int8 ones (auto's choice for the Q4_1 layers on x86) a last-bit
    difference in a sum's order flips an input's rounding to int8 (tests/test_native_decoder.py)."""
    tok = load_tokenizer(default_model_dir)
    warm, prompts = chat(tok, QUESTIONS[0]), [chat(tok, q) for q in QUESTIONS[1:]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    outputs, engines = {}, {}
    for kind in ("eager", step):
        engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype=dtype, num_blocks=14, block_size=16,
                                        max_num_batched_tokens=256, enforce_eager=kind == "eager",
                                        native_decoder=kind == "native",
                                        activations="exact" if dtype == "float32" else "auto"))
        assert engine.runner.step == kind
        engine.generate([warm], params)  # its prompt's blocks stay cached: the batch shares the system prompt
        outputs[kind] = [r[0] for r in engine.generate(prompts, params)]
        engines[kind] = engine
    for ours, eager in zip(outputs[step], outputs["eager"]):
        if dtype == "float32":
            assert ours.token_ids == eager.token_ids, step
        else:
            assert_greedy_close(list(ours.token_ids), [dict(lp.top) for lp in ours.logprobs],
                                list(eager.token_ids), [dict(lp.top) for lp in eager.logprobs], f"{step} vs eager")
    for engine in engines.values():
        assert engine.scheduler.num_prefix_hits >= len(prompts) * 32 and engine.scheduler.num_preemptions > 0
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engines["eager"].runner.forward is engines["eager"].model  # eager: the module itself
    assert engines[step].runner.forward is not engines[step].model


def test_one_graph_serves_every_step_shape(tiny_checkpoints):
    """After warm-up no step compiles again: batch-1 decode, prefill chunks, mixed batches,
    prefix hits and block tables of any width all run the graph compiled at start."""
    from models import load_model

    path = tiny_checkpoints["qwen2"]
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_blocks=128, block_size=4,
                                    max_num_batched_tokens=24, max_num_seqs=8),
                       model=load_model(path), tokenizer=load_tokenizer(path))
    before = compiled_graphs()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.generate([[5]], params)  # a one-token prompt, then batch-1 decodes
    engine.generate([list(range(3, 60))], params)  # chunked prefill: 57 tokens over a 24-token budget
    engine.generate([[7] * n for n in (1, 2, 9, 30, 4)], params)  # mixed decodes and prefill chunks
    engine.generate([list(range(3, 60)) + [9, 9]], params)  # a prefix hit: a chunk over cached blocks
    assert engine.scheduler.num_prefix_hits > 0 and engine.scheduler.num_partial_prefills > 0
    assert compiled_graphs() == before
