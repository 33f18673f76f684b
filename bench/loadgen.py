"""A closed-loop load generator for OpenAI-compatible /v1/completions servers (streaming), and the
latency statistics every serving benchmark prints: output tokens/s, TTFT and ITL percentiles.

Closed loop: `concurrency` workers each send a request, read its SSE stream to the end, and send
the next, until the requests or the time limit run out. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

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


async def _one(client, url: str, body: dict) -> Result:
    result = Result(sent=time.time())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                now = time.time()  # before parsing: the client's own work should not count as latency
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                _take_chunk(result, json.loads(data), now)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports failures, it does not stop on them
        result.error = f"{type(exc).__name__}: {exc}"
    result.done = time.time()
    if not result.num_tokens:
        result.num_tokens = len(result.chunk_times)
    return result


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
    import httpx

    queue = list(reversed(specs))
    results: list[Result] = []
    deadline = time.time() + time_limit_s
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def worker(client):
        while queue and time.time() < deadline:
            spec = queue.pop()
            body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
                    "stream": True, **_per_request(extra, spec)}
            result = await _one(client, f"{base_url}/v1/completions", body)
            results.append(result)
            if progress is not None:
                progress.update(result.num_tokens, f"{len(results)}/{len(specs)} requests")

    start = time.time()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results, time.time() - start


def _per_request(extra: dict, spec: Spec) -> dict:
    """`extra` values that are callables get the spec (e.g. transformers' generation_config JSON)."""
    return {k: (v(spec) if callable(v) else v) for k, v in extra.items()}


def run_closed_loop(base_url: str, model: str, specs: list[Spec], concurrency: int, *, extra: dict | None = None,
                    time_limit_s: float = 600.0, progress=None) -> tuple[list[Result], float]:
    """Send `specs` with `concurrency` requests in flight; (results, wall seconds)."""
    return asyncio.run(_closed_loop(base_url, model, specs, concurrency, extra or {}, time_limit_s, progress))


def wait_http(url: str, timeout_s: float, proc=None) -> bool:
    """Poll `url` until it answers 200 (False on timeout or when `proc` exits)."""
    import urllib.error
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False
