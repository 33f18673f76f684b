"""The bus's trust boundary: entries count only when they carry the deployment's MAC.

Anyone who reaches Redis can XADD. With a bus secret (``--bus-secret`` / PAGEDSERVE_BUS_SECRET;
`pagedserve serve` makes one per run) every producer signs each entry with HMAC-SHA-256 over
its stream and fields (the format is in shared/entries.py) and every reader checks the MAC in
constant time before it decodes a byte: an entry with no MAC or a wrong one is refused --
copied to the dead-letter stream, counted, logged now and then -- and nobody is answered on its
behalf (its reply_to is as forged as the rest). Without a secret the bus works as before and
readers ignore MACs.

What this does not give: secrecy (entries are readable by whoever can read Redis), protection
from deleting, trimming or flooding streams (availability), nor from a verbatim replay of a valid
entry into the stream it was written to (consumers are idempotent on request_id and seq).
Heartbeats (a hash) and KV blocks (``ps:kv:*``, checksummed by their own header) are not signed.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
import time
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from shared import entries
from shared.protocol import ProtocolError

if TYPE_CHECKING:
    from shared.config import ServeConfig
    from shared.redis_server import RedisAcl

log = logging.getLogger(__name__)

MIN_SECRET_CHARS = 16
MAC_BYTES = 32


def check_secret(text: str) -> str:
    """A bus secret, refused (ValueError naming the flag) below 16 characters."""
    if len(text.encode()) < MIN_SECRET_CHARS:
        raise ValueError(f"--bus-secret (PAGEDSERVE_BUS_SECRET) needs at least {MIN_SECRET_CHARS} characters, e.g. "
                         "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return text


def generate_secret() -> str:
    """A fresh secret (256 bits), as `serve` makes one per run."""
    return secrets.token_urlsafe(32)


class ForgedEntry(ProtocolError):
    """An entry whose MAC is missing or wrong: refused without reading its contents."""


class BusSigner:
    """Owns the bus key: signs the fields of an entry before XADD and checks them after a read."""

    __slots__ = ("_key",)

    def __init__(self, secret: str | bytes):
        self._key = check_secret(secret).encode() if isinstance(secret, str) else bytes(secret)
        if len(self._key) < MIN_SECRET_CHARS:
            raise ValueError(f"a bus key needs at least {MIN_SECRET_CHARS} bytes")

    @classmethod
    def of(cls, secret: str | None) -> BusSigner | None:
        """The signer for a configured secret; None (unsigned bus) when there is none."""
        return None if not secret else cls(secret)

    def __repr__(self) -> str:  # never the key
        return "BusSigner(...)"

    def mac(self, stream: str, fields: dict) -> bytes:
        return hmac.digest(self._key, entries.mac_input(stream, fields), "sha256")

    def sign(self, stream: str, fields: dict) -> dict:
        """``fields`` plus their MAC (an existing ``s`` field is replaced)."""
        return {**fields, entries.MAC_FIELD: self.mac(stream, fields)}

    def verify(self, stream: str, fields: dict | None) -> dict:
        """The entry's fields without the MAC; ForgedEntry when the MAC is missing or wrong."""
        if not fields:
            raise ForgedEntry("entry has no fields")
        given = fields.get(entries.MAC_FIELD)
        if given is None:
            raise ForgedEntry("entry has no MAC")
        body = {k: v for k, v in fields.items() if k != entries.MAC_FIELD}
        expected = self.mac(stream, body)
        # compare_digest takes the same time wherever the bytes differ; a wrong length fails too
        if not isinstance(given, bytes) or not hmac.compare_digest(given, expected):
            raise ForgedEntry("entry MAC does not match")
        return body


class RefusalLog:
    """Counts a reader's refused (forged) entries and logs them at most once per ``every_s``."""

    def __init__(self, stream: str, every_s: float = 10.0):
        self.stream = stream
        self.every_s = every_s
        self.num_refused = 0
        self._logged = 0
        self._next_log = 0.0

    def refused(self, entry_id: str, problem: str) -> None:
        self.num_refused += 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + self.every_s
            log.warning("%s: refused %d unsigned or forged entries (last: %s, %s)", self.stream,
                        self.num_refused - self._logged, entry_id, problem)
            self._logged = self.num_refused


def refusal_record(stream: str, entry_id: str, fields: dict | None, problem: str) -> dict:
    """The dead letter of a refused entry: where it was, why, and its first message's bytes."""
    record = {b"stream": stream, b"id": entry_id, b"error": problem[:1000]}
    first = (fields or {}).get(entries.FIELD)
    if isinstance(first, (bytes, bytearray)):
        record[b"m"] = bytes(first)
    return record



# --------------------------------------------------------------------------- `serve`'s set-up

def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """(the URL without user and password, user, password): a URL goes on a child's command line
    (visible in ``ps``), its credentials go through the environment."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None, None
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return bare, unquote(parts.username) if parts.username else None, \
        unquote(parts.password) if parts.password is not None else None


def url_with_credentials(url: str, username: str | None, password: str | None) -> str:
    """``url`` carrying ``username``/``password`` (for a client that takes nothing but a URL)."""
    if password is None:
        return url
    parts = urlsplit(url)
    user = quote(username or "default", safe="")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"))


def secure_serve(config: ServeConfig, redis_url: str, acl: RedisAcl | None) -> tuple[ServeConfig, str]:
    """`serve`'s children's bus settings, and the Redis URL for their command lines (no credentials).

    Every child gets the bus secret (a fresh one when none was given). With ``acl`` (the embedded
    Redis) each kind of child logs in as its role's ACL user; else every child uses the
    credentials given (``--redis-username/--redis-password`` or the URL's)."""
    bare_url, url_user, url_password = split_credentials(redis_url)
    try:
        secret = check_secret(config.gateway.bus.bus_secret) if config.gateway.bus.bus_secret else generate_secret()
    except ValueError as exc:
        raise SystemExit(f"pagedserve: {exc}") from None
    services = {}
    for kind in ("gateway", "tokenizer", "engine", "detok"):
        service = getattr(config, kind)
        if acl is not None:
            username, password = kind, acl.role_passwords[kind]
        else:
            username = service.bus.redis_username or url_user
            password = service.bus.redis_password or url_password
        bus = dataclasses.replace(service.bus, bus_secret=secret, redis_username=username, redis_password=password)
        services[kind] = dataclasses.replace(service, bus=bus)
    return dataclasses.replace(config, **services), bare_url
