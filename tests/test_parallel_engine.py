"""A model sharded over Ray workers (tensor parallel, pipeline parallel, both) gives the greedy
tokens of the unsharded engine: with batching, preemption, chunked prefill and prefix hits, in
fp32 exactly and in bf16 up to a near-tie; the pipeline keeps micro-batches in flight; a worker
that dies ends the engine's steps with an error, never a hang."""
import functools
import os
import signal
import threading

import pytest

from models.parallel import Shard
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.executor import WorkerDiedError
from tests.reference import assert_greedy_close
from tests.tiny import mixed_prompts, train_tokenizer

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
# small pool, small token budget: requests are preempted and prompts prefilled in chunks
TIGHT = dict(block_size=4, num_blocks=48, kv_cache_memory=None, max_num_batched_tokens=32, max_num_seqs=8,
             enforce_eager=True, worker_cpus=0.25)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, variant_checkpoints):
    # llama: GQA 4 / 2 heads, tied embeddings, sharded files; gemma2: sliding-window and global layers, soft-caps
    return {"llama": tiny_checkpoints["llama"], "gemma2": variant_checkpoints["gemma2"]}


@pytest.fixture(scope="module")
def prompts():
    tok = train_tokenizer()
    mixed = mixed_prompts(tok, 10, seed=3, max_len=60)
    shared = mixed[-1][:40]  # NOTE: full blocks of a prompt seen before: prefix hits
    return mixed + [shared + p[:5] for p in mixed[:4]]


def reference(path, prompts, dtype="float32"):
    """The unsharded engine's outputs: computed once per model, prompts and dtype."""
    return _reference(str(path), tuple(map(tuple, prompts)), dtype)


@functools.cache
def _reference(path: str, prompts: tuple, dtype: str):
    engine = LLMEngine(EngineConfig(model=path, dtype=dtype, block_size=4, num_blocks=512,
                                    kv_cache_memory=None, enforce_eager=True))
    return [g[0] for g in engine.generate([list(p) for p in prompts], GREEDY)]


def check(engine, prompts, expected):
    results = [g[0] for g in engine.generate(prompts, GREEDY)]
    for ours, theirs in zip(results, expected):
        if engine.config.dtype == "float32":
            assert ours.token_ids == theirs.token_ids
        else:
            assert_greedy_close(list(ours.token_ids), [dict(lp.top) for lp in ours.logprobs],
                                list(theirs.token_ids), [dict(lp.top) for lp in theirs.logprobs])
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_hits > 0 and engine.scheduler.num_partial_prefills > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.in_flight


# CI: GQA Llama at TP=2 and at PP=2, Gemma 2 (windows, soft-caps) at TP=2 x PP=2 (both paths over
# its grouped pool); the other three pairs are exhaustive (make test-all)
SHARDED = [pytest.param(arch, tp, pp, id=f"{arch}-{tp}-{pp}", marks=[] if (arch, tp, pp) in
                        {("llama", 2, 1), ("llama", 1, 2), ("gemma2", 2, 2)} else [pytest.mark.exhaustive])
           for arch in ("llama", "gemma2") for tp, pp in ((2, 1), (1, 2), (2, 2))]


@pytest.mark.parametrize("arch,tp,pp", SHARDED)
def test_sharded_greedy_equals_unsharded(arch, tp, pp, checkpoints, prompts, ray_session):
    expected = reference(checkpoints[arch], prompts)
    engine = LLMEngine(EngineConfig(model=str(checkpoints[arch]), dtype="float32", tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp, **TIGHT))
    try:
        info = engine.info
        assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (tp, pp)
        assert len({w.pid for w in info.workers}) == tp * pp  # one process per rank
        assert {w.collectives for w in info.workers} == {"shm" if tp > 1 else "none"}  # one node: shared memory
        for w in info.workers:
            layers = Shard(w.tp_rank, tp, w.pp_rank, pp).layers(engine.model_config.num_layers)
            assert w.layers == (layers.start, layers.stop)
        assert sum(w.num_heads for w in info.workers) == engine.model_config.num_heads * pp
        check(engine, prompts, expected)
    finally:
        engine.executor.shutdown()


# NOTE: CI's case is PP=2, whose stages compile graphs of their own (the first without the head, the
# last without the embedding); TP's collectives inside a compiled graph are test_shm_comm's. Each worker
# compiles in a process of its own: at TP=2 x PP=2 four cold compiles on two cores took ~100 s.
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [pytest.param(2, 1, marks=pytest.mark.exhaustive), (1, 2),
                                   pytest.param(2, 2, marks=pytest.mark.exhaustive)])
def test_bf16_compiled_sharded(tp, pp, checkpoints, prompts, ray_session):
    expected = reference(checkpoints["llama"], prompts, "bfloat16")
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), dtype="bfloat16", tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp, **{**TIGHT, "enforce_eager": False}))
    try:
        assert engine.runner.step == "compiled"
        check(engine, prompts, expected)
    finally:
        engine.executor.shutdown()


def test_pipeline_keeps_micro_batches_in_flight(checkpoints, prompts, ray_session):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), dtype="float32", pipeline_parallel_size=2,
                                    **TIGHT))
    try:
        seen, submit = [], engine.runner.submit

        def counting(batch):
            seen.append(len(engine.in_flight))  # steps already in flight when this one starts
            return submit(batch)
        engine.runner.submit = counting
        check(engine, prompts, reference(checkpoints["llama"], prompts))
        assert max(seen) == 1  # two steps in flight: one per stage
    finally:
        engine.executor.shutdown()


def test_dead_worker_fails_the_step_not_hangs(checkpoints, prompts, ray_session):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), dtype="float32", tensor_parallel_size=2,
                                    **TIGHT))
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        engine.step()
        os.kill(engine.info.workers[1].pid, signal.SIGKILL)
        raised = []

        def steps():
            try:
                while engine.has_unfinished():
                    engine.step()
            except WorkerDiedError as e:
                raised.append(e)
        t = threading.Thread(target=steps, daemon=True)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "a step hung on the dead worker"
        assert raised  # WorkerDiedError: the engine process then exits and Serve restarts the replica
    finally:
        engine.executor.shutdown()


def test_default_model_tensor_parallel_runs_native(default_model_dir, ray_session):
    """The shipped Q4_1 model at TP=2: each rank runs the native decoder (the all-reduces called from
    C++ through shared memory) on its shard of the quantized codes; fp32, greedy tokens as TP=1's up
    to a near-tie (the ranks' partial sums add in another order)."""
    from models.corpus import corpus_words
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    words = corpus_words()
    prompts = [tok(" ".join(words[i:i + n]))["input_ids"] for i, n in ((0, 8), (300, 60), (900, 25))]
    config = dict(model="default", dtype="float32", num_blocks=128, kv_cache_memory=None)
    expected = [g[0] for g in LLMEngine(EngineConfig(**config)).generate(prompts, GREEDY)]
    engine = LLMEngine(EngineConfig(**config, tensor_parallel_size=2, worker_cpus=0.25))
    try:
        assert engine.runner.step == "native" and {w.collectives for w in engine.info.workers} == {"shm"}
        assert engine.info.quantization == "Q4_1+Q8_0"
        ranks = engine.info.workers
        assert abs(ranks[0].weight_bytes - ranks[1].weight_bytes) < 0.2 * ranks[0].weight_bytes  # ~half each
        for ours, theirs in zip((g[0] for g in engine.generate(prompts, GREEDY)), expected):
            assert_greedy_close(list(ours.token_ids), [dict(lp.top) for lp in ours.logprobs],
                                list(theirs.token_ids), [dict(lp.top) for lp in theirs.logprobs])
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        engine.executor.shutdown()
