"""python -m engine_svc --redis-url URL [--model PATH] [engine flags with vLLM's names] ... (flags: shared.flags)"""

import os

# Before torch loads: one OpenMP thread per CPU this process may run on. Left unset, the same two
# threads ran a bfloat16 decode step here in 9 ms instead of 7-8; a PASSIVE wait policy (threads
# sleep between the ~120 parallel regions of a step) made it 16 ms, so the engine never inherits it
# (its threads spin briefly; `serve` runs it SCHED_IDLE, so the spinning never delays another service).
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
    del os.environ["OMP_WAIT_POLICY"]

import logging  # noqa: E402

from engine_svc.service import main  # noqa: E402
from shared.flags import parse_engine  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    main(parse_engine())
