"""python -m tokenizer_svc --redis-url URL [--model PATH] [--max-model-len L] ..."""

import logging

from shared.config import parse_tokenizer
from tokenizer_svc.service import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tokenizer %(levelname)s %(message)s")
    main(parse_tokenizer())
