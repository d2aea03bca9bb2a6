"""The engine's public surface: admission errors, the engine process (streaming, abort, death),
accounting, failures, CLI."""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from models import load_model, load_tokenizer
from server.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from server.engine.core_client import EngineCoreClient
from server.engine.errors import EngineDeadError


@pytest.fixture(scope="module")
def parts(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return path, load_model(path), load_tokenizer(path)


def make_engine(parts, **kw):
    cfg = dict(model="tiny", dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=parts[1], tokenizer=parts[2])


def test_prompt_longer_than_context_is_rejected(parts):
    engine = make_engine(parts, max_model_len=50)
    with pytest.raises(InvalidRequestError, match="prompt has 60 tokens but the model's context is 50"):
        engine.add_request("a", [5] * 60, SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"prompt \(40 tokens\) \+ max_tokens \(20\)") as e:
        engine.add_request("b", [5] * 40, SamplingParams(max_tokens=20))
    assert e.value.param == "max_tokens"
    assert not engine.has_unfinished()


def test_prompt_larger_than_the_kv_pool_is_rejected(parts):
    engine = make_engine(parts, num_blocks=8)  # 32 tokens in all
    with pytest.raises(InvalidRequestError, match="needs 10 KV blocks but the whole KV cache has 8"):
        engine.add_request("a", [5] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="token ids must be integers"):
        engine.add_request("b", [10**6], SamplingParams())
    with pytest.raises(InvalidRequestError, match="at least one token"):
        engine.add_request("c", [], SamplingParams())


def test_accounting_on_the_request(parts):
    engine = make_engine(parts)
    prompt = list(range(10, 31))  # 21 tokens
    engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stats = engine.generate([prompt + [1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0][0].stats
    assert stats.num_prompt_tokens == 22 and stats.num_output_tokens == 8
    assert stats.num_cached_tokens == 20  # five full blocks of the first prompt
    assert stats.peak_blocks == 8  # ceil((22 + 8 - 1) / 4): the last token's K/V is never computed
    assert stats.peak_kv_bytes == 8 * engine.kv_spec.bytes_per_block
    assert len(stats.inter_token_latencies) == 7
    assert 0 <= stats.queue_time <= stats.ttft <= stats.e2e_latency
    assert stats.prefill_time >= 0


def test_final_only_request_outputs_once_with_everything(parts):
    """A non-streaming request's one output equals its streamed outputs joined: tokens, text
    (stop strings included) and logprobs; no output before it finishes."""
    engine = make_engine(parts)
    prompt = list(range(10, 31))
    streamed_text = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0][0].text
    assert len(streamed_text) > 8
    stop = streamed_text[3:6]
    cases = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2, n=2, seed=3),
             SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])]
    for i, params in enumerate(cases):
        reference = engine.generate([prompt], params)[0]
        engine.add_request(f"f{i}", prompt, params, final_only=True)
        outputs = []
        while engine.has_unfinished():
            outputs.extend(engine.step())
        assert len(outputs) == params.n and all(o.finished for o in outputs)
        for out in outputs:
            ref = reference[out.index]
            assert out.new_token_ids == ref.token_ids and out.new_text == ref.text
            assert out.new_logprobs == ref.logprobs and out.finish_reason == ref.finish_reason
    assert outputs[0].finish_reason == "stop" and len(outputs[0].new_token_ids) < 12  # the stop-string case
    assert engine.kv.num_used_blocks == 0


def test_engine_process_streams_and_abort_frees_blocks(parts):
    client = EngineCoreClient(EngineConfig(model=str(parts[0]), dtype="float32", num_blocks=64, block_size=4,
                                           max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=True))
    assert client.pid != os.getpid() and client.is_alive
    greedy = dict(temperature=0, ignore_eos=True)

    def used_blocks():
        return client.stats.num_used_blocks

    async def settle():
        for _ in range(200):
            if used_blocks() == 0 and client.stats.num_unfinished_groups == 0:
                return
            await asyncio.sleep(0.01)

    async def main():
        chunks = [out async for out in client.generate(list(range(5, 25)), SamplingParams(max_tokens=6, **greedy))]
        assert [len(c.new_token_ids) for c in chunks] == [1] * 6 and chunks[-1].finished
        assert chunks[-1].finish_reason == "length" and chunks[-1].stats.num_output_tokens == 6

        stream = client.generate(list(range(5, 40)), SamplingParams(max_tokens=40, **greedy))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                assert used_blocks() > 0
                break  # a client that goes away
        await stream.aclose()
        await settle()
        assert used_blocks() == 0 and client.stats.num_unfinished_groups == 0

        # final_only: one output at the end; stats still flow while it runs
        client.slow_steps(0.02)
        whole = asyncio.ensure_future(_collect(client.generate(list(range(5, 25)), SamplingParams(max_tokens=30, **greedy),
                                                               final_only=True)))
        progress = set()
        while not whole.done():
            if client.stats.num_running:
                progress.add(client.stats.num_generated_tokens)
            await asyncio.sleep(0.01)
        client.slow_steps(0.0)
        [only] = whole.result()
        assert only.finished and len(only.new_token_ids) == 30 and len(progress) >= 2

        async def consume(i):
            return [o async for o in client.generate([7 + i] * (5 + i), SamplingParams(max_tokens=5, **greedy))]
        results = await asyncio.gather(*(consume(i) for i in range(8)))
        assert all(r[-1].finished and sum(len(o.new_token_ids) for o in r) == 5 for r in results)
        await settle()

    try:
        asyncio.run(main())
        assert used_blocks() == 0
        assert client.stats.num_adds_received == 11 and client.stats.num_generated_tokens >= 6 + 3 + 30
    finally:
        client.shutdown()
    assert client.process.poll() is not None and not client.is_alive


async def _collect(stream):
    return [out async for out in stream]


def test_killed_engine_process_ends_every_open_stream(parts):
    client = EngineCoreClient(EngineConfig(model=str(parts[0]), dtype="float32", num_blocks=64, block_size=4,
                                           enforce_eager=True))

    async def main():
        streams = [client.generate([5 + i] * 8, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
                   for i in range(4)]
        firsts = [await s.__anext__() for s in streams]
        assert all(not f.finished for f in firsts)
        client.process.kill()

        async def drain(s):
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
        await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=30)
        assert not client.is_alive
        with pytest.raises(EngineDeadError):
            client.generate([5], SamplingParams())

    try:
        asyncio.run(main())
    finally:
        client.shutdown()


def test_failed_step_fails_its_requests_and_engine_keeps_serving(parts):
    engine = make_engine(parts)
    real = engine.runner.submit
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(batch)
    engine.runner.submit = flaky
    engine.add_request("x", list(range(5, 15)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    outs = engine.step() + engine.step()
    final = outs[-1]
    assert final.finished and final.finish_reason == "error" and "injected fault" in final.error
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished()
    res = engine.generate([list(range(5, 15))], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert res[0][0].finish_reason == "length" and len(res[0][0].token_ids) == 5


def test_engine_does_not_import_ray():
    code = "import sys; import server.engine.core, server.engine.core_client; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_generate_json_in_input_order(parts, tmp_path):
    path, model, tok = parts
    prompts = ["The capital of France is", "0 1 2 3", "Simple is better than"]
    lines = [{"prompt": prompts[0]}, {"prompt_token_ids": tok(prompts[1])["input_ids"], "max_tokens": 3},
             {"prompt": prompts[2]}]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines))
    exe = os.path.join(os.path.dirname(sys.executable), "attnserve")
    res = subprocess.run([exe, "generate", "--model", str(path), "--prompt-file", str(f), "--max-tokens", "7",
                          "--ignore-eos", "--dtype", "float32", "--num-blocks", "64", "--json", "--enforce-eager"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [len(r["token_ids"]) for r in rows] == [7, 3, 7]
    engine = make_engine(parts)
    for r, p in zip(rows, prompts):
        ids = tok(p)["input_ids"]
        assert r["prompt_token_ids"] == ids
        expected = engine.generate([ids], SamplingParams(max_tokens=len(r["token_ids"]), temperature=0, ignore_eos=True))
        assert r["token_ids"] == list(expected[0][0].token_ids)
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True)
        assert r["finish_reason"] == "length"
