"""What the gateway derives from its config (``shared.config.GatewayConfig``, with its
``GatewayLimits``, re-exported here): the model name it serves and its id. No I/O here.
"""

from __future__ import annotations

import uuid
from pathlib import PurePath

from shared.config import GatewayConfig, GatewayLimits
from shared.models import GGUF_FILE

__all__ = ["DEFAULT_MODEL_NAME", "GatewayLimits", "accepts_model", "gateway_id", "served_model_name"]

# the default model keeps its plain name, whether or not --model names its cache folder
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_FOLDER = PurePath(GGUF_FILE).stem  # the converted folder is named after the GGUF


def served_model_name(config: GatewayConfig) -> str:
    """What clients pass as ``model`` and what responses report: --served-model-name, else the
    model folder's name (vLLM reports the whole path; a cache path makes a poor model name)."""
    if config.served_model_name:
        return config.served_model_name
    if config.model:
        name = PurePath(config.model.rstrip("/")).name or config.model
        return DEFAULT_MODEL_NAME if name == _DEFAULT_FOLDER else name
    return DEFAULT_MODEL_NAME


def accepts_model(config: GatewayConfig, name: str | None) -> bool:
    """A request may name the served name or the model path, or leave ``model`` out."""
    return name is None or name in {served_model_name(config), config.model}


def gateway_id(config: GatewayConfig) -> str:
    """The configured id, else a fresh random one (each gateway process reads its own stream)."""
    return config.gateway_id or uuid.uuid4().hex[:12]
