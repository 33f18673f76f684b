"""Structured outputs: what a JSON-schema constraint costs at decode, and what compiling it costs.

    .venv/bin/python bench/structured.py                  # in-process, then both servers if vLLM is installed
    .venv/bin/python bench/structured.py --no-serving     # in-process only

In-process (LLMEngine, the server's defaults: dtype auto, compiled forward): a batch of 32
requests, all under one JSON schema (an array of at least 64 integers, so that no sequence ends
before the measured steps), against the same batch unconstrained (ignore_eos); output tokens/s
over the decode steps while all 32 run. Then the time to first token of a request whose schema
is not compiled yet (a fresh schema each time) against one whose schema is cached.

Serving (when vLLM's CPU build is installed in .peers/vllm, see bench/vllm_peer.py): the same
requests as chat completions with `response_format: json_schema`, 32 at once through the
official openai client, to `pagedserve serve` and to `vllm serve`, one server at a time; output
tokens/s constrained vs not, and the streamed TTFT of a fresh schema vs a cached one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OUT_DIR, print_header, print_table, ratio  # noqa: E402

BATCH = 32
STEPS = 48  # decode steps measured while the whole batch runs
LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 64}
PROMPT = "List many numbers as a JSON array:"


def fresh_schema() -> dict:
    """A schema no cache has seen (its key differs), of the size of an ordinary extraction schema."""
    return {"type": "object", "title": uuid.uuid4().hex,
            "properties": {"name": {"type": "string", "maxLength": 32}, "age": {"type": "integer", "minimum": 0},
                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                           "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                                        "zip": {"type": "string"}},
                                       "required": ["city"]}},
            "required": ["name", "age", "address"]}


# ---------------------------------------------------------------------------- in-process
def decode_rate(engine, params) -> float:
    """Output tokens/s over STEPS decode steps with the whole batch running."""
    for i in range(BATCH):
        engine.add_request(f"b{uuid.uuid4().hex}", engine.tokenizer.encode(PROMPT + f" {i}"), params)
    while len(engine.scheduler.running) < BATCH or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    start = time.perf_counter()
    tokens = 0
    for _ in range(STEPS):
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    elapsed = time.perf_counter() - start
    engine.abort_request([r.request_id for r in engine.scheduler.running + list(engine.scheduler.waiting)])
    while engine.has_work():
        engine.step()
    return tokens / elapsed


def ttft(engine, params) -> float:
    start = time.perf_counter()
    engine.add_request(f"t{uuid.uuid4().hex}", engine.tokenizer.encode("Describe a person as JSON:"), params)
    while True:
        deltas = engine.step()
        if any(d.new_token_ids for d in deltas):
            break
    elapsed = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    return elapsed


def in_process(args) -> dict:
    from engine_svc import EngineConfig, LLMEngine
    from shared.models import resolve_model
    from shared.protocol import SamplingParams
    from shared.structured import StructuredOutputs

    engine = LLMEngine(EngineConfig(model=str(resolve_model(args.model)), max_num_seqs=64))
    print(f"   engine: {engine.runner.device}/{engine.runner.dtype}, compiled: {engine.runner.num_compiles > 0}")
    constrained = SamplingParams(temperature=0.0, max_tokens=STEPS + 8,
                                 structured_outputs=StructuredOutputs(json=json.dumps(LONG_ARRAY)))
    plain = SamplingParams(temperature=0.0, max_tokens=STEPS + 8, ignore_eos=True)
    ttft(engine, SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=StructuredOutputs(
        json=json.dumps(fresh_schema()))))  # builds the grammar compiler once (tokenizer info), as a server's first
    rates = {"plain": [], "constrained": []}
    for _ in range(args.repeats):
        rates["plain"].append(decode_rate(engine, plain))
        rates["constrained"].append(decode_rate(engine, constrained))
    fresh, cached = [], []
    for _ in range(args.repeats * 3):
        schema = StructuredOutputs(json=json.dumps(fresh_schema()))
        fresh.append(ttft(engine, SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=schema)))
        cached.append(ttft(engine, SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=schema)))
    plain_ttft = [ttft(engine, SamplingParams(temperature=0.0, max_tokens=2)) for _ in range(args.repeats * 3)]
    return {"plain_tok_s": statistics.median(rates["plain"]), "constrained_tok_s": statistics.median(rates["constrained"]),
            "ttft_fresh_ms": 1e3 * statistics.median(fresh), "ttft_cached_ms": 1e3 * statistics.median(cached),
            "ttft_plain_ms": 1e3 * statistics.median(plain_ttft)}


# ---------------------------------------------------------------------------- serving
async def _chat_batch(client, model: str, schema: dict | None) -> float:
    """Output tokens/s of BATCH concurrent chat completions."""
    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema}} if schema else None

    async def one(i):
        extra = {} if schema else {"ignore_eos": True}
        resp = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{PROMPT} {i}"}], max_tokens=STEPS,
            temperature=0.0, **({"response_format": fmt} if fmt else {}), extra_body=extra)
        return resp.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(BATCH))))
    return tokens / (time.perf_counter() - start)


async def _stream_ttft(client, model: str, schema: dict) -> float:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=4,
        temperature=0.0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else float("nan")


async def _serve_figures(port: int, model: str, repeats: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    await _chat_batch(client, model, LONG_ARRAY)  # warm-up: the first compile, the first batch
    plain = [await _chat_batch(client, model, None) for _ in range(repeats)]
    constrained = [await _chat_batch(client, model, LONG_ARRAY) for _ in range(repeats)]
    fresh, cached = [], []
    for _ in range(repeats * 3):
        schema = fresh_schema()
        fresh.append(await _stream_ttft(client, model, schema))
        cached.append(await _stream_ttft(client, model, schema))
    await client.close()
    return {"plain_tok_s": statistics.median(plain), "constrained_tok_s": statistics.median(constrained),
            "ttft_fresh_ms": 1e3 * statistics.median(fresh), "ttft_cached_ms": 1e3 * statistics.median(cached)}


def serving(args) -> dict:
    from vllm_install import PEER_DIR
    from vllm_peer import SERVED_NAME, free_port, pagedserve_server, vllm_server

    from shared.models import resolve_model

    model = Path(resolve_model(args.model))
    peer_args = argparse.Namespace(max_num_seqs=64, kv_cache_gib=4, vllm_args="", vllm_env="", pagedserve_args="")
    out = {}
    for name in ("pagedserve", "vllm"):
        if name == "vllm" and not (PEER_DIR / "bin" / "vllm").is_file():
            print("   vLLM's CPU build is not installed (make bench-vllm installs it): serving peer skipped")
            continue
        port = free_port()
        server = (pagedserve_server(model, port, "default", peer_args) if name == "pagedserve"
                  else vllm_server(PEER_DIR / "bin", model, port, "default", peer_args))
        print(f"   [{name}] starting: {server.command}", file=sys.stderr, flush=True)
        with server:
            server.start(600)
            out[name] = asyncio.run(_serve_figures(port, SERVED_NAME, args.repeats))
        print(f"   [{name}] {out[name]}", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------- report
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-serving", action="store_true")
    args = p.parse_args(argv)
    print_header("structured outputs: JSON-schema decode cost and compile latency")
    results = {"in_process": in_process(args)}
    r = results["in_process"]
    print_table(f"in-process, batch {BATCH}, {STEPS} decode steps (target: constrained >= 0.9x plain)",
                ["", "plain", "json schema", "constrained / plain"],
                [["output tok/s", r["plain_tok_s"], r["constrained_tok_s"], ratio(r["constrained_tok_s"], r["plain_tok_s"])]])
    print_table("in-process time to first token (ms, median)", ["no schema", "schema cached", "schema not compiled"],
                [[r["ttft_plain_ms"], r["ttft_cached_ms"], r["ttft_fresh_ms"]]])
    if not args.no_serving:
        results["serving"] = s = serving(args)
        rows = [[name, f["plain_tok_s"], f["constrained_tok_s"], ratio(f["constrained_tok_s"], f["plain_tok_s"]),
                 f["ttft_cached_ms"], f["ttft_fresh_ms"]] for name, f in s.items()]
        if "vllm" in s and "pagedserve" in s:
            rows.append(["ours / vLLM", ratio(s["pagedserve"]["plain_tok_s"], s["vllm"]["plain_tok_s"]),
                         ratio(s["pagedserve"]["constrained_tok_s"], s["vllm"]["constrained_tok_s"]), "",
                         ratio(s["pagedserve"]["ttft_cached_ms"], s["vllm"]["ttft_cached_ms"]),
                         ratio(s["pagedserve"]["ttft_fresh_ms"], s["vllm"]["ttft_fresh_ms"])])
        print_table(f"serving: {BATCH} concurrent chat completions (openai client), each server's defaults",
                    ["server", "plain tok/s", "json schema tok/s", "constrained / plain", "TTFT cached ms",
                     "TTFT fresh schema ms"], rows)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "structured.json").write_text(json.dumps(results, indent=2))
    print(f"\n   figures: {OUT_DIR / 'structured.json'}")


if __name__ == "__main__":
    main()
