"""A tokenizer replica killed under load: its pending requests are reclaimed, every request completes."""

from __future__ import annotations

import asyncio
import signal

import openai
import pytest

from shared.protocol import GROUP_TOKENIZER
from tests.e2e.conftest import TINY_ENGINE_ARGS, TINY_MAX_MODEL_LEN
from tests.e2e.stack import Stack


@pytest.fixture
def stack(redis_url, tiny_llama_dir, tmp_path):
    stack = Stack(redis_url, tiny_llama_dir, tmp_path / "logs", num_tokenizers=3,
                  max_model_len=TINY_MAX_MODEL_LEN, engine_args=TINY_ENGINE_ARGS)
    stack.start()
    yield stack
    try:
        stack.assert_idle(timeout_s=15)
    finally:
        stack.stop()


def test_sigkilled_tokenizer_under_load_loses_no_request(stack):
    victim = stack.service("tokenizer-0")

    def stranded() -> int:
        with stack.redis() as client:
            consumers = client.xinfo_consumers(stack.names.tokenizer_in, GROUP_TOKENIZER)
        return sum(c["pending"] for c in consumers if c["name"] == b"tokenizer-0")

    async def scenario():
        async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=180) as client:
            await client.models.list()  # a warm connection, so the burst lands at once
            # stopped, the victim still holds its blocking XREADGROUP for up to 500 ms: Redis hands it
            # entries it will never process -- what a replica dying mid-batch leaves pending
            victim.signal(signal.SIGSTOP)
            tasks = [asyncio.ensure_future(client.completions.create(
                model="tiny", prompt=f"Load {i}:", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}))
                for i in range(40)]
            await asyncio.sleep(1.0)
            num_stranded = stranded()
            victim.signal(signal.SIGKILL)
            return num_stranded, await asyncio.gather(*tasks, return_exceptions=True)

    num_stranded, results = asyncio.run(scenario())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert len(results) == 40 and all(r.usage.completion_tokens == 6 for r in results)
    assert num_stranded > 0  # the survivors really did reclaim the dead replica's entries
    assert stranded() == 0
