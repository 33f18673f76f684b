"""ModelRunner: a SchedulerOutput in, float32 logits out; it owns the weights and the paged KV pool.

Input preparation is vectorised with numpy (one pass over the chunks, none over tokens):

    chunks     A: 5 new tokens (3 cached)   B: 1 token (decode, 9 cached)
    input_ids  [a0 a1 a2 a3 a4 | b0]              query_start_loc [0, 5, 6]
    positions  [ 3  4  5  6  7 |  9]              context_lens    [8, 10]
    slot       block_table[pos // B] * B + pos % B   (B = block size)
    logits     only for the last token of chunks with sample=True (rows 4 and 5 here)
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine_svc import cpu_info
from engine_svc.attention import AttentionBackend, AttentionMetadata, cpu_ops, get_backend
from engine_svc.attention.step import PagedAttention
from engine_svc.compiled import CompiledForward, warm_up_tokens
from engine_svc.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from engine_svc.host_memory import keep_freed_memory
from engine_svc.models import load_model, load_spec
from engine_svc.scheduler_output import ScheduledChunk, SchedulerOutput

logger = logging.getLogger("pagedserve.model_runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class StepInputs:
    """The tensors of one forward, built once per step."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [num sampled chunks]: rows of the flat batch whose logits are wanted


class ModelRunner:
    """Turns a SchedulerOutput into tensors and logits, nothing else; owns weights and the KV pool.

    The pool is one K and one V tensor per layer of [num_blocks, block_size, num_kv_heads,
    head_dim]; block 0 is the reserved null block. It is sized after the weights are loaded.
    """

    def __init__(self, config: EngineConfig, model_dir: str, backend: AttentionBackend | None = None):
        self.config = config
        self.model_dir = str(model_dir)
        self.spec = load_spec(self.model_dir)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.max_model_len = self._max_model_len()
        self.vocab_size = self.spec.vocab_size
        self.eos_token_ids = self.spec.eos_token_ids
        self.block_size = config.block_size
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        self.backend = backend if backend is not None else get_backend(
            config.attention_backend, self.device, dtype=self.dtype, head_dim=self.spec.head_dim, block_size=self.block_size)
        self.model = load_model(self.model_dir, dtype=self.dtype, device=self.device,
                                max_positions=self.max_model_len, spec=self.spec)
        elem = torch.empty((), dtype=self.dtype).element_size()
        spec = self.spec
        self.kv_bytes_per_block = 2 * spec.num_layers * self.block_size * spec.num_kv_heads * spec.head_dim * elem
        self.num_blocks = self._num_blocks()
        shape = (self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(spec.num_layers)
        ]
        self.attention = PagedAttention(self.backend, self.kv_caches, spec.head_dim**-0.5)
        self.model.bind_attention(self.attention.binding_id)
        # CPU only for now: the compiled forward has never run on a GPU here (no device was lent)
        self.compiled = CompiledForward(self.model) if self.device.type == "cpu" and not config.enforce_eager else None
        logger.info("model %s (%s) on %s/%s, backend %s, KV pool %d blocks x %d tokens (%.1f MiB)",
                    spec.architecture, self.model_dir, self.device, str(self.dtype).removeprefix("torch."),
                    self.backend.name, self.num_blocks, self.block_size,
                    self.num_blocks * self.kv_bytes_per_block / 2**20)
        if self.device.type == "cpu":
            cpu_ops.calibrate_amx_rows(self.model.packed_matrices())
        self.warm_up()
        if self.device.type == "cpu":
            # after the weights, their prepacked copies and the pool are placed (as glibc places them
            # by default: measured faster at batch 1 than in the heap), before the first real step
            keep_freed_memory()

    # ------------------------------------------------------------------ sizing
    def _max_model_len(self) -> int:
        limit = self.spec.max_position_embeddings
        if self.spec.sliding_window is not None and self.spec.sliding_window < limit:
            # the pool keeps every token, so stay inside the window rather than emulate it
            limit = self.spec.sliding_window
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted <= 0 or wanted > limit:
            raise ValueError(f"max_model_len {wanted} must be in 1..{limit} (the model's limit, from config.json)")
        return wanted

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            num_blocks = cfg.num_gpu_blocks_override
        elif cfg.kv_cache_memory is not None or self.device.type != "cuda":
            num_blocks = (cfg.kv_cache_memory or DEFAULT_CPU_KV_BYTES) // self.kv_bytes_per_block
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free)
            num_blocks = max(budget, 0) // self.kv_bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"KV cache too small: {num_blocks} blocks of {self.kv_bytes_per_block} bytes "
                "(need at least 2, block 0 is reserved); raise kv_cache_memory / gpu_memory_utilization"
            )
        return int(num_blocks)

    # ------------------------------------------------------------------ steps
    def copy_blocks(self, pairs) -> None:
        """Copy whole blocks (src, dst) in every layer's K and V (copy-on-write)."""
        if len(pairs) == 0:
            return
        mapping = torch.as_tensor(pairs, dtype=torch.int64).reshape(-1, 2).to(self.device)
        with torch.inference_mode():
            self.backend.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)

    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Block copies, then one forward over every chunk; logits [num sampled chunks, vocab] in the
        model's ``logits_dtype`` (the sampler widens bfloat16 ones to float32 where it needs more than an
        argmax)."""
        if plan.block_copies:
            self.copy_blocks(plan.block_copies)
        if not plan.chunks:
            return torch.empty((0, self.vocab_size), dtype=self.model.logits_dtype, device=self.device)
        inputs = self.prepare(plan.chunks)
        self.attention.meta = inputs.meta
        forward = self.compiled or self.model
        with torch.inference_mode():
            hidden = forward(inputs.input_ids, inputs.positions)
            return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    def warm_up(self) -> None:
        """Run every graph shape once before the first request (compiles the forward and builds the
        CPU attention kernels): steps of `warm_up_tokens` tokens written into the null block 0."""
        start = time.monotonic()
        try:
            self._warm_up_steps()
        except Exception as exc:  # noqa: BLE001 - e.g. no C++ compiler for inductor: serve eagerly
            if self.compiled is None:
                raise
            logger.warning("the compiled forward failed to build, running eagerly: %s", str(exc).splitlines()[0])
            self.compiled = None
            self._warm_up_steps()
        if self.compiled is not None:
            logger.info("forward compiled (%d graphs) and warmed up in %.1f s", self.compiled.num_compiles,
                        time.monotonic() - start)

    def _warm_up_steps(self) -> None:
        for num_tokens in warm_up_tokens(min(self.config.max_num_batched_tokens, self.max_model_len)):
            blocks = [0] * -(-num_tokens // self.block_size)
            self.execute(SchedulerOutput(chunks=[ScheduledChunk("warm-up", [0] * num_tokens, 0, blocks, True)]))

    @property
    def num_compiles(self) -> int:
        """Graphs compiled so far (0 when eager): constant after warm_up, whatever the workload."""
        return 0 if self.compiled is None else self.compiled.num_compiles

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Flatten the chunks into the step's tensors (numpy, no loop over tokens)."""
        n, bs = len(chunks), self.block_size
        q_lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, n)
        starts = np.fromiter((c.num_computed_tokens for c in chunks), np.int64, n)
        ctx = starts + q_lens
        qsl = np.zeros(n + 1, np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        if ctx.max() > self.max_model_len:
            i = int(ctx.argmax())
            raise ValueError(f"request {chunks[i].request_id}: {int(ctx[i])} tokens exceed max_model_len {self.max_model_len}")
        input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, num_tokens)
        seq_of = np.repeat(np.arange(n), q_lens)
        positions = np.arange(num_tokens) - qsl[seq_of] + starts[seq_of]
        num_blocks = (ctx + bs - 1) // bs
        block_tables = np.zeros((n, int(num_blocks.max())), np.int32)
        for i, (chunk, nb) in enumerate(zip(chunks, num_blocks.tolist())):
            if len(chunk.block_table) < nb:
                raise ValueError(f"request {chunk.request_id}: block table has {len(chunk.block_table)} blocks, needs {nb}")
            block_tables[i, :nb] = chunk.block_table[:nb]
        slots = block_tables[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
        sample = np.fromiter((c.sample for c in chunks), np.bool_, n)
        sample_rows = qsl[1:][sample] - 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            context_lens=torch.from_numpy(ctx.astype(np.int32)).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            is_decode=num_tokens == n,
        )
        return StepInputs(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta,
                          torch.from_numpy(sample_rows).to(dev))


def pick_device(name: str) -> torch.device:
    """auto = cuda when available, else cpu; an explicit cuda without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on CUDA and on a CPU with native bfloat16 (AVX512-BF16 or AMX), else float32
    (as vLLM does for a float32 checkpoint)."""
    if name == "auto":
        native = device.type == "cuda" or cpu_info.has_native_bf16()
        dtype = torch.bfloat16 if native else torch.float32
        if device.type == "cpu":
            logger.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."),
                        "the CPU has native bfloat16" if native else "no native bfloat16 on this CPU")
        return dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]
