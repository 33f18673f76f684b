"""What the gateway derives from its config (``shared.config.GatewayConfig``, with its
``GatewayLimits``, re-exported here): the model name it serves and its id. No I/O here.
"""

from __future__ import annotations

import uuid

from shared.config import GatewayConfig, GatewayLimits
from shared.models import DEFAULT_MODEL_NAME, served_model_name as _served_model_name

__all__ = ["DEFAULT_MODEL_NAME", "GatewayLimits", "accepts_model", "gateway_id", "served_model_name"]


def served_model_name(config: GatewayConfig) -> str:
    """What clients pass as ``model`` and what responses report (shared.models.served_model_name)."""
    return _served_model_name(config.served_model_name, config.model)


def accepts_model(config: GatewayConfig, name: str | None) -> bool:
    """A request may name the served name or the model path, or leave ``model`` out."""
    return name is None or name in {served_model_name(config), config.model}


def gateway_id(config: GatewayConfig) -> str:
    """The configured id, else a fresh random one (each gateway process reads its own stream)."""
    return config.gateway_id or uuid.uuid4().hex[:12]
