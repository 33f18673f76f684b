"""python -m engine_svc --redis-url URL [--model PATH] [engine flags with vLLM's names] ..."""

import logging

from engine_svc.service import main
from shared.config import parse_engine

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    main(*parse_engine())
