"""python -m tokenizer_svc --redis-url URL [--model PATH] [--max-model-len L] ... (flags: shared.flags)"""

import logging

from shared.flags import parse_tokenizer
from tokenizer_svc.service import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tokenizer %(levelname)s %(message)s")
    main(parse_tokenizer())
