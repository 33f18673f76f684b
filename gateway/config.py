"""The gateway's own knobs (GatewayLimits) next to shared.config.GatewayConfig. No I/O here.

``shared.config.GatewayConfig`` says who the gateway is (bus, address, model, API key) and is
built by the same flags `pagedserve serve` passes; ``GatewayLimits`` says how long and how much
it tolerates, which no other service needs to know.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import PurePath

from shared.config import GatewayConfig
from shared.models import GGUF_FILE

# the default model keeps its plain name, whether or not --model names its cache folder
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_FOLDER = PurePath(GGUF_FILE).stem  # the converted folder is named after the GGUF


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayLimits:
    """Timeouts and size limits of one gateway."""

    idle_timeout_s: float = 600.0  # a request with no reply for this long fails (503) and is aborted
    max_body_bytes: int = 16 << 20  # larger bodies answer 413
    max_pending_requests: int = 4096  # more HTTP requests in flight answer 429
    heartbeat_max_age_s: float = 10.0  # /health: an engine heartbeat younger than this


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
