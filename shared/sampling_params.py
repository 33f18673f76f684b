"""What to sample and when to stop: the sampling parameters every hop validates, and the limits
they are held to. Pure data (standard library and the codec's ProtocolError only)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

from shared.codec import ProtocolError
from shared.structured import StructuredOutputs

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_N = 64


class FinishReason(IntEnum):
    STOP = 1  # EOS, a stop token or a stop string
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3  # client went away or an Abort arrived
    ERROR = 4

    @property
    def openai(self) -> str:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}[self.value]



@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """What to sample and when to stop; validated at the gateway and again in the engine."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    structured_outputs: StructuredOutputs | None = None  # the grammar the output must obey

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_history(self) -> bool:
        """A penalty reads the tokens generated so far (and, for repetition, the prompt)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ProtocolError naming the first bad parameter; return self when all is well."""
        _check(1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        _check(_finite(self.temperature) and 0.0 <= self.temperature <= 2.0,
               f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(self.top_k is None or self.top_k >= 1 or self.top_k == -1,
               f"top_k must be -1 (disabled) or at least 1, got {self.top_k}", "top_k")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check(self.seed is None or -(1 << 63) <= self.seed < (1 << 63), "seed out of range", "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}", name)
        _check(_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}", "repetition_penalty")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens must not exceed max_tokens", "min_tokens")
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(self.stop),
               f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", (self.logit_bias or {}).keys())):
                _check(all(0 <= t < vocab_size for t in ids), "token id out of the vocabulary", name)
        for bias in (self.logit_bias or {}).values():
            _check(_finite(bias) and -100.0 <= bias <= 100.0, "logit_bias values must be in [-100, 100]",
                   "logit_bias")
        _check(_finite(self.length_penalty), "length_penalty must be finite", "length_penalty")
        _check(not self.use_beam_search or self.n >= 1, "beam search needs n >= 1", "n")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        return self


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ProtocolError(message, param)
