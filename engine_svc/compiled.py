"""The compiled forward: torch.compile with inductor over the whole decoder, attention left opaque.

On CPU inductor writes C++ for everything between the matmuls (residual + RMSNorm, rotary,
SiLU x up fused into one loop each) and for the wrapper that calls them; the matmuls are
pagedserve_cpu.linear, which holds its own oneDNN-packed weights. One graph serves every token
count: the token dimension is symbolic from the first call (`dynamic=True`), so a running server never recompiles; PyTorch
specialises a dimension of size 1, which gives a second graph for one-token steps. Both are
compiled by `warm_up` before the engine takes work, and `num_compiles` counts every graph
compiled, so a test can assert that a mixed workload compiles nothing more.

Compiled graphs are cached under $PAGEDSERVE_CACHE/inductor (TORCHINDUCTOR_CACHE_DIR, unless the
environment already names one), so a warm restart skips the C++ builds and the lowering. A cached
graph calls the opaque ops through their schemas as they were when it was compiled, so the schemas
of the project's ops are part of every cache key (`ops_cache_tag`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger("pagedserve.compiled")

# The dynamic graph is compiled at its first call, and the token count of that call becomes inductor's
# size hint for the token dimension, which decides among other things which loops get OpenMP
# threads (a loop is left serial when the hint gives a thread less than `cpp.min_chunk_size`
# elements). Compiled at 2 tokens, SiLU x up, the rotary kernel and the norms stayed serial and ran
# on one core in a 2,048-token prefill; compiled at 512 they are split over the cores. Same process,
# alternating, model-167 Xeon, 2 cores: prefill 443/476 -> 424/437 ms (min/median), decode at
# batch 2 to 64 unchanged (the one-token graph does not depend on it).
WARM_UP_HINT = 512


def warm_up_tokens(max_tokens: int) -> tuple[int, ...]:
    """Token counts of the warm-up steps: 1 (its own, specialised graph), the dynamic graph's
    first call at the size hint (no more than the engine will ever batch), then 3 to see that the
    dynamic graph is reused."""
    return (1, max(2, min(WARM_UP_HINT, max_tokens)), 3)


def inductor_cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE") or str(Path.home() / ".cache" / "pagedserve")
    return Path(root).expanduser() / "inductor"


def ops_cache_tag() -> str:
    """A digest of the schemas of the project's own ops (pagedserve::, pagedserve_cpu::). The C++
    wrapper of a cached graph passes each op exactly the arguments its schema had then: after an
    upgrade that added one (linear's out_dtype), a graph cached before it crashed the engine with a
    segmentation fault, since inductor's key knows nothing of a custom op's schema."""
    from engine_svc.attention import cpu_ops

    cpu_ops.paged_decode_op()  # loads the C++ ops, where they are built and enabled
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.split("::")[0] in ("pagedserve", "pagedserve_cpu"))
    schemas = "\n".join(str(torch._C._get_schema(name, "")) for name in names)
    return "pagedserve-ops-" + hashlib.sha256(schemas.encode()).hexdigest()[:16]


def _configure_inductor() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    import torch._inductor.config as inductor

    tag = ops_cache_tag()
    if tag not in torch.compiler.config.cache_key_tag:
        torch.compiler.config.cache_key_tag = "+".join(filter(None, (torch.compiler.config.cache_key_tag, tag)))

    # no freezing. It made the weights constants and prepacked them for oneDNN/MKL (16.5 vs 24 ms a
    # bfloat16 decode step when the linears were aten's); the linears are pagedserve_cpu.linear
    # now, with packed copies of their own, so it prepacked nothing the graph calls, yet its passes
    # (constant folding over every weight) ran again at every start, before the FX graph cache
    # lookup, which hit either way. Warm engine start 29-32 s with it, 14-15 s without (bfloat16,
    # default model, model-167 Xeon); steps unchanged within this VM's noise: separate processes,
    # alternating, batch 1 median 16.45 / 16.95 / 15.00 ms with against 16.16 / 15.61 / 15.72
    # without, the 2,048-token prefill 444 / 455 / 383 / 391 against 369 / 392 / 406 / 390 ms
    # (median of five), batch 64 51.2 / 51.6 / 42.4 / 44.0 against 45.1 / 45.4 / 47.7 / 46.3
    inductor.freezing = False
    inductor.fx_graph_cache = True
    # the graph's wrapper (the code that calls its kernels and the opaque ops in turn, ~150 calls a
    # step) generated as C++ rather than Python. Same machine, separate processes, alternating
    # (model-167 Xeon, bfloat16, three pairs): decode step at batch 1 19.27 / 19.25 / 18.43 ms
    # (median) against 19.74 / 20.57 / 19.76, batch 8 22.07 / 22.46 / 21.57 against 23.24 / 25.09 /
    # 23.88, the 2,048-token prefill 439 / 436 / 443 against 482 / 523 / 488 ms. The price: the
    # wrapper's own C++ build on a cold cache (102 s to a warmed engine instead of ~60; warm, 39 s
    # against 38)
    inductor.cpp_wrapper = True
    # dynamo keeps its graphs per code object: every model built in this process (tests build many)
    # adds two for LlamaForCausalLM.forward, and past the limit dynamo would silently run eager
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, 256)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)


class CompiledForward:
    """Owns the compiled callable of one model and the count of graphs compiled for it."""

    def __init__(self, model: torch.nn.Module):
        _configure_inductor()
        self._graph_ids: set[tuple] = set()
        self.compile_seconds = 0.0
        self._forward = torch.compile(model, backend=self._compile, dynamic=True, fullgraph=True)

    def _compile(self, graph: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        # dynamo may restart a trace and compile the same graph twice (attempt 0, then 1): count
        # graphs by (frame, compile) id, not backend calls
        compile_id = torch._guards.CompileContext.current_compile_id()
        self._graph_ids.add((compile_id.frame_id, compile_id.frame_compile_id) if compile_id else len(self._graph_ids))
        start = time.monotonic()
        compiled = compile_fx(graph, example_inputs)
        self.compile_seconds += time.monotonic() - start
        logger.info("compiled forward graph %d in %.1f s", self.num_compiles, time.monotonic() - start)
        return compiled

    @property
    def num_compiles(self) -> int:
        """Graphs compiled for this model so far; each new one after warm-up is a recompile."""
        return len(self._graph_ids)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._forward(input_ids, positions)


__all__ = ["CompiledForward", "WARM_UP_HINT", "inductor_cache_dir", "warm_up_tokens"]
