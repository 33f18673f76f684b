"""How messages sit in stream entries.

A batched send puts all its messages for one stream into one entry (up to MAX_PER_ENTRY), in
fields ``m``, ``m1``, ``m2``, ... in order, each field one message's MessagePack bytes. The
engine's 64 deltas of a step then cost the detokenizer a few entries to read, not 64: Redis,
redis-py and the syscalls all work per entry, and per entry was most of the bus's cost per
token. A message is still one request's (no struct-of-arrays); only the transport is batched.
Streams read by competing consumers (tokenizer and engine groups) get one message per entry,
so that replicas share the work request by request. A producer may cap the messages per entry
lower (``per_entry``): the engine writes a step's deltas in entries of 16, which the detokenizer
reads one at a time and publishes as it goes, so the step's first texts leave before its last
deltas are decoded.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.protocol import Message, ProtocolError

FIELD = b"m"
MAX_PER_ENTRY = 256


def field_name(i: int) -> bytes:
    return FIELD if i == 0 else b"m%d" % i


def pack(items: Iterable[tuple[str, Message]], batch: bool,
         per_entry: int = MAX_PER_ENTRY) -> list[tuple[str, dict[bytes, bytes]]]:
    """(stream, message) pairs -> (stream, entry fields): batched, one entry per stream and
    ``per_entry`` messages, else one per message; each stream keeps its messages' order."""
    if not 1 <= per_entry <= MAX_PER_ENTRY:
        raise ValueError(f"per_entry must be in 1..{MAX_PER_ENTRY}, got {per_entry}")
    if not batch:
        return [(stream, {FIELD: msg.to_wire()}) for stream, msg in items]
    by_stream: dict[str, list[bytes]] = {}
    for stream, msg in items:
        by_stream.setdefault(stream, []).append(msg.to_wire())
    entries = []
    for stream, wires in by_stream.items():
        for start in range(0, len(wires), per_entry):
            chunk = wires[start:start + per_entry]
            entries.append((stream, {field_name(i): wire for i, wire in enumerate(chunk)}))
    return entries


def payloads(fields: dict | None) -> list[bytes]:
    """An entry's message bytes in order; ProtocolError when its fields are not m, m1, m2, ..."""
    if not fields or FIELD not in fields:
        raise ProtocolError("entry has no 'm' field")
    if len(fields) > MAX_PER_ENTRY:
        raise ProtocolError(f"entry holds {len(fields)} fields, more than {MAX_PER_ENTRY}")
    try:
        return [fields[field_name(i)] for i in range(len(fields))]
    except KeyError:
        raise ProtocolError("entry fields are not m, m1, m2, ...") from None
