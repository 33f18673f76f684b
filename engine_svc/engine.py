"""LLMEngine: the in-process engine — add requests, step, read token deltas. No Redis here."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine_svc.block_manager import BlockManager
from engine_svc.config import EngineConfig
from engine_svc.iteration_stats import IterationStats
from engine_svc.request import Request
from engine_svc.sampler import Sampler
from engine_svc.scheduler import Scheduler
from engine_svc.structured.manager import GrammarManager
from shared.protocol import (Admission, ErrorInfo, FinishReason, ProtocolError, SamplingParams, TokenDelta,
                             TokenLogprobs, check_deadline)


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a finished request, as generate() returns it."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    text: str | None = None


@dataclass(slots=True)
class RequestResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0


class LLMEngine:
    """Owns one model runner, one block manager, one scheduler and one sampler, and steps them:
    schedule -> execute -> sample -> update."""

    def __init__(self, config: EngineConfig | None = None, *, runner=None, record_decode_steps: bool = False):
        self.config = config = config or EngineConfig()
        if runner is None:
            from engine_svc.model_runner import ModelRunner
            from shared.models import resolve_model

            runner = ModelRunner(config, resolve_model(config.model))
        self.runner = runner
        self.model_dir = getattr(runner, "model_dir", config.model)
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.vocab_size
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, config.enable_prefix_caching)
        self.grammars = GrammarManager(lambda: self.tokenizer, self.vocab_size, runner.eos_token_ids)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, runner.eos_token_ids,
                                   generator_device=runner.device, grammars=self.grammars,
                                   record_decode_steps=record_decode_steps)
        self.sampler = Sampler(runner.eos_token_ids)
        self._tokenizer = None
        self._next_id = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    resumed_token_ids: Sequence[int] = (), resumed_seq: int = 0, deadline: float = 0.0) -> Admission:
        """Validate again (a second front door must not bypass limits), then queue. The returned
        Admission is the request's first message (the caller adds where it goes).

        A resumed request (failover: its engine died) brings the output tokens already delivered:
        they are re-prefilled after the prompt as outputs (max_tokens, min_tokens, penalties and
        usage count them), its deltas go on at ``resumed_seq``, and a seeded sequence's generator
        is advanced past the draws that sampled them, so the continuation is the one the dead
        engine would have produced.

        A request past its ``deadline`` (unix time, 0: none) is refused with a 503 before anything else."""
        self.scheduler.refuse_expired(check_deadline(deadline))
        self._validate(request_id, prompt_token_ids, params)
        self._validate_resume(prompt_token_ids, params, resumed_token_ids, resumed_seq)
        prompt = list(prompt_token_ids)
        request = Request(request_id, prompt, params, cache_salt=cache_salt,
                          arrival_time=arrival_time if arrival_time is not None else self.scheduler.clock(),
                          token_ids=prompt + list(resumed_token_ids), num_deltas_sent=resumed_seq, deadline=deadline)
        self.scheduler.add(request)
        if resumed_token_ids and request.generator is not None and not params.is_greedy:
            skip_draws(request.generator, len(resumed_token_ids), self.vocab_size)
        return Admission(request_id=request_id, num_choices=params.n)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Their final ABORT deltas, one per unfinished choice, leave with the next step()."""
        self.scheduler.abort([request_ids] if isinstance(request_ids, str) else request_ids)

    def fail_all(self, error: ErrorInfo) -> list[TokenDelta]:
        """Give up on every request (a step raised): the final delta of each unfinished choice,
        carrying ``error``, at once."""
        self.scheduler.abort(list(self.scheduler.requests), FinishReason.ERROR)
        return [dataclasses.replace(d, error=error) for d in self.scheduler.take_aborted()]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenDelta]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return self.scheduler.take_aborted()
        logits = self.runner.execute(plan)
        tokens = self.sampler(logits, plan.sampling)
        return self.scheduler.update(plan, tokens)

    def take_stats(self) -> IterationStats:
        """What happened since the last call: tokens, preemptions, finished sequences."""
        return self.scheduler.take_stats()

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        prefix_cache = bm.make_prefix_cache_stats()
        return {
            "num_total_blocks": bm.num_usable_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_requests": len(self.scheduler.requests),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_usage": bm.usage,
            "prefix_cache_queries": prefix_cache.queries,
            "prefix_cache_hits": prefix_cache.hits,
        }

    def _validate(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ProtocolError("sampling params missing")
        params.validate(self.vocab_size)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ProtocolError(f"logprobs is limited to {self.config.max_logprobs}", "logprobs")
        if request_id in self.scheduler.requests:
            raise ProtocolError(f"request {request_id!r} is already running", "request_id")
        if not prompt:
            raise ProtocolError("the prompt is empty", "prompt")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise ProtocolError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        total = len(prompt) + (params.max_tokens or 1)
        if total > self.max_model_len:
            raise ProtocolError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt)} in the prompt, {params.max_tokens or 1} for the completion).",
                "max_tokens" if len(prompt) < self.max_model_len else "prompt")
        if self.block_manager.blocks_needed(total) > self.block_manager.num_usable_blocks:
            raise ProtocolError("the request needs more KV blocks than the whole cache holds", "max_tokens")
        if len(self.scheduler.waiting) >= self.config.max_num_queued_reqs:
            raise ProtocolError("the engine's queue is full; try again later", None, code=503)

    def _validate_resume(self, prompt: Sequence[int], params: SamplingParams, resumed: Sequence[int],
                         resumed_seq: int) -> None:
        if not resumed and not resumed_seq:
            return
        if params.n != 1 or params.use_beam_search:
            raise ProtocolError("only a request with n = 1 and no beam search resumes with its outputs",
                                "resumed_token_ids")
        if not 0 <= resumed_seq < 1 << 31:
            raise ProtocolError("resumed_seq out of range", "resumed_seq")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in resumed):
            raise ProtocolError(f"resumed token ids must be in [0, {self.vocab_size})", "resumed_token_ids")
        if params.max_tokens is not None and len(resumed) >= params.max_tokens \
                or len(prompt) + len(resumed) >= self.max_model_len:
            raise ProtocolError("the resumed request already has all its tokens", "resumed_token_ids")

    # ------------------------------------------------------------------ convenience
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or self.model_dir)
        return self._tokenizer

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, on_step=None) -> list[RequestResult]:
        """Run the prompts to completion; ``on_step(engine)`` is called after every step."""
        params_list = _broadcast(params or SamplingParams(), len(prompts))
        results: dict[str, RequestResult] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"gen-{self._next_id}"
            self._next_id += 1
            self.add_request(request_id, ids, p)
            results[request_id] = RequestResult(request_id, ids, [CompletionOutput(i) for i in range(p.n)])
            order.append(request_id)
        while self.has_work():
            for delta in self.step():
                _collect(results[delta.request_id].outputs[delta.index], delta)
                if delta.num_cached_tokens:
                    results[delta.request_id].num_cached_tokens = delta.num_cached_tokens
            if on_step is not None:
                on_step(self)
        if any(isinstance(p, str) for p in prompts):
            for result in results.values():
                for out in result.outputs:
                    out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return [results[r] for r in order]


def skip_draws(generator, num_draws: int, vocab_size: int) -> None:
    """Advance a seeded sequence's generator as ``num_draws`` sampling steps did: the sampler draws
    one float32 row of exponential noise over the vocabulary per sampled token (Sampler._sample)."""
    noise = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_draws):
        noise.exponential_(generator=generator)


def _broadcast(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return list(params)


def _collect(out: CompletionOutput, delta: TokenDelta) -> None:
    out.token_ids.extend(delta.new_token_ids)
    if delta.logprobs is not None:
        out.logprobs = (out.logprobs or []) + list(delta.logprobs)
    if delta.cumulative_logprob is not None:
        out.cumulative_logprob = delta.cumulative_logprob
    if delta.finish_reason is not None:
        out.finish_reason = FinishReason(delta.finish_reason).openai
        out.stop_reason = delta.stop_reason
