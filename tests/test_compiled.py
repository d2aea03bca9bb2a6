"""The compiled model step (and the native decoder): the same greedy tokens as the eager one on the
default model, one graph for every step shape, and a new process that loads it from the disk cache."""
import json
import os
import subprocess
import sys
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


# bf16 is exhaustive (make test-all): the compiled step and the native decoder over GGUF codes in bf16
# are tests/test_quantized_greedy.py's gguf-{native,compiled}-bfloat16 cases
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.exhaustive)])
def test_compiled_and_eager_give_the_same_greedy_tokens(default_model_dir, dtype):
    """A batch that hits the prefix cache and, with a small KV pool, preempts; through the compiled step
    and the native decoder (models/native_decoder.py: the default model's Q4_1 layers) against eager.
    fp32: identical tokens. bf16: fused kernels sum their reductions in another order, so a bf16 ulp can
    flip a near-tie; tokens are identical up to a first difference that must be a near-tie both ways."""
    tok = load_tokenizer(default_model_dir)
    warm, prompts = chat(tok, QUESTIONS[0]), [chat(tok, q) for q in QUESTIONS[1:]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    outputs, engines = {}, {}
    for step in ("eager", "compiled", "native"):
        engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype=dtype, num_blocks=14, block_size=16,
                                        max_num_batched_tokens=256, enforce_eager=step == "eager",
                                        native_decoder=step == "native"))
        assert engine.runner.step == step
        engine.generate([warm], params)  # its prompt's blocks stay cached: the batch shares the system prompt
        outputs[step] = [r[0] for r in engine.generate(prompts, params)]
        engines[step] = engine
    for step in ("compiled", "native"):
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
    assert engines["compiled"].runner.forward is not engines["compiled"].model


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


def test_a_new_process_loads_the_compiled_step_from_the_disk_cache(tiny_checkpoints, tmp_path):
    code = ("import json, torch\n"
            "from torch._dynamo.utils import counters\n"
            "from server.engine import EngineConfig, LLMEngine\n"
            f"e = LLMEngine(EngineConfig(model={str(tiny_checkpoints['llama'])!r}, dtype='float32', num_blocks=16))\n"
            "print(json.dumps({k: counters['inductor'][k] for k in ('fxgraph_cache_hit', 'fxgraph_cache_miss')}))\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["fxgraph_cache_miss"] >= 1 and runs[0]["fxgraph_cache_hit"] == 0  # cold: compiled
    assert runs[1]["fxgraph_cache_hit"] >= 1 and runs[1]["fxgraph_cache_miss"] == 0  # warm: loaded
    assert any((tmp_path / "inductor").iterdir())
