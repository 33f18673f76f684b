"""Tiny tokenizers built in the test (no downloads): GPT-2-style byte-level BPE and Llama-style
BPE with byte fallback. Both split multi-byte characters across tokens, which is what the
detokenizer tests need, and both carry a ChatML template with special tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = ["Hello world, the capital of France is Paris. 中文字符 和 日本語 テキスト. Émile café naïve 🙂🚀",
          "The quick brown fox jumps over the lazy dog. stop STOP end. Once upon a time there was a cat."] * 50
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_bytelevel(path: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    _write_config(path, len(fast))
    return path


def build_llama_style(path: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>",
                                                                  "<|im_end|>"], limit_alphabet=60)
    tok.train_from_iterator(CORPUS, trainer)
    body = json.loads(tok.to_str())
    vocab = body["model"]["vocab"]
    base = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = base + b
    body["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(body))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = "{{ bos_token }}" + CHATML
    fast.save_pretrained(path)
    _write_config(path, len(fast))
    return path


def _write_config(path: Path, vocab_size: int) -> None:
    (Path(path) / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size,
                                                        "max_position_embeddings": 128}))
