"""The servers bench/serve.py measures, as child processes on 127.0.0.1: pagedserve's whole stack
(`pagedserve serve` against a redis-server this module starts) and `transformers serve
--continuous-batching`; plus a tap on pagedserve's Redis streams that notes when each token
delta and each text delta was published (the stream entry ids are the server's clock in ms).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import wait_http  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


class Server:
    """One server process and its log file. It leads its own process group (stopped as a whole) in
    this session: same autogroup as the measuring client, as `pagedserve serve` keeps its services."""

    def __init__(self, name: str, argv: list[str], health_url: str, log_path: Path, env: dict | None = None):
        self.name, self.argv, self.health_url, self.log_path = name, argv, health_url, log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def start(self, timeout_s: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     process_group=0)
        if not wait_http(self.health_url, timeout_s, self.proc):
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} did not become healthy ({self.command}); log tail:\n{tail}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def pagedserve_server(model: Path, port: int, redis_url: str, engine_flags: list[str], log_path: Path) -> Server:
    argv = [sys.executable, "-m", "shared.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--redis-url", redis_url, *engine_flags]
    return Server("pagedserve", argv, f"http://127.0.0.1:{port}/health", log_path)


def transformers_server(model: Path, port: int, *, block_size: int, num_blocks: int, max_batch_tokens: int,
                        log_path: Path) -> Server:
    exe = Path(sys.executable).with_name("transformers")
    argv = [str(exe), "serve", str(model), "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), "--cb-block-size", str(block_size),
            "--cb-num-blocks", str(num_blocks), "--cb-max-batch-tokens", str(max_batch_tokens)]
    return Server("transformers serve", argv, f"http://127.0.0.1:{port}/health", log_path,
                  env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


class StreamTap:
    """Notes, per bus request id, the publish time (ms) of every TokenDelta and RequestOutput.

    By default it reads the detok streams once, after the run, so no process of the measurement
    competes with the stack for the CPU meanwhile; then only engine -> client is known. Since the
    detokenizer deletes the entries it has consumed (XACK + XDEL), that read finds nothing but what
    is still pending: use ``live``. ``live``: a separate process also follows the gateways' reply
    streams (trimmed as they are read) during the run, which splits the trip at the detokenizer
    but costs the stack some CPU and Redis time."""

    def __init__(self, redis_url: str, prefix: str = "ps", num_detok_shards: int = 1, live: bool = False):
        self.redis_url, self.prefix, self.num_detok_shards, self.live = redis_url, prefix, num_detok_shards, live
        self.deltas: dict[str, list[tuple[int, int, int]]] = {}  # id -> [(seq, ms, num tokens)]
        self.outputs: dict[str, list[tuple[int, int]]] = {}  # id -> [(seq, ms)]
        self.proc: subprocess.Popen | None = None
        self.out_path: Path | None = None
        self.start_ids: dict[str, str] = {}

    @property
    def detok_streams(self) -> list[str]:
        return [f"{self.prefix}:detok:in:{k}" for k in range(self.num_detok_shards)]

    def start(self) -> StreamTap:
        import tempfile

        import redis

        if not self.live:
            client = redis.Redis.from_url(self.redis_url)
            for stream in self.detok_streams:
                last = client.xrevrange(stream, count=1)
                self.start_ids[stream] = "(" + last[0][0].decode() if last else "-"
            return self
        self.out_path = Path(tempfile.mkstemp(prefix="pagedserve-tap-", suffix=".json")[1])
        self.proc = subprocess.Popen([sys.executable, __file__, "tap", self.redis_url, self.prefix,
                                      str(self.num_detok_shards), str(self.out_path)], cwd=REPO, stdout=subprocess.PIPE)
        self.proc.stdout.readline()  # "ready": it reads from the streams' current ends
        return self

    def stop(self) -> None:
        if not self.live:
            import redis

            client = redis.Redis.from_url(self.redis_url)
            deltas, outputs = defaultdict(list), defaultdict(list)
            for stream, start in self.start_ids.items():
                _note(client.xrange(stream, min=start), deltas, outputs)
            self.deltas, self.outputs = dict(deltas), dict(outputs)
            return
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        data = json.loads(self.out_path.read_text())
        self.out_path.unlink()
        self.deltas = {k: [tuple(x) for x in v] for k, v in data["deltas"].items()}
        self.outputs = {k: [tuple(x) for x in v] for k, v in data["outputs"].items()}


def _note(entries, deltas: dict, outputs: dict) -> None:
    from shared.entries import payloads
    from shared.protocol import RequestOutput, TokenDelta, decode

    for entry_id, fields in entries:
        ms = int(entry_id.split(b"-")[0])
        for msg in map(decode, payloads(fields)):
            if isinstance(msg, TokenDelta) and msg.new_token_ids:
                deltas[msg.request_id].append((msg.seq, ms, len(msg.new_token_ids)))
            elif isinstance(msg, RequestOutput) and msg.text_delta:
                outputs[msg.request_id].append((msg.seq, ms))


def _tap_main(redis_url: str, prefix: str, num_shards: int, out_path: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    streams = {f"{prefix}:detok:in:{k}": "$" for k in range(num_shards)}
    for key in client.scan_iter(match=f"{prefix}:gateway:*:out"):
        streams[key.decode()] = "$"
    deltas, outputs, stopping = defaultdict(list), defaultdict(list), []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    print("ready", flush=True)
    while not stopping:
        for stream, entries in client.xread(streams, count=1000, block=200) or []:
            streams[stream.decode()] = entries[-1][0].decode()
            _note(entries, deltas, outputs)
    Path(out_path).write_text(json.dumps({"deltas": deltas, "outputs": outputs}))


def hop_latencies(tap: StreamTap, results) -> dict[str, list[float]]:
    """Per token, seconds from the engine publishing it to the client reading it, and the split at the
    detokenizer. Entry ids have 1 ms resolution: +0.5 ms makes the estimate unbiased. A request whose
    text chunks do not map one to one onto its token deltas contributes only its last token."""
    out = {"engine->client": [], "engine->detok published": [], "detok published->client": []}
    for r in results:
        if r.error is not None or not r.response_id or not r.chunk_times:
            continue
        bus_id = f"{r.response_id}-0"
        deltas = sorted(tap.deltas.get(bus_id, ()))
        outputs = sorted(tap.outputs.get(bus_id, ()))
        if not deltas:
            continue
        pairs = list(zip(deltas, r.chunk_times)) if len(deltas) == len(r.chunk_times) else [(deltas[-1], r.chunk_times[-1])]
        out["engine->client"] += [t - (ms / 1e3 + 5e-4) for (_, ms, _), t in pairs]
        if len(outputs) == len(deltas) == len(r.chunk_times):
            for (_, d_ms, _), (_, o_ms), t in zip(deltas, outputs, r.chunk_times):
                out["engine->detok published"].append((o_ms - d_ms) / 1e3)
                out["detok published->client"].append(t - (o_ms / 1e3 + 5e-4))
    return out


def process_cpu(root_pids: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of the given processes and all their descendants, by
    service: the module after `-m` (gateway, tokenizer_svc, ...) or the executable's name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = defaultdict(float)
    for pid in {p for root in root_pids for p in (root, *_descendants(root))}:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[_service_name(pid)] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def _service_name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        module = argv[argv.index("-m") + 1]
        if module == "shared.cli":
            return "pagedserve serve (supervisor)"
        return module
    return Path(argv[0]).name if argv and argv[0] else "?"


def _descendants(root_pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], [root_pid]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent:
                out.append(pid)
                frontier.append(pid)
    return out


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "tap":
    sys.path.insert(0, str(REPO))
    _tap_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])

