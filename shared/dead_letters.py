"""Dead letters: what a GroupReader does with an entry it refuses.

The entry is copied to the dead-letter stream (``ps:dlq``) for inspection, and when its bytes
still show a plausible ``reply_to`` (a gateway's reply stream) and ``request_id``, that gateway
gets an error RequestOutput, so its client is answered instead of waiting forever.
"""

from __future__ import annotations

import logging
import re

import msgpack

from shared.protocol import ErrorInfo, FinishReason, RequestOutput

log = logging.getLogger(__name__)
_REPLY_TO = re.compile(r"^[\w.\-]{1,64}:gateway:[\w.\-]{1,128}:out$")


def salvage_reply(data: object, problem: str) -> tuple[str, RequestOutput] | None:
    """For a message that failed validation: (reply_to, error output) when its envelope is readable."""
    if not isinstance(data, (bytes, bytearray)):
        return None
    # A message refused for its size (a prompt of 1.1 M token ids) must still be answered: no
    # container or string can hold more items than the entry has bytes, so the entry's own length
    # bounds the decoding (the bus already bounded the entry).
    limit = len(data)
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=limit, max_str_len=limit,
                               max_array_len=limit, max_map_len=limit)
    except Exception:  # undecodable: nobody to tell
        return None
    if not isinstance(body, dict):
        return None
    reply_to, request_id = body.get("reply_to"), body.get("request_id")
    if not (isinstance(reply_to, str) and _REPLY_TO.match(reply_to)):
        return None
    if not (isinstance(request_id, str) and 0 < len(request_id) <= 256):
        return None
    error = ErrorInfo(message=f"invalid message: {problem}"[:1000], type="BadRequestError", code=400)
    return reply_to, RequestOutput(request_id=request_id, finish_reason=FinishReason.ERROR, error=error)


def dead_letter(producer, dlq: str, stream: str, entry_id: str, data: object, problem: str) -> None:
    """Copy a refused entry (its message bytes ``data``) to the DLQ and tell its gateway, when it names one.
    ``producer`` is a shared.streams.Producer."""
    record = {b"stream": stream, b"id": entry_id, b"error": problem[:1000]}
    if isinstance(data, (bytes, bytearray)):
        record[b"m"] = bytes(data)
    producer.send_raw(dlq, record)
    salvaged = salvage_reply(data, problem)
    if salvaged is not None:
        producer.send(*salvaged)
    log.warning("dead-lettered %s %s: %s", stream, entry_id, problem)
