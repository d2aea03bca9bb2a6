"""`attnserve` command line: convert (and, as they land, generate / serve / loadtest)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time

from models.corpus import HELD_OUT_PLAY, held_out_text
from models.native.cpu_features import apply_isa_cap
from models.native.cpu_path import ACTIVATIONS, DTYPES, QUANTIZATIONS
from server import eval_results
from server.engine.config import KV_CACHE_DTYPES, SCHEDULING_POLICIES, EngineConfig, parse_size
from server.engine.pooling import POOLING_CHOICES, TASKS
from server.kv_forms import KV_CURVE_LENGTHS
from server.metrics import fresh
from server.reasoning import CHOICES as REASONING_PARSERS

APP_NAME = "attnserve"


def _convert(args: argparse.Namespace) -> int:
    from models.kv_heads import convert  # noqa: PLC0415 - torch, after the ISA cap
    from models.loader import parse_dtype  # noqa: PLC0415 - torch, after the ISA cap
    from models.registry import resolve_model  # noqa: PLC0415 - torch, after the ISA cap

    dtype = parse_dtype(args.dtype) if args.dtype else None
    out = convert(resolve_model(args.model), args.kv_heads, args.out, dtype=dtype)
    print(f"wrote {out}")
    return 0


def _read_prompts(args: argparse.Namespace, tokenizer) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per input, in order."""

    def encode(text: str) -> list[int]:
        if args.chat:
            return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
        return tokenizer(text)["input_ids"]

    if args.prompt is not None:
        return [(encode(args.prompt), args.max_tokens)]
    out = []
    with open(args.prompt_file) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if "prompt_token_ids" in item:
                ids = [int(t) for t in item["prompt_token_ids"]]
            elif "prompt" in item:
                ids = encode(item["prompt"])
            else:
                raise ValueError(f"{args.prompt_file}:{lineno}: need 'prompt' or 'prompt_token_ids'")
            out.append((ids, int(item.get("max_tokens", args.max_tokens))))
    return out


def _engine_config(args: argparse.Namespace, model: str = "default"):

    return EngineConfig(
        model=model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        quantization=args.quantization, activations=args.activations, memory_budget=args.memory_budget,
        kv_cache_memory=None if args.num_blocks else args.kv_cache_memory, num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, num_threads=args.threads, enforce_eager=args.enforce_eager,
        max_waiting=getattr(args, "max_waiting", None), scheduling_policy=args.scheduling_policy,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        worker_cpus=args.worker_cpus, reasoning_parser=args.reasoning_parser, reasoning_budget=args.reasoning_budget,
        task=args.task, pooling=args.pooling, embed_normalize=args.embed_normalize,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
    )


def _generate(args: argparse.Namespace) -> int:

    import torch  # noqa: PLC0415 - torch, after the ISA cap

    from server.engine import LLMEngine, SamplingParams  # noqa: PLC0415 - torch, after the ISA cap

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(_engine_config(args, args.model))
    prompts = _read_prompts(args, engine.tokenizer)
    params = [SamplingParams(max_tokens=m, temperature=args.temperature, seed=args.seed, top_p=args.top_p,
                             top_k=args.top_k, ignore_eos=args.ignore_eos) for _, m in prompts]
    results = engine.generate([p for p, _ in prompts], params)
    for i, ((prompt, _), group) in enumerate(zip(prompts, results)):
        r = group[0]
        if args.json:
            spec = {"speculative": {"drafted": r.stats.num_draft_tokens, "accepted": r.stats.num_accepted_tokens}} \
                if engine.spec is not None else {}
            print(json.dumps({"index": i, "prompt_token_ids": prompt, "token_ids": list(r.token_ids),
                              "text": r.text, "finish_reason": r.finish_reason, **spec}), flush=True)
        else:
            print(r.text, flush=True)
    return 0


# kv_bytes_per_token is a token of every layer; kv_bytes_per_token_at per token of a sequence of 1k / 8k / 32k
# tokens in 16-token blocks (server/kv_forms.py), less than that with sliding-window layers
EVAL_KEYS = ("model", "attention", "kv_heads", "kv_cache_dtype", "kv_bytes_per_token", "kv_bytes_per_token_at",
             "quantization", "activations", "weight_bytes", "perplexity")


def _eval(args: argparse.Namespace) -> int:
    """Perplexity against KV bytes per token and weight bytes, one row per model (e.g. a model's MHA / GQA /
    MQA forms) and weight quantization. Per model the window is capped at its max_position_embeddings and
    the stride at the window - 1 (models.perplexity.window_and_stride), so every token but the first is
    scored exactly once, each with at least one token of context."""

    import torch  # noqa: PLC0415 - torch, after the ISA cap

    from kvcache.paged_attention import PagedAttention  # noqa: PLC0415 - torch, after the ISA cap
    from kvcache.quant import dtype_name, kv_cache_dtype, scales_for  # noqa: PLC0415 - torch, after the ISA cap
    from kvcache.storage import KVCacheSpec, PagedKVCache  # noqa: PLC0415 - torch, after the ISA cap
    from models.loader import load_for_serving  # noqa: PLC0415 - torch, after the ISA cap
    from models.perplexity import perplexity, window_and_stride  # noqa: PLC0415 - torch, after the ISA cap
    from models.registry import resolve_model  # noqa: PLC0415 - torch, after the ISA cap
    from models.tokenizer import load_tokenizer  # noqa: PLC0415 - torch, after the ISA cap

    try:
        window_and_stride(args.window, args.stride)
    except ValueError as e:
        print(f"{APP_NAME} eval: error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    text = open(args.text, encoding="utf-8").read() if args.text else held_out_text()
    rows = []
    runs = [(name, q) for name in args.model or ["default"] for q in dict.fromkeys(args.quantization)]
    for name, quantization in runs:
        path = resolve_model(name)
        model = load_for_serving(path, args.dtype, quantization=quantization, activations=args.activations)
        cfg = model.config
        tokenizer = load_tokenizer(path)
        ids = tokenizer(text)["input_ids"]
        kv_dtype = kv_cache_dtype(args.kv_cache_dtype, model.dtype)
        spec = KVCacheSpec.of(cfg, kv_dtype)  # with the model's sliding windows
        # each window is one prompt through a pool of the serving dtype and kernel, so an
        # 8-bit cache's rounding is in the score
        try:
            window, stride = window_and_stride(args.window, args.stride, cfg.max_position_embeddings)
        except ValueError as e:
            print(f"{APP_NAME} eval: error: {name}: {e}", file=sys.stderr)
            return 2
        if (window, stride) != (args.window, args.stride):
            print(f"{name}: window {window}, stride {stride} (the model has {cfg.max_position_embeddings} "
                  "positions; the stride stays below the window)", file=sys.stderr, flush=True)
        num_blocks = -(-window // spec.block_size)
        cache = PagedKVCache(spec, num_blocks, model.device, scales_for(model, kv_dtype, tokenizer))
        ppl = perplexity(model, ids, window, stride, lambda n, cache=cache: PagedAttention.one_sequence(cache, n))
        # the row carries the weights' format as loaded (model.quantization: e.g. auto -> a GGUF's types)
        rows.append({"model": name, "attention": cfg.attention_kind, "kv_heads": cfg.num_kv_heads,
                     "kv_cache_dtype": dtype_name(kv_dtype), "kv_bytes_per_token": spec.bytes_per_token,
                     "kv_bytes_per_token_at": {str(n): spec.bytes_for(n) / n for n in KV_CURVE_LENGTHS},
                     "quantization": model.quantization, "activations": model.cpu_path.activations,
                     "weight_bytes": model.weight_bytes(), "perplexity": ppl})
        print(f"{name} ({model.quantization}, activations {model.cpu_path.activations}): {len(ids)} tokens, "
              f"perplexity {rows[-1]['perplexity']:.4f}",
              file=sys.stderr, flush=True)
        compute_dtype = model.cpu_path.dtype
        del model, cache  # one model's weights at a time
    source = args.text or f"{HELD_OUT_PLAY} (held out)"
    print(f"text: {source}; window {args.window}, stride {args.stride} (at most the model's positions, and the "
          f"window - 1), dtype {compute_dtype}")
    print(f"{'model':40} {'attention':9} {'kv heads':>8} {'kv dtype':>9} {'kv B/token':>10} {'at 8k':>9} "
          f"{'at 32k':>9} {'weights':>12} {'activations':>16} {'weight bytes':>13} {'perplexity':>11}")
    for r in rows:
        at = r["kv_bytes_per_token_at"]
        print(f"{r['model']:40} {r['attention']:9} {r['kv_heads']:8d} {r['kv_cache_dtype']:>9} "
              f"{r['kv_bytes_per_token']:10d} {at['8192']:9.0f} {at['32768']:9.0f} {r['quantization']:>12} "
              f"{r['activations']:>16} {r['weight_bytes']:13d} {r['perplexity']:11.4f}")
    rows = [{k: r[k] for k in EVAL_KEYS} for r in rows]
    print(f"rows kept for the dashboard in {eval_results.save(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def _parse_models(specs: list[str] | None) -> dict[str, str]:
    models: dict[str, str] = {}
    for spec in specs or ["default=default"]:
        name, _, source = spec.partition("=")
        if not source:  # a bare path or name: serve it under its own (base)name
            name, source = os.path.basename(os.path.normpath(spec)), spec
        models[name] = source
    return models


def _parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """--lora-modules NAME=PATH ...: adapters of the served model."""
    modules: dict[str, str] = {}
    for spec in specs or []:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, not {spec!r}")
        modules[name] = path
    return modules


# A cluster `attnserve serve` starts for itself shares the machine's cores with the engine. Serve's controller
# loops every 0.1 s by default: on an idle app it took 3.4% of a core and the GCS it calls 2.1% (AMX Xeon, 2
# cores; 15% for all of Ray's processes), and decode steps beside that app ran 11-15% slower. Every 0.5 s they
# take 1.3-1.5% and 0.8-1.1%; Serve then reacts (deploys, scales, replaces replicas) up to 0.4 s later.
LOCAL_CLUSTER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def _serve(args: argparse.Namespace) -> int:

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local clusters; keeps `serve status` working
    if args.address is None:  # NOTE: before ray.init starts the cluster's processes, which inherit it
        for key, value in LOCAL_CLUSTER_ENV.items():
            os.environ.setdefault(key, value)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray  # noqa: PLC0415 - Ray
    from ray import serve  # noqa: PLC0415 - Ray

    from models.lora_format import read_adapter  # noqa: PLC0415 - after the ISA cap, as the rest
    from server.deployment import (  # noqa: PLC0415 - Ray
        STATE_NAMESPACE,
        build_app,
        required_cpus,
        state_name,
    )
    from server.openai_api import ApiLimits  # noqa: PLC0415 - FastAPI, pydantic
    from server.serve_config import ServeConfig  # noqa: PLC0415 - FastAPI, pydantic

    autoscaling = None
    if args.autoscale:
        lo, _, hi = args.autoscale.partition(":")
        autoscaling = {"min_replicas": int(lo), "max_replicas": int(hi or lo)}
    cfg = ServeConfig(
        models=_parse_models(args.model), engine=_engine_config(args), num_replicas=args.replicas,
        autoscaling=autoscaling, max_ongoing_requests=args.max_ongoing_requests, num_cpus=args.num_cpus,
        num_gpus=args.num_gpus, api_key=args.api_key, graceful_shutdown_timeout_s=args.drain_timeout,
        router=args.router, replica_resources=json.loads(args.replica_resources),
        ingress_resources=json.loads(args.ingress_resources),
        responses_store_size=args.responses_store_size, responses_store_ttl_s=args.responses_store_ttl,
        lora_modules=_parse_lora_modules(args.lora_modules), allow_runtime_lora=args.allow_runtime_lora,
        limits=ApiLimits(max_n=args.max_n, max_tokens=args.max_tokens_limit,
                         max_body_bytes=parse_size(args.max_body_size),
                         max_concurrent_streams=args.max_concurrent_streams,
                         max_attention_tokens=args.max_attention_tokens, max_tool_calls=args.max_tool_calls),
    )
    for path in cfg.lora_modules.values():  # a missing or pickle-only adapter stops us here, not in a replica
        read_adapter(path)
    joined = args.address is not None
    if joined:
        ray.init(address=args.address, include_dashboard=args.dashboard or None)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=args.dashboard)
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True
    # NOTE: after ray.init, which installs its own SIGTERM handler; before serve.run, so a
    # signal during deployment still ends in the clean shutdown below.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = ray.cluster_resources().get("CPU", 0)
    need = required_cpus(cfg, cluster)
    if need > cluster + 1e-6:
        print(f"attnserve serve: error: model replicas need {need:g} CPUs but the cluster has {cluster:g}; "
              "lower --replicas or --num-cpus", file=sys.stderr)
        return 2
    serve.start(http_options={"host": args.host, "port": args.port}, proxy_location=args.proxy_location)
    print(f"attnserve: deploying {', '.join(cfg.models)} (first start converts the default model)...", flush=True)
    serve.run(build_app(cfg), name=args.app_name, route_prefix=args.route_prefix, blocking=False)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}{args.route_prefix.rstrip('/')}"
    model = next(iter(cfg.models))
    auth = f" -H 'Authorization: Bearer {cfg.api_key}'" if cfg.api_key else ""
    print(f"\nattnserve is up at {url}  (OpenAI base URL: {url}/v1)\n\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
          f"\"What is the capital of France?\"}}], \"max_tokens\": 32}}'\n\nCtrl-C stops it.", flush=True)

    while not stop["flag"]:
        time.sleep(0.5)
    print("attnserve: shutting down: draining in-flight requests...", flush=True)
    left = _drain(args.app_name, args.drain_timeout)
    print(f"attnserve: {'drained' if left == 0 else f'{left} request(s) still running; aborting them'}", flush=True)
    if joined:  # leave the cluster as we found it: our application and its state (metrics, adapters, responses) go
        serve.delete(args.app_name)
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(state_name(args.app_name), namespace=STATE_NAMESPACE))
    else:
        serve.shutdown()
    ray.shutdown()
    return 0


def _drain(app_name: str, timeout: float) -> int:
    """Wait until no engine of the application has a running or waiting request (or timeout).

    Returns how many were still in flight. Reads the replicas' own reports via the application's state actor.
    """

    import ray  # noqa: PLC0415 - Ray

    from server.deployment import STATE_NAMESPACE, state_name  # noqa: PLC0415 - Ray

    try:
        hub = ray.get_actor(state_name(app_name), namespace=STATE_NAMESPACE)
    except ValueError:
        return 0
    started, deadline = time.time(), time.monotonic() + timeout
    while True:
        snaps = fresh(ray.get(hub.collect.remote()), time.time())
        left = sum(s.gauges.requests_running + s.gauges.requests_waiting for s in snaps)
        # NOTE: only reports taken after the signal count: an older one may predate the last requests
        if (left == 0 and all(s.time > started for s in snaps)) or time.monotonic() > deadline:
            time.sleep(1.0)  # let the last tokens cross ingress and proxy before they are stopped
            return left
        time.sleep(0.5)


def _defaults(cls) -> dict:
    """A config dataclass's defaults: the CLI repeats none of them."""
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)}


def _defaults_engine() -> dict:

    return _defaults(EngineConfig)


def _add_kv_dtype_arg(p: argparse.ArgumentParser) -> None:

    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=_defaults_engine()["kv_cache_dtype"],
                   help="KV cache storage: auto (the model's dtype) or an 8-bit float (fp8_e4m3, fp8_e5m2: half "
                        "of bf16's bytes, one power-of-two scale per layer for K and for V, calibrated at load)")


def _add_dtype_arg(p: argparse.ArgumentParser) -> None:

    p.add_argument("--dtype", choices=DTYPES, default=_defaults_engine()["dtype"],
                   help="compute dtype; auto: the checkpoint's where this CPU computes it natively (bf16 needs "
                        "AVX512-BF16), else float32 (`attnserve env` shows the choice)")


_QUANTIZATION_HELP = ("weights as served: auto (a GGUF keeps its stored types, safetensors stay unquantized), none "
                      "(dequantize), int8 (per output channel), int4 (groups of 32), int4_g128 (groups of 128)")


def _add_quantization_arg(p: argparse.ArgumentParser, several: bool = False) -> None:

    default = _defaults_engine()["quantization"]
    if several:
        p.add_argument("--quantization", nargs="+", choices=QUANTIZATIONS, default=[default], metavar="Q",
                       help=_QUANTIZATION_HELP + "; several give one row each, e.g. --quantization none int8 int4 "
                            f"(choices: {', '.join(QUANTIZATIONS)})")
    else:
        p.add_argument("--quantization", choices=QUANTIZATIONS, default=default, help=_QUANTIZATION_HELP)


def _add_activations_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=ACTIVATIONS, default=_defaults_engine()["activations"],
                   help="the quantized linears' activations: exact (fp32: the dequantized weights' result), int8 "
                        "(each row rounded to int8 per block of 32, integer dot products, as llama.cpp), or auto "
                        "(int8 where measured faster and within the perplexity bounds; `attnserve env` shows it)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d = _defaults_engine()
    _add_dtype_arg(p)
    _add_kv_dtype_arg(p)
    _add_quantization_arg(p)
    _add_activations_arg(p)
    p.add_argument("--memory-budget", default=d["memory_budget"],
                   help="bytes for weights + KV cache per engine, e.g. 1.5GiB: with --kv-cache-memory auto the KV "
                        "pool is this minus the weights as served (quantized weights leave more for KV blocks)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", default=d["kv_cache_memory"],
                    help="KV cache budget, e.g. 1GiB or 512MiB; auto: --memory-budget minus the weights' bytes")
    kv.add_argument("--num-blocks", type=int, help="exact number of KV blocks (overrides --kv-cache-memory)")
    p.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per KV block")
    p.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                   help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"], help="max running sequences")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d["scheduling_policy"],
                   help="fcfs: requests in arrival order; priority: by each request's `priority` (lower first) for "
                        "admission and preemption, arrival order among equals (as vLLM; fcfs refuses a priority "
                        "other than 0)")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    p.add_argument("--threads", type=int, help="torch threads for model steps (per worker when sharded)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d["tensor_parallel_size"],
                   help="shard each layer's heads and features over this many Ray workers (one node)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d["pipeline_parallel_size"],
                   help="split the layers into this many stages on Ray workers (spread over nodes)")
    p.add_argument("--worker-cpus", type=float, default=d["worker_cpus"],
                   help="Ray CPUs per worker when sharded (fractions fit a small machine; "
                        "under serve: the replica's CPUs split among its workers)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the model eagerly: no torch.compile (faster start, slower steps)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        'or \'{"method": "draft_model", "model": "default", "num_speculative_tokens": 3}\' '
                        "(docs/speculative.md)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="split a reasoning model's <think> text into reasoning_content: deepseek_r1, qwen3, or auto "
                        "(from the chat template) (docs/reasoning.md)")
    p.add_argument("--reasoning-budget", type=int, default=d["reasoning_budget"],
                   help="thinking tokens a request may take before </think> is forced, where it names no budget "
                        "(-1: unlimited)")
    p.add_argument("--task", choices=TASKS, default=d["task"],
                   help="what the model serves: generate, embed (POST /v1/embeddings only), generate,embed (both, "
                        "in the same engine steps), or auto (embed for a sentence-transformers checkpoint: "
                        "modules.json) (docs/embeddings.md)")
    p.add_argument("--pooling", choices=POOLING_CHOICES, default=d["pooling"],
                   help="an embedding model's pooling of its final hidden states: last token, mean, cls (the first "
                        "token), or auto (the checkpoint's sentence-transformers config, else last)")
    p.add_argument("--max-loras", type=int, default=d["max_loras"],
                   help="LoRA adapters resident per engine at once, in one batch (least recently used ones are "
                        "evicted); 0: no LoRA (serve's --lora-modules without it: 4)")
    p.add_argument("--max-lora-rank", type=int, default=d["max_lora_rank"],
                   help="largest LoRA rank an adapter may have (its slots are this wide)")
    p.add_argument("--embed-normalize", action=argparse.BooleanOptionalAction, default=d["embed_normalize"],
                   help="L2-normalise embeddings (default: as the checkpoint's sentence-transformers config says, "
                        "else on)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description="Paged-KV, continuous-batching LLM server.")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="change a checkpoint's number of K/V heads (MHA <-> GQA <-> MQA)")
    convert.add_argument("--model", required=True, help="checkpoint directory, .gguf file or model name")
    convert.add_argument("--kv-heads", type=int, required=True, help="target K/V heads (num_heads = MHA, 1 = MQA)")
    convert.add_argument("--out", required=True, help="output directory (HF layout, safetensors)")
    convert.add_argument("--dtype", choices=["float32", "bfloat16"], help="weight dtype to write (default: as read)")
    convert.set_defaults(func=_convert)

    gen = sub.add_parser("generate", help="run the engine in-process (no Ray) on prompts")
    gen.add_argument("--model", default="default", help="checkpoint directory, .gguf file or model name")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompt-file", help='JSONL: {"prompt": ...} or {"prompt_token_ids": [...]}, optional "max_tokens"')
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt, in input order")
    _add_engine_args(gen)
    gen.set_defaults(func=_generate)

    from server.openai_api import ApiLimits  # noqa: PLC0415 - FastAPI, pydantic
    from server.serve_config import ServeConfig  # noqa: PLC0415 - FastAPI, pydantic

    sd, ld = _defaults(ServeConfig), _defaults(ApiLimits)
    ev = sub.add_parser("eval", help="perplexity on a held-out text per model and weight quantization: quality "
                                     "against KV bytes per token and weight bytes")
    ev.add_argument("--model", action="append", help="checkpoint directory, .gguf file or model name (repeat it)")
    ev.add_argument("--text", help="a UTF-8 text file (default: a Shakespeare play no load-test workload uses)")
    _add_dtype_arg(ev)
    _add_kv_dtype_arg(ev)
    _add_quantization_arg(ev, several=True)
    _add_activations_arg(ev)
    ev.add_argument("--window", type=int, default=1024,
                    help="tokens per window (at least 2; capped at the model's max_position_embeddings)")
    ev.add_argument("--stride", type=int, default=512,
                    help="tokens between window starts: each window scores the tokens past the previous one's "
                         "end, with the rest as context (capped at the window - 1, so every token but the first "
                         "is scored once, with at least one token of context)")
    ev.add_argument("--threads", type=int, help="torch threads")
    ev.add_argument("--json", help="write the rows here: model, attention, kv_heads, kv_cache_dtype, "
                                   "kv_bytes_per_token, quantization, weight_bytes, perplexity")
    ev.set_defaults(func=_eval)

    env = sub.add_parser("env", help="what a bug report needs: CPU, ISA level, torch / oneDNN / compiler "
                                     "versions and the paths attnserve chooses here")
    env.add_argument("--json", action="store_true", help="print it as JSON")
    env.set_defaults(func=_env)

    srv = sub.add_parser("serve", help="start Ray Serve with the OpenAI-compatible API")
    srv.add_argument("--model", action="append", metavar="NAME=PATH_OR_NAME",
                     help="a model to serve (repeatable); default: default=default")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--replicas", type=int, default=sd["num_replicas"], help="replicas per model")
    srv.add_argument("--autoscale", metavar="MIN:MAX", help="autoscale replicas per model between MIN and MAX")
    srv.add_argument("--replica-resources", default="{}", metavar="JSON",
                     help='Ray custom resources each model replica asks for, e.g. \'{"replica_slot": 1}\'')
    srv.add_argument("--ingress-resources", default="{}", metavar="JSON",
                     help="Ray custom resources the ingress and the metrics hub ask for (pins them to a node)")
    srv.add_argument("--proxy-location", choices=("EveryNode", "HeadOnly"), default="EveryNode",
                     help="where Serve runs HTTP proxies (HeadOnly: several nodes on one machine share one port)")
    srv.add_argument("--router", choices=("cache", "pow2"), default=sd["router"],
                     help="with several replicas: route to the replica whose prefix cache holds the most of the "
                          "prompt (cache), or Serve's power of two choices (pow2)")
    srv.add_argument("--max-waiting", type=int, help="bounded waiting queue per replica (429 beyond it)")
    srv.add_argument("--max-ongoing-requests", type=int, default=sd["max_ongoing_requests"], help="Serve's per-replica concurrency cap")
    srv.add_argument("--num-cpus", type=float, help="CPUs per model replica (default: an even share)")
    srv.add_argument("--num-gpus", type=float, default=sd["num_gpus"], help="GPUs per model replica (> 0 runs on CUDA)")
    srv.add_argument("--api-key", default=os.environ.get("ATTNSERVE_API_KEY"), help="require this key on /v1 (as a Bearer token or x-api-key)")
    srv.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    srv.add_argument("--dashboard", action="store_true", help="start Ray's dashboard too")
    srv.add_argument("--app-name", default=APP_NAME, help="Serve application name")
    srv.add_argument("--max-n", type=int, default=ld["max_n"], help="largest `n` a request may ask for")
    srv.add_argument("--max-tokens-limit", type=int, default=ld["max_tokens"], help="largest `max_tokens` a request may ask for")
    srv.add_argument("--max-body-size", default=ld["max_body_bytes"], help="larger request bodies get 413")
    srv.add_argument("--max-attention-tokens", type=int, default=ld["max_attention_tokens"],
                     help="longest prompt POST /v1/attention takes")
    srv.add_argument("--max-tool-calls", type=int, default=ld["max_tool_calls"],
                     help="most tool calls in one answer (it ends there, or at a repeated call)")
    srv.add_argument("--max-concurrent-streams", type=int, default=ld["max_concurrent_streams"], help="per ingress replica; beyond it 429")
    srv.add_argument("--drain-timeout", type=float, default=sd["graceful_shutdown_timeout_s"], help="seconds in-flight requests get on shutdown")
    srv.add_argument("--route-prefix", default="/", help="HTTP route prefix of the application")
    srv.add_argument("--responses-store-size", type=int, default=sd["responses_store_size"],
                     help="/v1/responses: the most stored responses kept for previous_response_id (oldest go first)")
    srv.add_argument("--responses-store-ttl", type=float, default=sd["responses_store_ttl_s"], metavar="SECONDS",
                     help="/v1/responses: how long a stored response is kept")
    srv.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories, safetensors) of the served model; a request names one "
                          "in `model`")
    srv.add_argument("--allow-runtime-lora", action="store_true",
                     help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter without --api-key (they read "
                          "paths on the server: trusted networks only)")
    _add_engine_args(srv)
    srv.set_defaults(func=_serve)
    return parser


def _env(args: argparse.Namespace) -> int:
    from server.env_report import collect, render  # noqa: PLC0415 - torch, after the ISA cap

    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the engine's one start line (CPU path) shows; other libraries keep their levels
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("server.engine.engine").setLevel(logging.INFO)
    try:
        apply_isa_cap()  # before torch runs anything: ATTNSERVE_CPU_ISA caps torch and oneDNN too
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"attnserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
