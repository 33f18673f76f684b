"""A closed-loop load generator for OpenAI-compatible /v1/completions servers (streaming), and the
latency statistics every serving benchmark prints: output tokens/s, TTFT and ITL percentiles.

Closed loop: `concurrency` workers each send a request, read its SSE stream to the end, and send
the next, until the requests or the time limit run out. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from common import percentile


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of a workload: a prompt (text or token ids) and how many tokens to generate."""

    prompt: str | list[int]
    max_tokens: int


@dataclass(slots=True)
class Result:
    """What a client saw of one request (times from time.time(), seconds)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried text
    num_tokens: int = 0  # usage.completion_tokens when the server reports it, else the text chunks
    response_id: str | None = None
    error: str | None = None
    done: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(slots=True)
class Summary:
    """One system at one concurrency."""

    name: str
    concurrency: int
    num_requests: int
    num_errors: int
    seconds: float
    num_tokens: int
    ttfts: list[float]
    itls: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")

    def row(self) -> list:
        ms = lambda xs, q: percentile(xs, q) * 1e3  # noqa: E731
        return [self.name, self.concurrency, f"{self.num_requests - self.num_errors}/{self.num_requests}",
                self.num_tokens, self.seconds, self.tokens_per_s, ms(self.ttfts, 50), ms(self.ttfts, 99),
                ms(self.itls, 50), ms(self.itls, 99)]


ROW_HEADER = ["system", "conc.", "ok", "out tokens", "seconds", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
              "ITL p50 ms", "ITL p99 ms"]


def summarize(name: str, concurrency: int, results: list[Result], seconds: float) -> Summary:
    ok = [r for r in results if r.error is None]
    return Summary(name, concurrency, len(results), len(results) - len(ok), seconds,
                   sum(r.num_tokens for r in ok), [r.ttft for r in ok if r.ttft is not None],
                   [x for r in ok for x in r.itls])


async def _one(host: str, port: int, path: str, body: dict) -> Result:
    """One streamed request on its own connection. While it streams, the client only stamps and
    keeps each read (``_Recorder``, a few microseconds); HTTP and SSE are parsed after the
    response ended, so at high concurrency the client's own work neither competes with the
    server for the cores nor shows up as the server's latency (httpx spends ~0.1 ms per chunk).
    An event's time is the arrival of the read that completed it."""
    result = Result(sent=time.time())
    transport = None
    try:
        loop = asyncio.get_running_loop()
        transport, recorder = await loop.create_connection(_Recorder, host, port)
        payload = json.dumps(body).encode()
        transport.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                        f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(payload)}\r\n\r\n"
                        .encode() + payload)
        await recorder.closed
        _parse_response(result, recorder.reads)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports failures, it does not stop on them
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if transport is not None:
            transport.close()
    result.done = time.time()
    if not result.num_tokens:
        result.num_tokens = len(result.chunk_times)
    return result


class _Recorder(asyncio.Protocol):
    """Keeps every read of one connection with its arrival time, until the server closes it."""

    def __init__(self):
        self.reads: list[tuple[float, bytes]] = []
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.reads.append((time.time(), data))

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _parse_response(result: Result, reads: list[tuple[float, bytes]]) -> None:
    """Status, then the SSE events of a (chunked or plain) body, each stamped with its read."""
    raw = b"".join(data for _, data in reads)
    read_ends = list(itertools.accumulate(len(data) for _, data in reads))
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        result.error = f"no HTTP head in {raw[:200]!r}"
        return
    head = raw[:head_end].decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    chunked = any(line.lower().replace(" ", "") == "transfer-encoding:chunked" for line in head[1:])
    body, body_ends = (_dechunk(raw, head_end + 4) if chunked
                       else (raw[head_end + 4:], None))
    if status != 200:
        result.error = f"HTTP {status}: {body[:200]!r}"
        return
    start = 0
    while (end := body.find(b"\n\n", start)) >= 0:
        event, start = body[start:end], end + 2
        if not event.startswith(b"data:"):
            continue
        payload = event[5:].strip()
        if payload == b"[DONE]":
            break
        raw_end = (body_ends[bisect.bisect_left(body_ends, (end + 2, -1))][1] if body_ends is not None
                   else head_end + 4 + end + 2)  # exclusive: the event's last byte is raw_end - 1
        when = reads[bisect.bisect_left(read_ends, raw_end)][0]
        _take_chunk(result, json.loads(payload), when)


def _dechunk(raw: bytes, pos: int) -> tuple[bytes, list[tuple[int, int]]]:
    """The body of a chunked response, and per chunk (body offset of its end, raw offset of its end)."""
    parts, ends, size_so_far = [], [], 0
    while True:
        line_end = raw.index(b"\r\n", pos)
        size = int(raw[pos:line_end].split(b";")[0], 16)
        if size == 0:
            break
        data_start = line_end + 2
        parts.append(raw[data_start:data_start + size])
        size_so_far += size
        ends.append((size_so_far, data_start + size))
        pos = data_start + size + 2
    return b"".join(parts), ends


def _take_chunk(result: Result, chunk: dict, now: float) -> None:
    if "error" in chunk:
        result.error = str(chunk["error"])[:200]
        return
    result.response_id = result.response_id or chunk.get("id")
    if any(c.get("text") for c in chunk.get("choices") or ()):
        result.chunk_times.append(now)
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        result.num_tokens = int(usage["completion_tokens"])


async def _closed_loop(base_url: str, model: str, specs: list[Spec], concurrency: int, extra: dict,
                       time_limit_s: float, progress) -> tuple[list[Result], float]:
    url = urlsplit(base_url)
    if url.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"load goes to 127.0.0.1 only, not {url.hostname}")
    path = (url.path.rstrip("/") or "") + "/v1/completions"
    queue = list(reversed(specs))
    results: list[Result] = []
    deadline = time.time() + time_limit_s

    async def worker():
        while queue and time.time() < deadline:
            spec = queue.pop()
            body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
                    "stream": True, **_per_request(extra, spec)}
            result = await _one(url.hostname, url.port or 80, path, body)
            results.append(result)
            if progress is not None:
                progress.update(result.num_tokens, f"{len(results)}/{len(specs)} requests")

    start = time.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.time() - start


def _per_request(extra: dict, spec: Spec) -> dict:
    """`extra` values that are callables get the spec (e.g. transformers' generation_config JSON)."""
    return {k: (v(spec) if callable(v) else v) for k, v in extra.items()}


def run_closed_loop(base_url: str, model: str, specs: list[Spec], concurrency: int, *, extra: dict | None = None,
                    time_limit_s: float = 600.0, progress=None) -> tuple[list[Result], float]:
    """Send `specs` with `concurrency` requests in flight; (results, wall seconds)."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    coro = _closed_loop(base_url, model, specs, concurrency, extra or {}, time_limit_s, progress)
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


def wait_http(url: str, timeout_s: float, proc=None) -> bool:
    """Poll `url` until it answers 200 (False on timeout or when `proc` exits)."""
    from shared.lifecycle import wait_http as wait

    return wait(url, timeout_s, lambda: proc is None or proc.poll() is None, interval_s=0.5)
