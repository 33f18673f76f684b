"""Share of the machine's matmul ceiling that decode reaches, by batch size (issue 2).

    python bench/compute_share.py                      # default model, batches 64 128 256
    python bench/compute_share.py --batches 32 256

The ceiling is 2 x parameters FLOPs per token at the matmul rate measured around the very steps
it is compared with (the shared CPU's speed drifts). Decode of `batch` 16-token requests, greedy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import count_parameters, print_header, print_table, resolve_bench_model  # noqa: E402
from probe import StepProbe, compute_probe  # noqa: E402

from engine_svc import EngineConfig, LLMEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default | tiny | an HF folder")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print_header("bench/compute_share.py: decode tokens/s against the matmul ceiling, by batch size")
    model_dir = resolve_bench_model(args.model)
    params = count_parameters(model_dir)
    rows = []
    for batch in args.batches:
        print(f"  batch {batch} ...", flush=True)
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=args.dtype, kv_cache_memory=2 << 30,
                                        max_num_seqs=batch, max_num_batched_tokens=8192))
        probe_rows, _ = compute_probe(StepProbe(engine), batch, engine.vocab_size, params, dtype=args.dtype)
        rows += probe_rows
    print_table(f"Decode against the compute ceiling (2 x {params / 1e6:.1f}M FLOPs per token)",
                ["what", "tokens/s", "share of ceiling", "target >= 60%"], rows)


if __name__ == "__main__":
    main()
