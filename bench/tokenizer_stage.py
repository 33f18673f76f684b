"""The tokenizer stage alone, for bench/tokenizer_scaling.py: how many requests/s R tokenizer
replicas turn from GenerateRequests into EngineRequests when nothing downstream limits them.

A Redis with its ACL users (shared/redis_server.py) is started on `host`; K signed GenerateRequests
(chat messages of real text, max_tokens 1) are written to ps:tokenizer:in before any tokenizer
runs; then R `python -m tokenizer_svc` processes start (inside the network namespace when one is
given, as the tokenizer role with the bus secret in their environment) and drain the backlog into
ps:engine:in, which no engine reads. The rate is taken from the Redis stream ids (the server's ms
clock) of the EngineRequests between the 10th and the 90th percentile of the backlog, when every
replica has loaded its tokenizer and none has run dry. CPU per request from /proc.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from common import stop_group
from stack import process_cpu

REPLY_TO = "ps:gateway:bench-stage:out"


def preload(client, signer, texts: list[str]) -> None:
    from shared.protocol import ChatMessage, GenerateRequest, SamplingParams, StreamNames
    from shared.streams import Producer

    producer = Producer(client, maxlen=10 * len(texts) + 1000, signer=signer)
    stream = StreamNames().tokenizer_in
    msgs = [(stream, GenerateRequest(request_id=f"stage-{i}", reply_to=REPLY_TO,
                                     messages=(ChatMessage(role="user", content=text),),
                                     sampling=SamplingParams(temperature=0.0, max_tokens=1), arrival_time=time.time()))
            for i, text in enumerate(texts)]
    for i in range(0, len(msgs), 200):
        producer.send_many(msgs[i:i + 200])


def tokenized(client, after: str = "-") -> tuple[list[int], str]:
    """ms stamps, one per EngineRequest in ps:engine:in after the entry id `after`; the last id seen."""
    from shared.entries import payloads
    from shared.protocol import StreamNames

    stamps, last = [], after
    for entry_id, fields in client.xrange(StreamNames().engine_in, min=after if after == "-" else "(" + after):
        last = entry_id.decode()
        stamps += [int(last.split("-")[0])] * len(payloads(fields))
    return stamps, last


def run_stage(model: Path, replicas: int, texts: list[str], ns, log_dir: Path, timeout_s: float = 600.0) -> dict:
    import redis

    from shared.bus_auth import BusSigner, generate_secret
    from shared.redis_server import RedisAcl, RedisServer

    acl, secret = RedisAcl.generate("ps"), generate_secret()
    host = ns.host_address if ns is not None else "127.0.0.1"
    with RedisServer(host=host, acl=acl) as server:
        client = redis.Redis.from_url(server.url)
        preload(client, BusSigner.of(secret), texts)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PAGEDSERVE_REDIS_USERNAME": "tokenizer",
               "PAGEDSERVE_REDIS_PASSWORD": acl.role_passwords["tokenizer"], "PAGEDSERVE_BUS_SECRET": secret}
        url = f"redis://{host}:{server.port}/0"
        procs, where = [], ("netns" if ns is not None else "local")
        try:
            for i in range(replicas):
                argv = [sys.executable, "-m", "tokenizer_svc", "--redis-url", url, "--model", str(model),
                        "--service-id", f"tokenizer-{where}-{i}"]
                argv = ns.exec_argv(argv) if ns is not None else argv
                log = open(log_dir / f"stage-{where}-t{replicas}-{i}.log", "wb")
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0,
                                              cwd=Path(__file__).resolve().parent.parent))
            roots = [server.process.pid, *(p.pid for p in procs)]
            stamps, last, deadline, marks = [], "-", time.time() + timeout_s, []
            while len(stamps) < len(texts) and time.time() < deadline:
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"a tokenizer exited; see {log_dir}/stage-{where}-t{replicas}-*.log")
                if client.xlen(REPLY_TO):
                    raise RuntimeError(f"the tokenizers answered errors: {client.xrange(REPLY_TO, count=1)}")
                more, last = tokenized(client, last)
                stamps += more
                # CPU between 10% and 90% of the backlog: no start-up (loading the tokenizer) in it
                while len(marks) < 2 and len(stamps) >= len(texts) * (1 + 8 * len(marks)) // 10:
                    marks.append((len(stamps), process_cpu(roots)))
                time.sleep(0.2)
        finally:
            for p in procs:
                stop_group(p)
        if len(stamps) < len(texts):
            raise RuntimeError(f"only {len(stamps)} of {len(texts)} tokenized in {timeout_s:g} s")
    lo, hi = stamps[len(stamps) // 10], stamps[len(stamps) * 9 // 10]
    n = len(stamps) * 9 // 10 - len(stamps) // 10
    (n0, cpu0), (n1, cpu1) = marks
    cpu = {k: (v - cpu0.get(k, 0.0)) * 1e3 / max(n1 - n0, 1) for k, v in sorted(cpu1.items())}
    return {"requests_per_s": n / max((hi - lo) / 1e3, 1e-3), "num_requests": len(texts),
            "cpu_ms_per_request": {k: v for k, v in cpu.items() if v > 0},
            "tokenizer_command": " ".join(argv)}
