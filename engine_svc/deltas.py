"""What one sequence tells the world: its token deltas, and when it must stop. Pure functions of
a Request (no scheduling decisions here)."""

from __future__ import annotations

from collections.abc import Collection

from engine_svc.request import Request
from shared.protocol import FinishReason, TokenDelta


def check_stop(request: Request, token_id: int, eos_token_ids: Collection[int], max_model_len: int) -> None:
    """Finish ``request`` if the token it just sampled ends it: a stop token or EOS (once
    min_tokens are out), max_tokens, or the model's length."""
    params = request.params
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return request.finish(FinishReason.STOP, stop_reason=token_id)
        if not params.ignore_eos and token_id in eos_token_ids:
            return request.finish(FinishReason.STOP)
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return request.finish(FinishReason.LENGTH)
    if request.num_tokens >= max_model_len:
        return request.finish(FinishReason.LENGTH)


def make_delta(request: Request) -> TokenDelta:
    """The tokens (and logprobs) sampled since the last delta, and the finish if it finished."""
    wants_logprobs = request.params.logprobs is not None
    delta = TokenDelta(
        request_id=request.request_id, seq=request.num_deltas_sent, index=request.index,
        new_token_ids=tuple(request.pending_token_ids),
        logprobs=tuple(request.pending_logprobs) if wants_logprobs else None,
        cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
        finish_reason=int(request.finish_reason) if request.finish_reason else None,
        stop_reason=request.stop_reason, num_prompt_tokens=request.num_prompt_tokens,
        # a resumed request's prefix-cache hit may reach into its re-prefilled outputs
        num_cached_tokens=min(request.num_cached_tokens, request.num_prompt_tokens), num_choices=request.params.n)
    request.num_deltas_sent += 1
    request.pending_token_ids = []
    request.pending_logprobs = []
    return delta


def final_delta(first: Request, index: int, reason: FinishReason) -> TokenDelta:
    """The token-less final delta of a choice that never produced one (a child not forked yet, a
    beam request's choice); ``first`` is the request's first sequence."""
    return TokenDelta(request_id=first.request_id, seq=0, index=index, finish_reason=int(reason),
                      num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens,
                      num_choices=first.params.n)


def beam_deltas(first: Request, best: list) -> list[TokenDelta]:
    """A finished beam search's n choices: its best hypotheses (``BeamSearch.best``) as final
    deltas, and an empty LENGTH one for each choice it found no hypothesis for."""
    n = first.params.n
    finals = [TokenDelta(request_id=first.request_id, seq=0, index=i, new_token_ids=tuple(h.token_ids),
                         cumulative_logprob=h.cumulative_logprob,
                         finish_reason=int(FinishReason.STOP if h.ends_with_eos else FinishReason.LENGTH),
                         num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens,
                         num_choices=n)
              for i, h in enumerate(best)]
    return finals + [final_delta(first, i, FinishReason.LENGTH) for i in range(len(best), n)]
