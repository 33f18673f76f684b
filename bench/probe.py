"""Per-step instruments for an LLMEngine: section timers wrapped around its parts, a per-step
record (tokens, sequences, KV slots), and a fake runner that keeps the engine's own work
(scheduling, block bookkeeping, input preparation, sampling, update) but skips the model; then
the measurements bench/throughput.py builds on them (concurrency at a KV budget, share of the
matmul ceiling, the engine's own time per step).

Wrappers are set on instances only; no engine file changes.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from common import Workload, matmul_gflops, target

SECTIONS = ("schedule", "prepare", "forward", "attention", "logits", "sample", "update")


@dataclass(slots=True)
class StepRecord:
    """What one engine.step() did and what it cost (seconds per section)."""

    seconds: float
    num_tokens: int
    num_seqs: int
    num_sampled: int
    is_decode: bool
    num_running: int
    allocated_slots: int  # block_size x blocks held by running sequences
    used_slots: int  # tokens whose K/V those blocks hold
    sections: dict[str, float] = field(default_factory=dict)

    @property
    def model_seconds(self) -> float:
        return self.sections.get("forward", 0.0) + self.sections.get("logits", 0.0)

    @property
    def overhead_seconds(self) -> float:
        """The engine's own CPU time: everything in the step but the model's forward and logits."""
        return self.seconds - self.model_seconds


class StepProbe:
    """Times the sections of each engine.step() and records a StepRecord per step."""

    def __init__(self, engine):
        self.engine = engine
        self.current: dict[str, float] = {}
        self.plan = None
        self.records: list[StepRecord] = []
        sch, runner, sampler = engine.scheduler, engine.runner, engine.sampler
        self._wrap(sch, "schedule", "schedule", keep_result=True)
        self._wrap(sch, "update", "update")
        engine.sampler = self._timed(sampler, "sample")
        if hasattr(runner, "prepare"):
            self._wrap(runner, "prepare", "prepare")
        model = getattr(runner, "model", None)
        if model is not None:
            compiled = getattr(runner, "compiled", None)
            if compiled is not None:  # dynamo traces model.forward: time the compiled callable instead
                self._wrap(compiled, "_forward", "forward")
            else:
                self._wrap(model, "forward", "forward")
            self._wrap(model, "compute_logits", "logits")
            for name in ("paged_decode", "paged_prefill", "reshape_and_cache"):
                self._wrap(runner.backend, name, "attention")

    def _timed(self, fn, section: str, keep_result: bool = False):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            self.current[section] = self.current.get(section, 0.0) + time.perf_counter() - t0
            if keep_result:
                self.plan = result
            return result
        return timed

    def _wrap(self, obj, attr: str, section: str, keep_result: bool = False) -> None:
        setattr(obj, attr, self._timed(getattr(obj, attr), section, keep_result))

    def step(self):
        """engine.step(), recorded."""
        self.current, self.plan = {}, None
        t0 = time.perf_counter()
        deltas = self.engine.step()
        seconds = time.perf_counter() - t0
        plan = self.plan
        chunks = plan.chunks if plan is not None else []
        num_tokens = sum(len(c.token_ids) for c in chunks)
        running = self.engine.scheduler.running
        bs = self.engine.block_manager.block_size
        self.records.append(StepRecord(
            seconds=seconds, num_tokens=num_tokens, num_seqs=len(chunks),
            num_sampled=len(plan.sampling) if plan is not None else 0,
            is_decode=bool(chunks) and num_tokens == len(chunks), num_running=len(running),
            allocated_slots=sum(len(r.block_table) for r in running) * bs,
            used_slots=sum(r.num_computed_tokens for r in running), sections=self.current))
        return deltas


class FakeRunner:
    """A ModelRunner without a model: the real input preparation (ModelRunner.prepare), then zero
    logits of the model's vocabulary, so the step costs only what the engine itself does."""

    def __init__(self, *, num_blocks: int, block_size: int, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), logits_width: int | None = None):
        self.num_blocks, self.block_size, self.vocab_size = num_blocks, block_size, vocab_size
        self.max_model_len, self.eos_token_ids = max_model_len, eos_token_ids
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.model_dir = None
        self.model = None
        self.logits_width = logits_width or vocab_size  # narrow logits when sampling cost is beside the point
        self._logits = torch.zeros((0, self.logits_width), dtype=torch.float32)  # reused: no allocation per step

    def prepare(self, chunks):
        from engine_svc.model_runner import ModelRunner

        return ModelRunner.prepare(self, chunks)  # only reads block_size, max_model_len, device

    def execute(self, plan):
        if plan.chunks:
            self.prepare(plan.chunks)
        num_sampled = sum(1 for c in plan.chunks if c.sample)
        if num_sampled > len(self._logits):
            self._logits = torch.zeros((num_sampled, self.logits_width), dtype=torch.float32)
        return self._logits[:num_sampled]


def fake_engine(*, num_blocks: int, block_size: int, vocab_size: int, max_model_len: int,
                max_num_seqs: int, max_num_batched_tokens: int, logits_width: int | None = None):
    """An LLMEngine on a FakeRunner (scheduling and bookkeeping exactly as with a model)."""
    from engine_svc import EngineConfig, LLMEngine

    config = EngineConfig(model="fake", dtype="float32", device="cpu", block_size=block_size,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size, vocab_size=vocab_size,
                        max_model_len=max_model_len, logits_width=logits_width)
    return LLMEngine(config, runner=runner)


# ---------------------------------------------------------------------------- measurements built on them
def concurrency_report(workload: Workload, kv_budget_tokens: int, shape: dict, max_batched: int) -> list[list]:
    """Same KV budget, no cap on sequences: how many requests the paged scheduler runs at once
    (fake runner: scheduling is exact, the model is skipped) vs max-length preallocation."""
    from shared.protocol import SamplingParams

    block_size = 16
    engine = fake_engine(num_blocks=math.ceil(kv_budget_tokens / block_size) + 1, block_size=block_size,
                         vocab_size=shape["vocab_size"], logits_width=16, max_model_len=shape["max_model_len"],
                         max_num_seqs=max(1024, workload.num_requests), max_num_batched_tokens=max_batched)
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    running, queued = [], []
    while engine.has_work():
        engine.step()
        running.append(len(engine.scheduler.running))
        if engine.scheduler.waiting:  # steady state: requests are queued, so memory is the limit
            queued.append(running[-1])
    return [
        ["paged (ours), peak running", max(running)],
        ["paged (ours), mean running while requests queue", round(statistics.mean(queued or running), 1)],
        ["paged (ours), preemptions", engine.scheduler.num_preemptions],
        [f"preallocate workload max ({workload.max_len} tokens each)", kv_budget_tokens // workload.max_len],
        [f"preallocate max_model_len ({shape['max_model_len']} tokens each)",
         kv_budget_tokens // shape["max_model_len"]],
    ]


def compute_probe(probe: StepProbe, batch: int, vocab_size: int, params: int, rounds: int = 3,
                  steps: int = 6, dtype: str = "float32") -> tuple[list[list], float]:
    """`batch` short requests decoding together, timed between matmul measurements (the shared CPU's
    speed drifts, so the ceiling is measured around the very steps it is compared with)."""
    from shared.protocol import SamplingParams

    engine = probe.engine
    for i in range(batch):
        engine.add_request(f"c{i}", [(31 * i + j) % (vocab_size - 3) + 3 for j in range(16)],
                           SamplingParams(temperature=0.0, max_tokens=rounds * steps + 4, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        probe.step()
    gflops, times = [matmul_gflops(seconds=1.0, dtype=dtype)], []
    for _ in range(rounds):
        for _ in range(steps):
            probe.step()
            times.append(probe.records[-1])
        gflops.append(matmul_gflops(seconds=1.0, dtype=dtype))
    while engine.has_work():
        engine.step()
    ceiling = statistics.mean(gflops) * 1e9 / (2 * params)
    step_s = statistics.median(r.seconds for r in times)
    model_s = statistics.median(r.model_seconds for r in times)
    share = batch / step_s / ceiling
    return [
        [f"matmul ceiling during the probe ({min(gflops):.0f}-{max(gflops):.0f} GFLOP/s)", ceiling, "", ""],
        [f"probe: decode at batch {batch}, 16-token prompts, whole step", batch / step_s, f"{share:.1%}",
         target(share >= 0.6)],
        ["probe: same steps, model forward + logits only", batch / model_s, f"{batch / model_s / ceiling:.1%}", ""],
    ], share


def overhead_report(num_seqs: int, shape: dict, max_batched: int) -> tuple[list[list], float]:
    """The engine's own time per step with `num_seqs` requests decoding (fake runner, real vocab)."""
    from shared.protocol import SamplingParams

    block_size, prompt, output = 16, 256, 48
    engine = fake_engine(num_blocks=num_seqs * (prompt + output) // block_size + num_seqs + 1,
                         block_size=block_size, vocab_size=shape["vocab_size"], max_model_len=shape["max_model_len"],
                         max_num_seqs=num_seqs, max_num_batched_tokens=max(max_batched, 8192), logits_width=16)
    probe = StepProbe(engine)
    for i in range(num_seqs):
        ids = [(7 * i + j) % (shape["vocab_size"] - 3) + 3 for j in range(prompt)]
        engine.add_request(f"o{i}", ids, SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))
    while engine.has_work():
        probe.step()
    steps = [r for r in probe.records if r.is_decode and r.num_seqs == num_seqs]
    if not steps:
        return [["no decode step at full batch", ""]], float("nan")
    ms = {s: statistics.median(r.sections.get(s, 0.0) for r in steps) * 1e3 for s in SECTIONS}
    total = statistics.median(r.seconds for r in steps) * 1e3
    other = total - ms["schedule"] - ms["prepare"] - ms["sample"] - ms["update"]
    rows = [["schedule (+ block allocation)", ms["schedule"]], ["prepare (input tensors)", ms["prepare"]],
            ["sampler bookkeeping (16-wide logits)", ms["sample"]],
            ["update (append tokens, stop checks, deltas, frees)", ms["update"]],
            ["rest of step()", other],
            [f"engine's own time per step (median of {len(steps)} steps)", total],
            [f"not included: greedy argmax over [{num_seqs}, {shape['vocab_size']}] logits (tensor work)",
             _argmax_ms(num_seqs, shape["vocab_size"])]]
    return rows, total


def _argmax_ms(rows: int, vocab: int, reps: int = 20) -> float:
    logits = torch.randn(rows, vocab)
    logits.argmax(dim=-1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits.argmax(dim=-1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
