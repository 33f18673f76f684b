"""Real text for the serving benchmarks, made here and seeded (nothing downloaded): the docstrings of
the Python standard library this interpreter ships (English prose, the same on every machine with
the same Python), tokenized once with the model's tokenizer and cut into windows of given lengths.

- ``write_sharegpt_like``: a ShareGPT-format JSON (``vllm bench serve --dataset-name sharegpt``
  reads it) whose prompt and reply lengths follow lognormal laws shaped like ShareGPT's (many
  short turns, a long tail): prompt median 120 tokens (sigma 1.0, clipped to 8-1024), reply
  median 110 (sigma 0.8, clipped to 8-512). The client takes each reply's token count as the
  request's output length (with --ignore-eos every request generates exactly that).
- ``text_windows``: distinct windows of real text of one length (the tokenizer-scaling prompts).
"""

from __future__ import annotations

import ast
import json
import math
import random
import sysconfig
from pathlib import Path

PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE = 120, 1.0, (8, 1024)
REPLY_MEDIAN, REPLY_SIGMA, REPLY_RANGE = 110, 0.8, (8, 512)


def stdlib_text(max_chars: int = 3_000_000) -> str:
    """Every docstring of the standard library's top-level modules, in file-name order."""
    parts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    parts.append(" ".join(doc.split()))
                    total += len(parts[-1])
        if total >= max_chars:
            break
    return "\n\n".join(parts)


def corpus_ids(tokenizer) -> list[int]:
    return tokenizer(stdlib_text(), add_special_tokens=False).input_ids


def text_windows(tokenizer, ids: list[int], num: int, num_tokens: int, seed: int = 0) -> list[str]:
    """`num` distinct windows of `num_tokens` tokens of the corpus, decoded to text."""
    rng = random.Random(seed)
    starts = rng.sample(range(0, len(ids) - num_tokens), num)
    return [tokenizer.decode(ids[s:s + num_tokens]) for s in starts]


def _lognormal(rng: random.Random, median: int, sigma: float, bounds: tuple[int, int]) -> int:
    return int(min(max(round(rng.lognormvariate(math.log(median), sigma)), bounds[0]), bounds[1]))


def write_sharegpt_like(path: Path, tokenizer, num: int, seed: int = 0) -> dict:
    """Write `num` one-turn conversations to `path`; returns a summary of the lengths."""
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    rows, prompt_lens, reply_lens = [], [], []
    for i in range(num):
        p, r = (_lognormal(rng, PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE),
                _lognormal(rng, REPLY_MEDIAN, REPLY_SIGMA, REPLY_RANGE))
        s, t = rng.randrange(len(ids) - p), rng.randrange(len(ids) - r)
        rows.append({"id": f"synthetic-{i}", "conversations": [
            {"from": "human", "value": tokenizer.decode(ids[s:s + p])},
            {"from": "gpt", "value": tokenizer.decode(ids[t:t + r])}]})
        prompt_lens.append(p)
        reply_lens.append(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return {"num": num, "seed": seed, "prompt_mean": sum(prompt_lens) / num, "reply_mean": sum(reply_lens) / num,
            "prompt_max": max(prompt_lens), "reply_max": max(reply_lens)}


def describe_sharegpt_like() -> str:
    return (f"ShareGPT-like mix (stdlib docstrings; prompt lognormal median {PROMPT_MEDIAN} sigma {PROMPT_SIGMA} "
            f"in {PROMPT_RANGE[0]}-{PROMPT_RANGE[1]}, output median {REPLY_MEDIAN} sigma {REPLY_SIGMA} in "
            f"{REPLY_RANGE[0]}-{REPLY_RANGE[1]} tokens)")
