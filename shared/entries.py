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

Signed entries (``--bus-secret``, shared/bus_auth.py) carry one more field, ``s``: 32 raw bytes,
HMAC-SHA-256(key, mac_input(stream, fields)). ``mac_input`` is, every part prefixed by its
length as 4 bytes big-endian: the context ``pagedserve-bus-v1``, the stream's key, then each
other field's name and value in ascending byte order of the names. The stream's key is inside the
MAC, so a valid entry copied to another stream (another gateway's reply stream) is refused; every
byte of every message is, so a changed, dropped or reordered message is refused. A reader with
no key ignores ``s``.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.protocol import Message, ProtocolError

FIELD = b"m"
MAX_PER_ENTRY = 256
MAC_FIELD = b"s"
MAC_CONTEXT = b"pagedserve-bus-v1"


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
    num_messages = len(fields) - (MAC_FIELD in fields)
    if num_messages > MAX_PER_ENTRY:
        raise ProtocolError(f"entry holds {num_messages} fields, more than {MAX_PER_ENTRY}")
    try:
        return [fields[field_name(i)] for i in range(num_messages)]
    except KeyError:
        raise ProtocolError("entry fields are not m, m1, m2, ...") from None


def as_bytes(value: object) -> bytes:
    """A field name or value as Redis stores it (redis-py encodes str as UTF-8 and numbers as text)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"cannot put a {type(value).__name__} in a stream entry")


def mac_input(stream: str, fields: dict) -> bytes:
    """The bytes an entry's MAC covers (the module docstring): every field but ``s``, and the stream."""
    items = sorted((as_bytes(k), as_bytes(v)) for k, v in fields.items())
    parts = [len(MAC_CONTEXT).to_bytes(4, "big"), MAC_CONTEXT]
    key = stream.encode()
    parts += (len(key).to_bytes(4, "big"), key)
    for name, value in items:
        if name != MAC_FIELD:
            parts += (len(name).to_bytes(4, "big"), name, len(value).to_bytes(4, "big"), value)
    return b"".join(parts)
