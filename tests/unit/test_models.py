"""Our Llama-family models through the paged KV cache give HF transformers' logits.

Each case runs two sequences side by side: prompts prefilled in chunks (one step mixes a
prefill chunk with a decode), then decode steps, with shuffled, non-contiguous block tables.
Every sampled row is compared with HF's logits for the same full sequence (float32).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine_svc import cpu_info
from engine_svc.config import EngineConfig
from engine_svc.model_runner import ModelRunner
from engine_svc.models import ModelConfigError
from engine_svc.scheduler_output import ScheduledChunk, SchedulerOutput
from tests.fixtures.models import build_tiny_model

BLOCK_SIZE = 4
ATOL = 1e-4

CASES = {
    "llama": ("llama", {}),
    "llama-bias-llama3-rope": ("llama", dict(
        attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama-tied-mha": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-gqa3-bias": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2, attention_bias=True)),
}


def make_runner(model_dir, *, dtype="float32", num_blocks=48, enforce_eager=True) -> ModelRunner:
    config = EngineConfig(enforce_eager=enforce_eager, model=str(model_dir), dtype=dtype, device="cpu",
                          block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks, attention_backend="torch")
    return ModelRunner(config, str(model_dir))


def run_paged(runner: ModelRunner, seqs: list[list[int]], prompt_lens: list[int], first_chunk: int, seed=0,
              block_size=BLOCK_SIZE):
    """Drive the runner like a scheduler would: chunked prefill, then one token per step.

    Returns, per sequence, {position: logits row} for every position that was sampled.
    """
    rng = random.Random(seed)
    free = list(range(1, runner.num_blocks))
    rng.shuffle(free)  # non-contiguous, out of order
    tables = [[free.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
    done = [0] * len(seqs)
    got: list[dict[int, torch.Tensor]] = [{} for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        chunks = []
        for i, s in enumerate(seqs):
            if done[i] >= len(s):
                continue
            if done[i] < prompt_lens[i]:
                n = min(first_chunk if done[i] == 0 else prompt_lens[i], prompt_lens[i] - done[i])
            else:
                n = 1
            chunks.append((i, ScheduledChunk(f"r{i}", s[done[i] : done[i] + n], done[i], tables[i],
                                             done[i] + n >= prompt_lens[i])))
        logits = runner.execute(SchedulerOutput([c for _, c in chunks]))
        row = 0
        for i, chunk in chunks:
            done[i] += len(chunk.token_ids)
            if chunk.sample:
                got[i][done[i] - 1] = logits[row]
                row += 1
        assert row == logits.shape[0]
    return got


def hf_logits(model_dir, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf_through_paged_cache(case, compiled, models_dir):
    arch, overrides = CASES[case]
    model_dir = models_dir / case
    if not (model_dir / "config.json").is_file():
        build_tiny_model(arch, model_dir, seed=1, **overrides)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (27, 13, 6)]
    prompt_lens = [23, 10, 5]  # the rest are "generated" tokens fed one per step
    runner = make_runner(model_dir, enforce_eager=not compiled)
    assert runner.num_compiles == (2 if compiled else 0)  # one-token steps, and every other count
    got = run_paged(runner, seqs, prompt_lens, first_chunk=9)
    assert runner.num_compiles == (2 if compiled else 0)
    for i, s in enumerate(seqs):
        ref = hf_logits(model_dir, s)
        assert sorted(got[i]) == list(range(prompt_lens[i] - 1, len(s)))
        for pos, row in got[i].items():
            torch.testing.assert_close(row, ref[pos], atol=ATOL, rtol=0, msg=f"{case} seq {i} pos {pos}")


def test_sharded_checkpoint_loads(models_dir):
    model_dir = build_tiny_model("llama", models_dir / "sharded", seed=2, max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    seq = list(range(3, 20))
    got = run_paged(make_runner(model_dir), [seq], [len(seq)], first_chunk=len(seq))
    torch.testing.assert_close(got[0][len(seq) - 1], hf_logits(model_dir, seq)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_hf(dtype, models_dir):
    model_dir = build_tiny_model("qwen3", models_dir / f"half-{dtype}", seed=3)
    runner = make_runner(model_dir, dtype=dtype)
    assert runner.dtype == getattr(torch, dtype) and runner.kv_caches[0][0].dtype == runner.dtype
    seq = list(range(5, 30))
    got = run_paged(runner, [seq], [20], first_chunk=8)
    ref = hf_logits(model_dir, seq, dtype=getattr(torch, dtype))
    for pos, row in got[0].items():
        # float32 where the CPU linear op computes them (bfloat16: it need not round its float32 sums), else
        # the model's dtype (float16), which the sampler widens where it needs float32
        through_op = runner.model.packed_lm_head is not None and dtype == "bfloat16"
        assert row.dtype == runner.model.logits_dtype == (torch.float32 if through_op else runner.dtype)
        torch.testing.assert_close(row.float(), ref[pos].float(), atol=0.1, rtol=0.05)


def test_runner_metadata(models_dir):
    model_dir = build_tiny_model("llama", models_dir / "meta", seed=4, max_position_embeddings=300)
    runner = make_runner(model_dir)
    assert runner.vocab_size == 512 and runner.max_model_len == 300 and runner.eos_token_ids == (2,)
    assert runner.kv_bytes_per_block == 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    assert runner.num_blocks == 48 and runner.kv_caches[0][0].shape == (48, BLOCK_SIZE, 2, 16)
    sized = ModelRunner(EngineConfig(enforce_eager=True, model=str(model_dir), block_size=BLOCK_SIZE,
                                     kv_cache_memory=100 * 1024), str(model_dir))
    auto = torch.bfloat16 if cpu_info.has_native_bf16() else torch.float32
    assert sized.num_blocks == 100 * 1024 // sized.kv_bytes_per_block and sized.dtype == auto
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(EngineConfig(enforce_eager=True, model=str(model_dir), max_model_len=301,
                                 num_gpu_blocks_override=4), str(model_dir))


def test_block_copies_run_before_forward(models_dir):
    model_dir = build_tiny_model("llama", models_dir / "cow", seed=5)
    runner = make_runner(model_dir)
    seq = list(range(10, 18))  # 8 tokens = blocks [3, 7]
    runner.execute(SchedulerOutput([ScheduledChunk("a", seq, 0, [3, 7], True)]))
    # fork: the child shares block 3 and copy-on-writes block 7 into 9 before its next token
    out = runner.execute(SchedulerOutput([ScheduledChunk("b", [42], 8, [3, 9, 11], True)], block_copies=[(7, 9)]))
    torch.testing.assert_close(out[0], hf_logits(model_dir, seq + [42])[-1], atol=ATOL, rtol=0)


def test_unsupported_architecture_is_a_clear_error(models_dir):
    model_dir = build_tiny_model("llama", models_dir / "gpt2ish", seed=6)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"config.json.*GPT2LMHeadModel.*not supported"):
        make_runner(model_dir)


def test_missing_weight_file_is_a_clear_error(models_dir):
    model_dir = build_tiny_model("llama", models_dir / "noweights", seed=7)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match=r"no model.safetensors"):
        make_runner(model_dir)


def test_missing_shard_and_missing_tensor_are_clear_errors(models_dir):
    model_dir = build_tiny_model("llama", models_dir / "badshards", seed=8, max_shard_size="100KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["model.norm.weight"]
    (model_dir / victim).unlink()
    with pytest.raises(ModelConfigError, match=victim):
        make_runner(model_dir)
    del index["weight_map"]["model.norm.weight"]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != victim}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelConfigError, match="is missing from the weight files"):
        make_runner(model_dir)


@pytest.mark.parametrize("field,value", [("hidden_size", "wide"), ("num_key_value_heads", 3), ("hidden_act", "gelu"),
                                         ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4})])
def test_malformed_config_field_is_named(field, value, models_dir):
    model_dir = build_tiny_model("llama", models_dir / f"bad-{field}", seed=9)
    config = json.loads((model_dir / "config.json").read_text())
    config[field] = value
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="config.json"):
        make_runner(model_dir)


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json: file not found"):
        make_runner(tmp_path)
