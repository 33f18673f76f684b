"""Fixtures of the end-to-end tests: a whole stack on a real redis-server, and openai clients for it."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.stack import Stack

# small enough for this machine's two cores, large enough for 60 concurrent requests
TINY_ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory", "64M", "--max-num-seqs", "64", "--max-num-batched-tokens", "1024"]
TINY_MAX_MODEL_LEN = 1024


def openai_client(stack: Stack, timeout: float = 120.0) -> openai.OpenAI:
    # max_retries=0: a 5xx must fail the test, never be retried away
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_stack(redis_url, tiny_llama_dir, tmp_path_factory):
    """The tiny Llama behind 3 tokenizer replicas, one engine, one detok shard and one gateway."""
    stack = Stack(redis_url, tiny_llama_dir, tmp_path_factory.mktemp("stack-logs"), num_tokenizers=3,
                  max_model_len=TINY_MAX_MODEL_LEN, engine_args=TINY_ENGINE_ARGS)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def stack(tiny_stack):
    """tiny_stack, and the idle invariant checked after the test."""
    yield tiny_stack
    tiny_stack.assert_idle()


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai_client(stack)


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir):
    """The in-process LLMEngine on the same model: the reference for greedy text."""
    from engine_svc import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), max_model_len=TINY_MAX_MODEL_LEN,
                                  kv_cache_memory=64 << 20))
