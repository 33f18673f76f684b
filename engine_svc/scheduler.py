"""Continuous batching: which sequences run this step, and how many tokens each computes."""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable

from engine_svc.beam_search import BeamGroup, BeamSearch
from engine_svc.block_manager import BlockManager
from engine_svc.config import EngineConfig
from engine_svc.deltas import beam_deltas, check_stop, final_delta, make_delta
from engine_svc.iteration_stats import IterationStats, finished_record, is_decode, note_chunk, note_token
from engine_svc.request import Request, RequestStatus, make_generator
from engine_svc.scheduler_output import SampleRow, ScheduledChunk, SamplerOutput, SchedulerOutput, SeqKey
from shared.protocol import ErrorInfo, FinishReason, ProtocolError, TokenDelta, is_expired

EXPIRED = ErrorInfo(message="the request passed its deadline (request_timeout) and was dropped by the engine",
                    type="ServiceUnavailableError", code=503)


class Scheduler:
    """Decides; returns a plain SchedulerOutput and never touches tensors.

    FCFS over a waiting queue and a running list. Running sequences are served first (decode
    and unfinished prompt chunks); waiting ones are admitted while the token budget, the
    sequence cap and the free blocks allow. When blocks run out, the newest running sequence is
    preempted by recompute: its blocks are freed and it waits at the head of the queue. Every
    choice of every request gets exactly one final delta, aborts included.

    It also counts what happens, where it happens (``stats``, handed out by ``take_stats()``),
    and stamps each sequence's phases with ``clock``; ``record_decode_steps`` keeps every decode
    step's times too (``--collect-detailed-traces``).

    A request past its deadline (a unix time, read with ``wall_clock``: deadlines cross
    processes) is never computed again: each step first drops every expired request, waiting
    or running, with one final ERROR delta per unfinished choice, and frees its blocks.

    P/D (README: Prefill/decode disaggregation). On a prefill engine, a sequence marked
    ``hand_off`` that sampled a token and goes on is listed by ``take_handoffs()``; the engine
    saves its KV and calls ``hand_off()``, which frees it here. On a decode engine, a request that
    arrives with a KV handle waits (WAITING_FOR_KV) until ``take_kv_loads()`` gives it blocks
    (under the same caps as any admission); the engine loads the KV into them and calls
    ``kv_loaded()``: it then runs from its last token, or, when the load failed, waits to be
    computed from scratch. The handles of requests dropped before their load are handed out by
    ``take_dropped_handles()``, so that the engine deletes their entries.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: Iterable[int] = (), generator_device: str = "cpu", grammars=None,
                 clock: Callable[[], float] = time.monotonic, record_decode_steps: bool = False,
                 wall_clock: Callable[[], float] = time.time):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generator_device = generator_device  # where seeded sequences' torch.Generators live
        self.grammars = grammars  # a structured.GrammarManager: compiles constraints, starts matchers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        self.clock = clock
        self.wall_clock = wall_clock
        self._deadlines: list[tuple[float, str]] = []  # a heap of (deadline, request_id)
        self.record_decode_steps = record_decode_steps
        self.stats = IterationStats()
        self._step_start = 0.0
        self._aborted: list[TokenDelta] = []
        self._scheduled: list[Request] = []  # this step's plan.chunks[i] belongs to _scheduled[i]
        self._sampled: dict[SeqKey, Request] = {}
        self._handoffs: list[Request] = []
        self._dropped_handles: list[str] = []

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        params = request.params
        request.generator = make_generator(params.seed, request.index, self.generator_device)
        if params.use_beam_search:
            eos = () if params.ignore_eos else self.eos_token_ids
            max_new = params.max_tokens or self.max_model_len - request.num_prompt_tokens
            search = BeamSearch(params.n, request.num_prompt_tokens, max_new, eos, params.length_penalty,
                                params.early_stopping)
            request.beam = BeamGroup(search, [request], {})
        else:
            request.num_children_pending = params.n - 1
        if params.structured_outputs is not None:
            self.grammars.submit(params.structured_outputs)  # compiles while the request waits
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        elif request.kv_handle is not None:
            request.status = RequestStatus.WAITING_FOR_KV
        self.waiting.append(request)
        self.requests[request.request_id] = [request]
        if request.deadline:
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))
        self.stats.admitted.append((params.n, self._max_tokens(request)))

    def abort(self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT,
              error: ErrorInfo | None = None) -> None:
        """Free the sequences now; the final delta of every unfinished choice (forked or not yet)
        leaves with the next step, or with take_aborted()."""
        num_before = len(self._aborted)
        now = self.clock()
        for request_id in request_ids:
            family = self.requests.pop(request_id, None)
            if family is None:
                continue
            first = family[0]
            for request in family:
                if request.is_finished:
                    continue
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self.block_manager.free(request)
                if request.kv_handle is not None:  # never loaded: its entry is nobody's now
                    self._dropped_handles.append(request.kv_handle)
                request.finish(reason)
                self.stats.finished.append(finished_record(request, now, self._max_tokens(request)))
                if request.beam is None:
                    self._aborted.append(make_delta(request))
            n = first.params.n
            unstarted = range(n) if first.beam is not None else range(n - first.num_children_pending, n)
            self._aborted += [final_delta(first, index, reason) for index in unstarted]
        if error is not None:
            self._aborted[num_before:] = [dataclasses.replace(d, error=error) for d in self._aborted[num_before:]]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    # ------------------------------------------------------------------ deadlines
    def refuse_expired(self, deadline: float) -> None:
        """Admission: a request already past its deadline is refused (a 503), counted, never queued."""
        if is_expired(deadline, self.wall_clock()):
            self.stats.num_expired["admission"] = self.stats.num_expired.get("admission", 0) + 1
            raise ProtocolError(EXPIRED.message, None, code=503)

    def _drop_expired(self) -> None:
        """Abort every request whose deadline passed, before this step computes anything for it;
        counted by phase: "waiting" (nothing computed yet) or "running" (some computed)."""
        now = self.wall_clock()
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, request_id = heapq.heappop(self._deadlines)
            family = self.requests.get(request_id)
            if family and family[0].deadline == deadline:  # not finished, nor a later request of that id
                phase = "running" if any(r.scheduled_time is not None for r in family) else "waiting"
                self.stats.num_expired[phase] = self.stats.num_expired.get(phase, 0) + 1
                expired.append(request_id)
        if expired:
            self.abort(expired, FinishReason.ERROR, EXPIRED)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        if self._deadlines:
            self._drop_expired()
        plan = SchedulerOutput()
        self._scheduled, self._sampled = [], {}
        self._step_start = self.clock()
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(plan, budget)
        if not preempted:
            self._schedule_waiting(plan, budget)
        if plan.chunks:
            self.stats.step_tokens.append(sum(len(c.token_ids) for c in plan.chunks))
        return plan

    def _schedule_running(self, plan: SchedulerOutput, budget: int) -> tuple[int, bool]:
        forked: list[Request] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings
                i += 1
                continue
            while not self.block_manager.allocate_slots(request, num_new, copies=plan.block_copies):
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim)
                preempted = True
                if victim is request:
                    return budget, preempted
            forked += self._add_chunk(plan, request, num_new)
            budget -= num_new
            i += 1
        self.running += forked
        return budget, preempted

    def _schedule_waiting(self, plan: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        forked: list[Request] = []
        compiling: list[Request] = []  # skipped, not blocking: they keep their place in the queue
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(request):
                if self.waiting and self.waiting[0] is request:  # still compiling (not failed)
                    compiling.append(self.waiting.popleft())
                continue
            if request.status == RequestStatus.WAITING_FOR_KV:  # admitted by take_kv_loads() instead
                compiling.append(self.waiting.popleft())
                continue
            num_seqs = request.params.n if request.status == RequestStatus.WAITING else 1
            if len(self.running) + len(forked) + num_seqs > self.config.max_num_seqs:
                break
            hits = bm.match_prefix(request)
            num_new = request.num_tokens - len(hits) * bm.block_size
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            first_admission = request.status == RequestStatus.WAITING  # not a resumed preemption
            if not bm.allocate_slots(request, num_new, hits, count_prefix_query=first_admission):
                break
            self.waiting.popleft()
            if first_admission:
                request.num_cached_tokens = len(hits) * bm.block_size
            if request.scheduled_time is None:
                request.scheduled_time = self._step_start
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            forked += self._add_chunk(plan, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        self.running += forked

    def _grammar_ready(self, request: Request) -> bool:
        """Start the request's matcher once its grammar is compiled; a grammar that does not
        compile fails its request alone (a 400 naming the parameter)."""
        try:
            request.matcher = self.grammars.start(request.params.structured_outputs)
        except ProtocolError as exc:
            self.abort([request.request_id], FinishReason.ERROR, ErrorInfo(message=exc.message, param=exc.param))
            return False
        if request.matcher is None:
            return False
        if request.output_token_ids:  # a resumed request's outputs (failover, P/D)
            request.matcher.accept_many(request.output_token_ids)
        request.status = RequestStatus.WAITING_FOR_KV if request.kv_handle is not None else RequestStatus.WAITING
        return True

    def _add_chunk(self, plan: SchedulerOutput, request: Request, num_new: int) -> list[Request]:
        start = request.num_computed_tokens
        end = start + num_new
        sample = end == request.num_tokens
        plan.chunks.append(ScheduledChunk(request.request_id, request.token_ids[start:end], start,
                                          tuple(request.block_table), sample))
        self._scheduled.append(request)
        if not sample:
            return []
        row = plan.sampling[-1].logits_row + 1 if plan.sampling else 0
        children = self._fork_children(request, end) if request.num_children_pending else []
        for sequence in [request, *children]:
            plan.sampling.append(self._sample_row(sequence, row))
            self._sampled[sequence.key] = sequence
        return children

    def _sample_row(self, request: Request, row: int) -> SampleRow:
        params = request.params
        beam = request.beam
        return SampleRow(request.key, row, params, request.num_prompt_tokens,
                         history=tuple(request.token_ids) if params.uses_history else (),
                         ban_stop=request.num_output_tokens < params.min_tokens,
                         beam_candidates=beam.search.num_candidates if beam is not None else 0,
                         seed=request.seed, num_output_tokens=request.num_output_tokens,
                         generator=request.generator, matcher=request.matcher)

    def _fork_children(self, parent: Request, num_computed: int) -> list[Request]:
        """n > 1: the prompt was computed once; the other n - 1 sequences share its blocks."""
        children = []
        for index in range(parent.params.n - parent.num_children_pending, parent.params.n):
            child = parent.spawn(index, list(parent.token_ids), status=RequestStatus.RUNNING,
                                 generator=make_generator(parent.params.seed, index, self.generator_device))
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = num_computed
            self.requests[parent.request_id].append(child)
            children.append(child)
        parent.num_children_pending = 0
        return children

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self.stats.num_preemptions += 1
        request.preemption_times.append(self._step_start)

    # ------------------------------------------------------------------ update
    def update(self, plan: SchedulerOutput, sampled: SamplerOutput) -> list[TokenDelta]:
        """Advance the sequences by what the step computed and sampled; report new tokens."""
        now = self.clock()
        if plan.chunks and all(is_decode(r, len(c.token_ids)) for r, c in zip(self._scheduled, plan.chunks)):
            self.stats.decode_step_seconds.append(now - self._step_start)
        for request, chunk in zip(self._scheduled, plan.chunks):
            request.num_computed_tokens += len(chunk.token_ids)
            note_chunk(request, len(chunk.token_ids), self._step_start, now, self.record_decode_steps)
        deltas, self._aborted = self._aborted, []
        any_finished = False
        groups: list[BeamGroup] = []
        for key, request in self._sampled.items():
            if request.is_finished:  # aborted while the step ran
                continue
            note_token(self.stats, request, now)
            if request.beam is not None:
                request.beam.rows[request] = sampled.beam_candidates[key]
                if request.beam not in groups:
                    groups.append(request.beam)
                continue
            token_id = sampled.token_ids[key]
            request.append_token(token_id, sampled.logprobs.get(key))
            check_stop(request, token_id, self.eos_token_ids, self.max_model_len)
            if request.matcher is not None and not request.is_finished:
                self._advance_grammar(request, token_id)
            deltas.append(make_delta(request))
            if request.hand_off and not request.is_finished:
                self._handoffs.append(request)
            if request.is_finished:
                any_finished = True
                self.block_manager.free(request)
                self._forget(request)
                self.stats.finished.append(finished_record(request, now, self._max_tokens(request)))
        for group in groups:
            if group.is_ready():
                deltas += self._advance_beams(group, now)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        self._scheduled, self._sampled = [], {}
        return deltas

    def _advance_beams(self, group: BeamGroup, now: float) -> list[TokenDelta]:
        """One beam-search step: fork the chosen parents (sharing all their blocks), drop the rest."""
        old = group.beams
        moves = group.search.step([group.rows[beam] for beam in old])
        group.beams = [] if group.search.done else [self._fork_beam(old[p], token, slot)
                                                     for slot, (p, token) in enumerate(moves)]
        group.rows = {}
        for beam in old:
            self.block_manager.free(beam)
            if beam.status != RequestStatus.RUNNING:
                self.waiting.remove(beam)
            beam.status = RequestStatus.FINISHED
        first = old[0]
        if not group.search.done:
            self.requests[first.request_id] = group.beams
            return []
        del self.requests[first.request_id]
        finals = beam_deltas(first, group.search.best(first.params.n))
        record = finished_record(first, now, self._max_tokens(first))
        self.stats.finished += [dataclasses.replace(record, index=d.index, finish_reason=d.finish_reason,
                                                    num_generation_tokens=len(d.new_token_ids)) for d in finals]
        return finals

    def _fork_beam(self, parent: Request, token_id: int, slot: int) -> Request:
        child = parent.spawn(slot, parent.token_ids + [token_id])
        if child.matcher is not None:
            child.matcher.accept(token_id)
        if parent.block_table:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:  # the parent was preempted: the child recomputes
            child.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(child)
        return child

    @staticmethod
    def _advance_grammar(request: Request, token_id: int) -> None:
        """A grammar that is complete (its stop token accepted) ends the sequence, as does a token
        it cannot accept (only when every allowed token was banned, e.g. by min_tokens)."""
        if not request.matcher.accept(token_id) or request.matcher.is_terminated():
            request.finish(FinishReason.STOP)

    # ------------------------------------------------------------------ P/D
    def take_handoffs(self) -> list[Request]:
        """Prefill side: the sequences this step brought to their hand-off (a token sampled, not
        finished); each stays here, blocks and all, until ``hand_off()``."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def hand_off(self, request: Request) -> None:
        """Prefill side: the request left for a decode engine (its KV saved, or not): forget it.
        Its full prompt blocks stay in the prefix cache, as a finished request's do."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]

    def take_kv_loads(self) -> list[Request]:
        """Decode side: the WAITING_FOR_KV requests that may load now, FCFS, each given the blocks
        of its ``num_kv_tokens`` tokens (as an admission would, under max_num_seqs and the free blocks)."""
        loads: list[Request] = []
        for request in self.waiting:
            if request.status != RequestStatus.WAITING_FOR_KV:
                continue
            if len(self.running) + len(loads) >= self.config.max_num_seqs:
                break
            # no prefix-cache registration before the load: a failed load's blocks hold garbage
            # and must never become hits (kv_loaded() re-enables it; the next allocation registers)
            request.num_registered_blocks = len(self.block_manager.blocks)
            if not self.block_manager.allocate_slots(request, request.num_kv_tokens):
                request.num_registered_blocks = 0
                break
            loads.append(request)
        return loads

    def kv_loaded(self, request: Request, ok: bool) -> None:
        """Decode side: the engine loaded the request's KV (``ok``) and it runs from its last token,
        or it could not and the request waits, in its place, to be computed from scratch."""
        request.kv_handle = None  # consumed either way (a load takes the entry)
        request.num_registered_blocks = 0
        if not ok:
            self.block_manager.free(request)
            request.status = RequestStatus.WAITING
            return
        self.waiting.remove(request)
        request.num_computed_tokens = request.num_kv_tokens
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = self.clock()
        self.running.append(request)

    def take_dropped_handles(self) -> list[str]:
        """KV handles of requests dropped (aborted, expired, failed) before their load."""
        handles, self._dropped_handles = self._dropped_handles, []
        return handles

    # ------------------------------------------------------------------ stats
    def take_stats(self) -> IterationStats:
        """What happened since the last call (see IterationStats)."""
        stats, self.stats = self.stats, IterationStats()
        return stats

    def _max_tokens(self, request: Request) -> int:
        return request.params.max_tokens or self.max_model_len - request.num_prompt_tokens

    def take_aborted(self) -> list[TokenDelta]:
        deltas, self._aborted = self._aborted, []
        return deltas

    def _forget(self, request: Request) -> None:
        family = self.requests.get(request.request_id)
        if family is not None and all(r.is_finished for r in family) and not any(
                r.num_children_pending for r in family):
            del self.requests[request.request_id]
