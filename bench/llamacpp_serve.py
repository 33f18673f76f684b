"""llama-cpp-python's server (`python -m llama_cpp.server ...`, same arguments) as shipped, but for
one check: it answers every request whose X-Request-ID header is not a UUID with an empty
`400 Bad Request` (starlette_context's RequestIdPlugin, validate=True, which its app installs),
and `vllm bench serve` sends `x-request-id: bench-<hex>-<n>` with every request. That check is
turned off here; nothing on the inference path changes. Run with the peer's own Python
(.peers/llamacpp/bin/python bench/llamacpp_serve.py --model ...); bench/sweep.py does.
"""

import runpy

from starlette_context.plugins.base import PluginUUIDBase

PluginUUIDBase.validate_uuid = lambda self, value: None  # accept any request id, as OpenAI's servers do

runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
