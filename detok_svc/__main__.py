"""python -m detok_svc --redis-url URL --shard K --num-detok-shards D [--model PATH] (flags: shared.flags)"""

import logging

from detok_svc.service import main
from shared.flags import parse_detok

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s detok %(levelname)s %(message)s")
    main(parse_detok())
