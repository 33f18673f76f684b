"""LLMEngine: the in-process engine — add requests, step, read token deltas. No Redis here."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine_svc.block_manager import BlockManager
from engine_svc.config import EngineConfig
from engine_svc.iteration_stats import IterationStats
from engine_svc.kv_pool import KVConnector, KVTransferError
from engine_svc.request import Request
from engine_svc.sampler import Sampler
from engine_svc.scheduler import Scheduler
from engine_svc.structured.manager import GrammarManager
from shared.protocol import (Admission, ErrorInfo, FinishReason, ProtocolError, SamplingParams, TokenDelta,
                             TokenLogprobs, check_deadline)

log = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")


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


@dataclass(frozen=True, slots=True)
class Handoff:
    """P/D: a request a prefill engine hands to a decode engine after its first token: the output
    tokens so far (the first, or a resumed request's), the seq its next delta carries, and the
    handle of the KV of its first ``num_kv_tokens`` tokens (None: saving failed, recompute)."""

    request_id: str
    output_token_ids: tuple[int, ...]
    next_seq: int
    kv_handle: str | None
    num_kv_tokens: int


@dataclass(slots=True)
class RequestResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0


class LLMEngine:
    """Owns one model runner, one block manager, one scheduler and one sampler, and steps them:
    schedule -> execute -> sample -> update.

    P/D (``role``, README: Prefill/decode disaggregation): a prefill engine hands each request
    with n = 1 and no beam search off after the step that samples its first token -- its KV saved
    through the ``connector``, its blocks freed, a ``Handoff`` for ``take_handoffs()``; a decode
    engine loads a handed-off request's KV before the step that needs it (the scheduler never
    touches tensors), and computes the prompt itself when the load fails. Both always produce the
    same tokens as a ``both`` engine."""

    def __init__(self, config: EngineConfig | None = None, *, runner=None, record_decode_steps: bool = False,
                 role: str = "both", connector: KVConnector | None = None):
        if role not in ROLES:
            raise ValueError(f"engine role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.connector = connector
        self.num_kv_save_failures = 0  # the connector counts the load side's fallbacks
        self._handoffs: list[Handoff] = []
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
                    resumed_token_ids: Sequence[int] = (), resumed_seq: int = 0, deadline: float = 0.0,
                    kv_handle: str | None = None, num_kv_tokens: int = 0) -> Admission:
        """Validate again (a second front door must not bypass limits), then queue. The returned
        Admission is the request's first message (the caller adds where it goes).

        A resumed request (failover: its engine died) brings the output tokens already delivered:
        they are re-prefilled after the prompt as outputs (max_tokens, min_tokens, penalties and
        usage count them), its deltas go on at ``resumed_seq``, and a seeded sequence draws on
        from its next position (on CPU its noise is keyed on the position, engine_svc/race.py; on
        an accelerator its generator is advanced past the draws that sampled them), so the
        continuation is the one the dead engine would have produced.

        A request past its ``deadline`` (unix time, 0: none) is refused with a 503 before anything else.

        P/D: a handed-off request is a resumed one (its first token delivered by the prefill
        engine) that brings ``kv_handle``, the KV of its first ``num_kv_tokens`` tokens."""
        self.scheduler.refuse_expired(check_deadline(deadline))
        self._validate(request_id, prompt_token_ids, params)
        self._validate_resume(prompt_token_ids, params, resumed_token_ids, resumed_seq)
        prompt = list(prompt_token_ids)
        if kv_handle is not None and not 0 < num_kv_tokens < len(prompt) + len(resumed_token_ids):
            raise ProtocolError("num_kv_tokens must leave the last token to compute", "num_kv_tokens")
        hand_off = self.role == "prefill" and kv_handle is None and params.n == 1 and not params.use_beam_search
        request = Request(request_id, prompt, params, cache_salt=cache_salt,
                          arrival_time=arrival_time if arrival_time is not None else self.scheduler.clock(),
                          token_ids=prompt + list(resumed_token_ids), num_deltas_sent=resumed_seq, deadline=deadline,
                          hand_off=hand_off, kv_handle=kv_handle, num_kv_tokens=num_kv_tokens if kv_handle else 0)
        self.scheduler.add(request)
        if resumed_token_ids and request.generator is not None and not params.is_greedy:
            skip_draws(request.generator, len(resumed_token_ids), self.vocab_size)
        return Admission(request_id=request_id, num_choices=params.n)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Their final ABORT deltas, one per unfinished choice, leave with the next step()."""
        self.scheduler.abort([request_ids] if isinstance(request_ids, str) else request_ids)
        self.drop_kv(self.scheduler.take_dropped_handles())

    def fail_all(self, error: ErrorInfo) -> list[TokenDelta]:
        """Give up on every request (a step raised): the final delta of each unfinished choice,
        carrying ``error``, at once."""
        self.scheduler.abort(list(self.scheduler.requests), FinishReason.ERROR)
        self.drop_kv(self.scheduler.take_dropped_handles())
        return [dataclasses.replace(d, error=error) for d in self.scheduler.take_aborted()]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenDelta]:
        self._load_kv()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            deltas = self.scheduler.take_aborted()
        else:
            logits = self.runner.execute(plan)
            tokens = self.sampler(logits, plan.sampling)
            deltas = self.scheduler.update(plan, tokens)
        self._hand_off()
        self.drop_kv(self.scheduler.take_dropped_handles())
        return deltas

    # ------------------------------------------------------------------ P/D
    def take_handoffs(self) -> list[Handoff]:
        """The requests handed off since the last call (prefill role), in order."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def drop_kv(self, handles: Iterable[str]) -> None:
        """Delete saved KV entries nobody will load (an abort; a lease bounds the rest)."""
        for handle in handles:
            if self.connector is None:
                return
            try:
                self.connector.delete(handle)
            except KVTransferError as exc:
                log.warning("KV entry %s not deleted (its lease ends it): %s", handle, exc)

    def _hand_off(self) -> None:
        for request in self.scheduler.take_handoffs():
            handle, num_kv_tokens = None, request.num_computed_tokens
            if self.connector is not None:
                try:
                    handle = self.connector.save(request.request_id, request.block_table, num_kv_tokens)
                except KVTransferError as exc:
                    self.num_kv_save_failures += 1
                    log.warning("KV of %s not saved (%s): the decode engine recomputes it", request.request_id, exc)
            self.scheduler.hand_off(request)
            self._handoffs.append(Handoff(request.request_id, tuple(request.output_token_ids),
                                          request.num_deltas_sent, handle, num_kv_tokens))

    def _load_kv(self) -> None:
        for request in self.scheduler.take_kv_loads():
            loaded = False
            if self.connector is not None:
                try:
                    self.connector.load(request.kv_handle, request.block_table, request.num_kv_tokens)
                    loaded = True
                except KVTransferError as exc:  # counted by the connector (fallbacks, by reason)
                    log.warning("KV of %s not loaded (%s: %s): computing its prompt here", request.request_id,
                                exc.reason, exc)
            self.scheduler.kv_loaded(request, loaded)

    def kv_transfer_stats(self) -> dict[str, float]:
        """The connector's cumulative counts (empty without one), for heartbeats and /metrics."""
        if self.connector is None:
            return {}
        st = self.connector.stats
        out = {f"kv_{k}": float(v) for k, v in st.as_dict().items() if k != "fallback_reasons"}
        out |= {f"kv_fallbacks_{reason}": float(n) for reason, n in st.fallback_reasons.items()}
        out["kv_num_save_failures"] = float(self.num_kv_save_failures)
        return out

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
            **self.kv_transfer_stats(),
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
