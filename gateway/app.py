"""The Starlette app: the OpenAI endpoints, health, metrics, tokenize; the lifespan opens the bus.

An endpoint only parses and checks the HTTP request, turns each prompt into one GenerateRequest
and hands their Submission to a ``Responder``, which writes it out. Nothing here waits on
Redis except through the collector's inboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
import uuid

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.auth import APIKeyMiddleware
from gateway.config import accepts_model
from gateway.context import GatewayContext
from gateway.errors import APIError, not_found_model
from gateway.openai_protocol.request_bodies import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    ServerOptions, TokenizeRequest)
from gateway.renderer import ChatCompletionRenderer, TextCompletionRenderer
from gateway.responder import Responder
from gateway.submission import Submission
from shared.config import GatewayConfig, GatewayLimits
from shared.protocol import MAX_MESSAGE_BYTES, MAX_PROMPT_TOKENS, GenerateRequest, ProtocolError
from shared.telemetry import CONTENT_TYPE_LATEST, GatewayMetrics, render_bus

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0+local"


class Endpoints:
    """The HTTP handlers of one gateway; they share its GatewayContext and metrics."""

    def __init__(self, ctx: GatewayContext, metrics: GatewayMetrics):
        self.ctx = ctx
        self.config = ctx.config
        self.limits = ctx.limits
        self.metrics = metrics
        self.options = ServerOptions(
            disable_any_whitespace=self.config.disable_any_whitespace,
            tool_call_parser=self.config.tool_call_parser if self.config.enable_auto_tool_choice else None)

    # ----------------------------------------------------------------- generation
    async def completions(self, request: Request):
        body = await self._parse(request, CompletionRequest)
        prompts = body.prompts()
        params = body.sampling_params(self.options)
        for prompt in prompts:
            if isinstance(prompt, tuple):
                self._check_prompt_len(len(prompt))
            else:
                self._check_prompt_chars(len(prompt), "prompt")
        response_id = f"cmpl-{uuid.uuid4().hex}"
        timeout_s = body.timeout_s(self.limits.idle_timeout_s)
        requests = [self._bus_request(f"{response_id}-{i}", params, timeout_s, echo=body.echo,
                                  cache_salt=body.cache_salt, prompt=p if isinstance(p, str) else None,
                                  prompt_token_ids=p if isinstance(p, tuple) else None)
                    for i, p in enumerate(prompts)]
        echo_texts = [p if isinstance(p, str) else None for p in prompts]
        renderer = TextCompletionRenderer(response_id, self.ctx.model_name, want_logprobs=body.logprobs is not None)
        return await self._submit(requests, renderer, body, echo_texts, headers=request.headers)

    async def chat_completions(self, request: Request):
        body = await self._parse(request, ChatCompletionRequest)
        messages = body.chat_messages()
        self._check_prompt_chars(sum(len(m.content) for m in messages), "messages")
        tools = body.tool_policy(self.options)
        params = body.sampling_params(self.options, tools)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        requests = [self._bus_request(f"{response_id}-0", params, body.timeout_s(self.limits.idle_timeout_s),
                                      messages=messages, cache_salt=body.cache_salt,
                                  add_generation_prompt=body.add_generation_prompt, tools=body.tools_json())]
        renderer = ChatCompletionRenderer(response_id, self.ctx.model_name, want_logprobs=body.logprobs,
                                          tools=tools)
        return await self._submit(requests, renderer, body, headers=request.headers)

    def _bus_request(self, request_id: str, params, timeout_s: float, **fields) -> GenerateRequest:
        now = time.time()  # the deadline is the one timeout of a request (gateway/submission.py)
        return GenerateRequest(request_id=request_id, reply_to=self.ctx.reply_to, sampling=params,
                               arrival_time=now, deadline=now + timeout_s, **fields)

    async def _submit(self, requests, renderer, body, echo_texts=None, headers=None) -> Responder:
        if self.ctx.num_in_flight >= self.limits.max_pending_requests:
            raise APIError(429, "too many requests in flight; retry later")
        if self.limits.max_body_bytes > MAX_MESSAGE_BYTES // 2:  # else no message can be near the bus's limit
            _check_message_sizes(requests)
        span, requests = self.ctx.trace_requests(requests, headers)  # (None, requests) with tracing off
        submission = Submission(self.ctx, requests, echo_texts=echo_texts, param_names=body.param_names())
        await submission.start()
        self.ctx.num_in_flight += 1
        self.ctx.log_request(submission, span)
        return Responder(submission, renderer, stream=body.stream, include_usage=body.include_usage,
                         on_done=lambda done, status: self._on_done(done, status, span))

    def _on_done(self, submission: Submission, status: int, span=None) -> None:
        self.ctx.num_in_flight -= 1
        reasons = observe(self.metrics, submission, status)
        self.ctx.end_request(submission, status, reasons, span)

    async def _parse(self, request: Request, model: type[BaseModel]):
        _check_content_type(request)
        raw = await _read_body(request, self.limits.max_body_bytes, self.limits.body_timeout_s)
        try:
            body = model.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            raise APIError.from_validation(exc) from None
        if not accepts_model(self.config, getattr(body, "model", None)):
            raise not_found_model(body.model)
        return body

    def _check_prompt_len(self, num_tokens: int) -> None:
        limit = self.ctx.max_model_len
        if limit is not None and num_tokens >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                f"has {num_tokens} tokens, which leaves no room for output.", "prompt")
        if num_tokens > MAX_PROMPT_TOKENS:  # max_model_len not known here yet: the bus's own limit
            raise APIError(400, f"a prompt may hold at most {MAX_PROMPT_TOKENS} token ids", "prompt")

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        """A text that cannot fit max_model_len tokens is refused before it is published or tokenized
        (known once the tokenizer is loaded: GatewayContext.max_prompt_chars)."""
        limit = self.ctx.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise APIError(400, f"This model's maximum context length is {self.ctx.max_model_len} tokens; a "
                                f"prompt of {num_chars} characters cannot fit it (at most {limit}).", param)

    # ----------------------------------------------------------------- the rest
    async def models(self, request: Request) -> JSONResponse:
        card = {"id": self.ctx.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "pagedserve", "root": self.config.model or self.ctx.model_name, "parent": None,
                "max_model_len": self.config.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> JSONResponse:
        """From the background poll's last reading, never a Redis call (gateway/health.py). The
        live services' ids (hosts, pids) only for a caller with the API key."""
        ready = self.ctx.readiness()
        if not ready.is_ready:
            raise APIError(503, ready.problem)
        detail = {"services": list(ready.live)} if getattr(request.state, "is_authorized", False) else {}
        return JSONResponse({"status": "ok", **detail})

    async def version(self, request: Request) -> JSONResponse:
        return JSONResponse({"version": _version()})

    async def get_metrics(self, request: Request) -> Response:
        """This gateway's own figures; the engines serve theirs (shared/telemetry.py)."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def get_bus_metrics(self, request: Request) -> Response:
        """The bus, read from Redis now: the same from every gateway (scrape one)."""
        try:
            snapshot = await self.ctx.bus_snapshot()
        except Exception as exc:
            raise APIError(503, f"Redis is unreachable: {exc}") from None
        return Response(render_bus(snapshot), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await self._parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        tokenizer = await self.ctx.tokenizer()
        if body.prompt is not None:
            self._check_prompt_chars(len(body.prompt), "prompt")
        else:
            self._check_prompt_chars(sum(len(m.to_message().content) for m in body.messages), "messages")
        if body.messages is not None:
            chat = [{"role": m.role, "content": m.to_message().content} for m in body.messages]
            text = await asyncio.to_thread(tokenizer.apply_chat_template, chat, tokenize=False,
                                           add_generation_prompt=body.add_generation_prompt)
            ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": list(ids),
                             "token_strs": None})

    async def detokenize(self, request: Request) -> JSONResponse:
        body = await self._parse(request, DetokenizeRequest)
        tokenizer = await self.ctx.tokenizer()
        if any(not 0 <= t < len(tokenizer) for t in body.tokens):
            raise APIError(400, "token id out of the vocabulary", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})


def observe(metrics: GatewayMetrics, submission: Submission, status: int) -> list[str]:
    """Feed one finished HTTP request to the Prometheus series: one success per choice, by the
    reason the client got (an unfinished choice: "abort" when the client left, "error" when the
    request failed), and its latencies when it succeeded. Returns the reasons."""
    unfinished = "abort" if status in (200, 499) else "error"
    reasons = [c.finish_reason_str or unfinished for c in submission.choices]
    ok = status == 200 and submission.first_output_time is not None
    metrics.observe_request(finish_reasons=reasons, e2e_s=time.monotonic() - submission.start_time if ok else None,
                            ttft_s=submission.first_output_time - submission.start_time if ok else None,
                            itl_s=submission.output_gaps if ok else ())
    return reasons


def _check_content_type(request: Request) -> None:
    """A JSON endpoint takes application/json (or a +json type); a body sent as another type is
    refused, not parsed anyway (a missing content type is read as JSON, as FastAPI does)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"Unsupported Media Type: Only 'application/json' is allowed, not '{media_type}'",
                       "content-type")


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body exceeds {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):  # a half-sent body holds nothing past this
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body was not received within {timeout_s:g}s",
                       headers={"connection": "close"}) from None
    return b"".join(chunks)


def _check_message_sizes(requests) -> None:
    """Each GenerateRequest must fit the bus (MAX_MESSAGE_BYTES), or it could never be delivered."""
    for r in requests:
        size = len(r.to_wire())
        if size > MAX_MESSAGE_BYTES:
            raise APIError(413, f"the request is too large to serve ({size} bytes; at most {MAX_MESSAGE_BYTES})")


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _protocol_error(request: Request, exc: ProtocolError) -> Response:
    return APIError.from_protocol(exc).response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return APIError(500, f"internal error: {type(exc).__name__}").response()


def build_app(config: GatewayConfig, limits: GatewayLimits | None = None, *,
              context: GatewayContext | None = None) -> Starlette:
    """The ASGI app; nothing connects until the lifespan starts. ``context`` is for unit tests."""
    ctx = context if context is not None else GatewayContext(config, limits)
    endpoints = Endpoints(ctx, GatewayMetrics(ctx.model_name))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await ctx.open()
        try:
            yield
        finally:
            await ctx.close()

    app = Starlette(
        routes=[
            Route("/v1/completions", endpoints.completions, methods=["POST"]),
            Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
            Route("/v1/models", endpoints.models, methods=["GET"]),
            Route("/health", endpoints.health, methods=["GET"]),
            Route("/version", endpoints.version, methods=["GET"]),
            Route("/metrics", endpoints.get_metrics, methods=["GET"]),
            Route("/metrics/bus", endpoints.get_bus_metrics, methods=["GET"]),
            Route("/tokenize", endpoints.tokenize, methods=["POST"]),
            Route("/detokenize", endpoints.detokenize, methods=["POST"]),
        ],
        exception_handlers={APIError: _api_error, ProtocolError: _protocol_error, HTTPException: _http_error,
                            Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    return app
