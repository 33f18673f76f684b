"""The in-process engine's steps against this machine's own limits, measured in the same run (issue 11).

    python bench/cpu_step.py [--dtype bfloat16] [--enforce-eager]

Limits, measured first:
- memory floor: the bytes of the weights a step streams (every matrix once, the LM head included)
  divided by the best read bandwidth of a sum over a 1 GiB tensor;
- matmul ceiling: the best sustained GFLOP/s of a [2048, 576] x [576, 1536] matmul in the dtype (in
  float32 for bfloat16 on a CPU without bfloat16 arithmetic, which computes a bfloat16 model in float32).

Then the engine (default model, compiled unless --enforce-eager), each step timed alone:
- decode at batch 1 and batch 256 (prompts of 128 tokens, ignore_eos): median step time, against
  the memory floor (batch 1) and as a share of the ceiling (2 x parameters x tokens / time); batch
  256 again at temperature 1.0 (the sampler's draw on top of the forward; no target). A batch-256
  step also reads its sequences' KV (256 contexts of ~130 tokens: three times the weights'
  bytes for the default model), so its own memory floor, weights and KV at the read bandwidth,
  is printed with the share of the ceiling it leaves possible;
- prefill of one 2,048-token prompt: time to the first token, as a share of the ceiling.
The run sets OMP_NUM_THREADS to the CPUs it may use (as the engine service does) and never PASSIVE.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
    del os.environ["OMP_WAIT_POLICY"]

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from common import matmul_gflops, print_header, print_table, target  # noqa: E402

from engine_svc import EngineConfig, LLMEngine  # noqa: E402
from engine_svc.attention import cpu_ops  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402


def read_bandwidth_gbs(gib: float = 1.0, seconds: float = 2.0) -> float:
    """Best GB/s of summing a large tensor (every byte read once, nothing written)."""
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    data.sum()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def weight_bytes(engine: LLMEngine) -> tuple[int, int]:
    """(bytes a step streams, parameters in matmuls): every layer matrix and the LM head."""
    model = engine.runner.model
    mats = [t for layer in model.layers for t in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)]
    mats.append(model.lm_head)
    params = sum(t.numel() for t in mats)
    return params * mats[0].element_size(), params


def decode_steps(engine: LLMEngine, batch: int, steps: int = 24, prompt_len: int = 128,
                 temperature: float = 0.0, contexts: list[int] | None = None) -> float:
    """Median seconds of a pure decode step with `batch` sequences running; ``contexts`` gets the
    tokens each timed step's attention reads (all sequences' contexts, the new token's included)."""
    params = SamplingParams(temperature=temperature, max_tokens=steps + 40, ignore_eos=True)  # outlives the prefills
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", [(7 * i + j) % 3000 + 100 for j in range(prompt_len)], params)
    times, read = [], []
    while engine.has_work():
        decoding = not engine.scheduler.waiting and all(r.num_computed_tokens >= len(r.prompt_token_ids)
                                                        for r in engine.scheduler.running)
        context = sum(r.num_computed_tokens + 1 for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        if decoding and len(engine.scheduler.running) == batch:
            times.append(time.perf_counter() - t0)
            read.append(context)
            if len(times) == steps:
                engine.abort_request([r.request_id for r in engine.scheduler.running])
    if contexts is not None:
        contexts += read[2:] or read
    return statistics.median(times[2:] or times)


def prefill_seconds(engine: LLMEngine, prompt_len: int = 2048, reps: int = 3) -> float:
    best = float("inf")
    for r in range(reps):
        prompt = [(11 * j + r) % 3000 + 100 for j in range(prompt_len)]
        engine.add_request(f"p{r}", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args()
    print_header("bench/cpu_step.py: engine steps against the memory floor and the matmul ceiling")
    bandwidth = read_bandwidth_gbs()
    # a CPU with no bfloat16 arithmetic (AVX2 only) multiplies a bfloat16 model's rows in float32
    arithmetic = args.dtype if args.dtype != "bfloat16" or cpu_ops.onednn_packs(torch.bfloat16) else "float32"
    ceiling = matmul_gflops(m=2048, k=576, n=1536, dtype=arithmetic)
    print(f"read bandwidth {bandwidth:.1f} GB/s, {arithmetic} matmul ceiling {ceiling:.0f} GFLOP/s"
          + ("" if arithmetic == args.dtype else f" ({args.dtype} is computed in {arithmetic} on this CPU)"), flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory=4 << 30, max_num_seqs=256,
                                    max_num_batched_tokens=2048, enforce_eager=args.enforce_eager))
    print(f"engine ready in {time.perf_counter() - t0:.1f} s ({engine.runner.num_compiles} compiled graphs)", flush=True)
    nbytes, params = weight_bytes(engine)
    floor = nbytes / (bandwidth * 1e9)
    step1 = decode_steps(engine, 1)
    print(f"decode batch 1: {step1 * 1e3:.2f} ms", flush=True)
    contexts: list[int] = []
    step256 = decode_steps(engine, 256, steps=12, contexts=contexts)
    kv_read = engine.runner.kv_bytes_per_block / engine.runner.block_size * statistics.mean(contexts)
    floor256 = (nbytes + kv_read) / (bandwidth * 1e9)
    print(f"decode batch 256: {step256 * 1e3:.1f} ms", flush=True)
    sampled256 = decode_steps(engine, 256, steps=12, temperature=1.0)
    print(f"decode batch 256, temperature 1.0: {sampled256 * 1e3:.1f} ms", flush=True)
    prefill = prefill_seconds(engine)
    share = lambda tokens, s: 2 * params * tokens / s / 1e9 / ceiling  # noqa: E731
    print_table(f"in-process engine, {args.dtype}, {'eager' if args.enforce_eager else 'compiled'}",
                ["what", "measured", "limit (same run)", "ratio", "target", ""],
                [["decode step, batch 1", f"{step1 * 1e3:.2f} ms", f"memory floor {floor * 1e3:.2f} ms",
                  f"{step1 / floor:.2f}x floor", "<= 2x", target(step1 <= 2 * floor)],
                 ["decode step, batch 256", f"{step256 * 1e3:.1f} ms", f"ceiling {ceiling:.0f} GFLOP/s",
                  f"{share(256, step256):.0%}", ">= 60%", target(share(256, step256) >= 0.6)],
                 ["... its memory floor", f"{floor256 * 1e3:.1f} ms",
                  f"weights + {kv_read / 1e6:.0f} MB of KV", f"caps it at {share(256, floor256):.0%}", "", ""],
                 ["... at temperature 1.0", f"{sampled256 * 1e3:.1f} ms", f"greedy {step256 * 1e3:.1f} ms",
                  f"{sampled256 / step256:.2f}x greedy", "", ""],
                 ["prefill, 2,048 tokens", f"{prefill:.2f} s", f"ceiling {ceiling:.0f} GFLOP/s",
                  f"{share(2048, prefill):.0%}", ">= 60%", target(share(2048, prefill) >= 0.6)]])
    print(f"\nweights streamed per step: {nbytes / 1e6:.0f} MB ({params / 1e6:.1f}M matmul parameters)")


if __name__ == "__main__":
    main()
