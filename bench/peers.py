"""The HF transformers peers of bench/throughput.py, run in-process on the same workload:
static padded batches through `model.generate`, and transformers' own continuous batching
(the manager behind `model.generate_batch`, fed one request at a time so each keeps its own
max_new_tokens).

Both count only the tokens each request asked for, and record (seconds, cumulative output
tokens) points for the timeline plot.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from common import Progress, Workload


@dataclass
class PeerRun:
    """One system's pass over the workload."""

    name: str
    seconds: float
    num_output_tokens: int
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, tokens so far)
    outputs: list[list[int]] = field(default_factory=list)  # generated ids per request, in workload order
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds > 0 else float("nan")


def load_hf_model(model_dir, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: run every request to its length
    return model


def run_hf_static(model_dir, workload: Workload, batch_size: int, pad_token_id: int = 0,
                  dtype: str = "float32") -> PeerRun:
    """FCFS batches of `batch_size`, left-padded to the batch's longest prompt, each generating the
    batch's largest output length; only each request's own output length is counted."""
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList

    model = load_hf_model(model_dir, dtype)
    progress = Progress("hf static", workload.num_output_tokens)
    outputs: list[list[int]] = []
    timeline = [(0.0, 0)]
    done = 0
    start = time.perf_counter()
    for lo in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[lo:lo + batch_size]
        wants = workload.output_lens[lo:lo + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        config = GenerationConfig(do_sample=False, max_new_tokens=max(wants),
                                  eos_token_id=None, pad_token_id=pad_token_id)
        label = f"batch {lo // batch_size + 1}/{math.ceil(workload.num_requests / batch_size)}"
        counter = _StepCounter(wants, width, done, start, timeline, progress, label)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 stopping_criteria=StoppingCriteriaList([counter]))
        outputs += [out[i, width:width + n].tolist() for i, n in enumerate(wants)]
        done += sum(wants)
    seconds = time.perf_counter() - start
    return PeerRun("HF generate (static batches)", seconds, done, timeline, outputs)


class _StepCounter:
    """A stopping criterion that never stops: called once per generated position, it counts the tokens
    the batch's requests asked for so far (progress line and timeline)."""

    def __init__(self, wants: list[int], width: int, base: int, start: float, timeline: list, progress, label: str):
        self.wants, self.width, self.base, self.start = wants, width, base, start
        self.timeline, self.progress, self.label = timeline, progress, label
        self.counted = 0

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        step = input_ids.shape[1] - self.width
        counted = sum(min(step, n) for n in self.wants)
        self.progress.update(counted - self.counted, self.label)
        self.counted = counted
        self.timeline.append((time.perf_counter() - self.start, self.base + counted))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_generate_batch(model_dir, workload: Workload, *, max_batch: int, max_batch_tokens: int,
                       kv_budget_tokens: int, page_size: int | None = None, dtype: str = "float32") -> PeerRun:
    """transformers' continuous batching (`generate_batch`'s manager) with the same caps: at most
    `max_batch` requests and `max_batch_tokens` tokens per step, a KV cache of `kv_budget_tokens`."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = load_hf_model(model_dir, dtype)
    cb = ContinuousBatchingConfig(max_requests_per_batch=max_batch, max_batch_tokens=max_batch_tokens)
    if page_size is not None:
        cb.page_size = page_size
    cb.num_blocks = max(1, math.ceil(kv_budget_tokens / cb.page_size))
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(workload.output_lens))
    progress = Progress("generate_batch", workload.num_output_tokens)
    results = {}
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=30) as manager:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True,
                                eos_token_id=-1)
        while len(results) < workload.num_requests:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
                progress.update(len(result.generated_tokens), f"{len(results)}/{workload.num_requests} done")
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        seconds = time.perf_counter() - start
    outputs = [list(results[f"r{i}"].generated_tokens) for i in range(workload.num_requests)]
    return PeerRun("transformers generate_batch (CB)", seconds, sum(len(o) for o in outputs),
                   _timeline_from_timestamps(results.values(), start), outputs,
                   [f"page_size={cb.page_size} num_blocks={cb.num_blocks} max_requests_per_batch={max_batch} "
                    f"max_batch_tokens={max_batch_tokens}"])


def _timeline_from_timestamps(results, start: float) -> list[tuple[float, int]]:
    """Cumulative tokens over time from each request's per-token timestamps (perf_counter seconds)."""
    stamps = sorted(t for r in results for t in (r.timestamps or ()))
    if not stamps:
        return []
    step = max(1, len(stamps) // 200)
    return [(0.0, 0)] + [(t - start, i + 1) for i, t in enumerate(stamps) if i % step == 0 or i == len(stamps) - 1]
