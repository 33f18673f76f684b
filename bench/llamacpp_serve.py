"""llama-cpp-python's server (`python -m llama_cpp.server ...`, same arguments) as shipped, but for
two things that break `vllm bench serve` against it, neither on the inference path:

- its app answers every request whose X-Request-ID header is not a UUID with an empty
  `400 Bad Request` (starlette_context's RequestIdPlugin, validate=True), and the client sends
  `x-request-id: bench-<hex>-<n>` with every request: the check is off here;
- while a streamed request waits for the model (it serves one at a time), sse_starlette sends it
  an SSE comment (`: ping - <time>`) every 15 s; the client strips each network read before
  parsing, so a ping that arrives in a read of its own loses its blank line and glues itself to
  every later event of that stream: the request ends up with 0 or 1 tokens and "Never received a
  valid chunk". Keep-alive pings (for proxies; there is none here) are off.

Run with the peer's own Python (.peers/llamacpp/bin/python bench/llamacpp_serve.py --model ...);
bench/sweep.py does.
"""

import runpy

from sse_starlette.sse import EventSourceResponse
from starlette_context.plugins.base import PluginUUIDBase

PluginUUIDBase.validate_uuid = lambda self, value: None  # accept any request id, as OpenAI's servers do
EventSourceResponse.DEFAULT_PING_INTERVAL = 0  # 0: no keep-alive pings (sse_starlette #206)

runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
