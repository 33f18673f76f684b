"""Observability of a whole stack with two gateways: exact figures whose sums over every scraped
endpoint equal the workload's known totals, and `pagedserve status` listing every service (and
marking a killed one stale)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.redis_server import free_port
from tests.e2e.stack import ROOT, Stack
from tests.unit.test_engine_metrics import ENGINE_NAMES  # the list of engine series

GATEWAY_NAMES = ("request_success_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds")
# 64 usable blocks of 16 and 2 sequences at most: two 16 + 1000 token sequences meet at 512 tokens
# each, where the newer is preempted (once: it cannot come back before the other one finishes)
ENGINE_ARGS = ["--enforce-eager", "--served-model-name", "tiny", "--block-size", "16", "--num-gpu-blocks-override",
               "65", "--max-num-seqs", "2", "--max-num-batched-tokens", "1024"]


@pytest.fixture(scope="module")
def two_gateways(redis_url, tiny_llama_dir, tmp_path_factory):
    stack = Stack(redis_url, tiny_llama_dir, tmp_path_factory.mktemp("obs-logs"), max_model_len=1024,
                  engine_args=ENGINE_ARGS)
    stack.start()
    second_port = free_port()
    stack.start_service("gateway-1", "gateway", "--port", str(second_port), "--served-model-name", "tiny",
                        "--gateway-id", "g1", "--log-level", "warning")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{second_port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stack.second_url = f"http://127.0.0.1:{second_port}"
    yield stack
    stack.stop()


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _scrape(url: str) -> dict[str, float]:
    """Sample name (prefix dropped, labels folded into the name) -> value, parsed by prometheus_client."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url).text):
        for sample in family.samples:
            if sample.name.endswith("_created") or "le" in sample.labels:
                continue
            extra = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                             if k not in ("model_name", "engine"))
            out[sample.name.removeprefix("pagedserve:") + (f"{{{extra}}}" if extra else "")] = sample.value
    return out


def _sum(scrapes: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for scrape in scrapes:
        for name, value in scrape.items():
            total[name] = total.get(name, 0.0) + value
    return total


def test_summing_every_endpoint_gives_the_exact_totals(two_gateways):
    stack = two_gateways
    first, second = _client(stack.base_url), _client(stack.second_url)
    no_eos = {"ignore_eos": True}
    shared = [(i * 7) % 500 + 3 for i in range(40)]
    first.completions.create(model="tiny", prompt=shared, max_tokens=5, temperature=0, extra_body=no_eos)
    second.completions.create(model="tiny", prompt=shared, max_tokens=5, temperature=0, extra_body=no_eos)  # 32 hit
    pair = [[(i * 11) % 500 + 3 for i in range(16)], [(i * 13) % 500 + 5 for i in range(16)]]
    stream = first.completions.create(model="tiny", prompt=pair, max_tokens=1000, temperature=0, stream=True,
                                      extra_body=no_eos)
    chunks = iter(stream)
    next(chunks)  # the pair runs: a third request waits behind it (max 2 sequences), then its client leaves
    _leave_once_queued(stack)
    reasons = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "length", 1: "length"}
    with pytest.raises(openai.BadRequestError):  # refused by the tokenizer: one error
        first.completions.create(model="tiny", prompt=[5] * 10, max_tokens=2000)
    stack.assert_idle()

    gateways = [_scrape(stack.base_url + "/metrics"), _scrape(stack.second_url + "/metrics")]
    engine = _scrape(stack.engine_metrics_url)
    assert "prompt_tokens_total" not in _sum(gateways) and "request_success_total{finished_reason=stop}" not in engine
    totals = _sum(gateways + [engine])
    assert {r: totals[f"request_success_total{{finished_reason={r}}}"] for r in ("stop", "length", "abort", "error")} \
        == {"stop": 0, "length": 4, "abort": 1, "error": 1}
    assert totals["time_to_first_token_seconds_count"] == totals["e2e_request_latency_seconds_count"] == 3
    assert totals["prompt_tokens_total"] == 40 + 40 + 16 + 16  # the waiting request never ran
    assert totals["generation_tokens_total"] == 5 + 5 + 1000 + 1000
    assert totals["num_preemptions_total"] == 1
    assert totals["prefix_cache_queries_total"] == 40 + 40 + 16 + 16
    assert totals["prefix_cache_hits_total"] == 32
    for name in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds", "inference_time_seconds",
                 "prompt_tokens", "generation_tokens"):
        assert totals[f"request_{name}_count"] == 4, name
    assert totals["request_generation_tokens_sum"] == 2010
    assert totals["request_params_n_count"] == 5  # the one that left was admitted
    assert totals["num_requests_running"] == totals["num_requests_waiting"] == 0
    present = {name.split("{")[0] for name in totals}
    assert [n for n in GATEWAY_NAMES + ENGINE_NAMES if n not in present and f"{n}_count" not in present] == []

    # message totals come from the replicas' heartbeats (one a second): wait for the beat that
    # follows the last message, a few beats at most
    deadline = time.monotonic() + 5.0
    while True:
        bus = httpx.get(stack.base_url + "/metrics/bus").text
        families = {f.name: f for f in text_string_to_metric_families(bus)}
        messages = {s.labels["service_id"]: s.value for s in families["pagedserve:bus_messages"].samples
                    if s.name.endswith("_total")}
        if (messages.get("tokenizer-0"), messages.get("engine-0")) == (6, 5) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    pending = {(s.labels["stream"], s.labels["group"]): s.value for s in families["pagedserve:bus_group_pending"].samples}
    assert pending[(stack.names.engine_in, "engine")] == 0 and pending[(stack.names.tokenizer_in, "tokenizer")] == 0
    assert messages["tokenizer-0"] == 6 and messages["engine-0"] == 5  # the refused one never reached an engine


def _leave_once_queued(stack: Stack) -> None:
    """A request whose client gives up (the gateway answers it 499: abort) as soon as the engine
    shows it queued, and long before the pair ahead of it can finish: a client that left after a
    fixed time was outrun on a fast machine, where the pair finished first and the third request ran."""
    body = json.dumps({"model": "tiny", "prompt": [(i * 19) % 500 + 9 for i in range(16)], "max_tokens": 10})
    host, port = stack.second_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 30
        while _scrape(stack.engine_metrics_url).get("num_requests_waiting", 0) < 1:
            assert time.monotonic() < deadline, "the third request never reached the engine's queue"
            time.sleep(0.005)


def _status(stack: Stack, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", "status", "--redis-url", stack.redis_url,
                           "--prefix", stack.prefix, *extra], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_status_lists_every_service_and_marks_a_killed_one_stale(two_gateways):
    stack = two_gateways
    rows = {r["service_id"]: r for r in json.loads(_status(stack, "--json").stdout)}
    expected = {"gateway-g0", "gateway-g1", "tokenizer-0", "engine-0", "detok-0"}
    assert set(rows) == expected
    assert {r["role"] for r in rows.values()} == {"gateway", "tokenizer", "engine", "detok"}
    assert rows["engine-0"]["pid"] == stack.service("engine").proc.pid
    assert not any(r["stale"] for r in rows.values()) and all(r["uptime_s"] > 0 for r in rows.values())
    victim = stack.service("tokenizer-0")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    time.sleep(2.5)
    result = _status(stack, "--stale-after", "2")
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(lines) == expected and result.returncode == 0
    assert "STALE" in lines["tokenizer-0"] and all("STALE" not in lines[s] for s in expected - {"tokenizer-0"})
