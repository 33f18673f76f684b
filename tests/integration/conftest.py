"""Fixtures for the service tests: tokenizers built here, loaded once per session."""

from __future__ import annotations

import pytest

from tests.integration.tokenizers import build_bytelevel, build_llama_style


@pytest.fixture(scope="session", params=["bytelevel", "llama"])
def tokenizer_dir(request, tmp_path_factory):
    build = {"bytelevel": build_bytelevel, "llama": build_llama_style}[request.param]
    return str(build(tmp_path_factory.mktemp(f"tok-{request.param}")))


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)
