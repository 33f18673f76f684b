"""The bus's per-token round trips on a connection held by their loop, without the client's layers.

Every token crosses Redis twice (engine -> detok shard -> gateway), and each service's hot loop
makes one round trip per turn: the engine's step output with its next reads, the detokenizer's
replies with its next blocking read, the gateway's read of its reply stream. Through a redis-py
client each call also pays for what the client adds to it: a connection taken from the pool and
given back, the retry and observability wrappers, the command's response callback. Measured here
(one XREAD of one entry, client CPU per call): 77 us through ``Redis.xread``, 39 us on the
connection itself, 32 us on a bare socket with hiredis; with asyncio (and the entry's decode),
127 against 98 on the held connection. On two cores
whatever the bus spends per token comes out of the engine's forward, so these loops send their
commands on a connection they hold (``HeldConnection``; still redis-py's: it connects,
authenticates, selects the database and parses with hiredis) and build and parse the commands
here (``DirectPipe``), with the replies shaped as redis-py's callbacks shape them, so the readers
that take them need not know which path they came by. The commands go out packed by hiredis itself:
redis-py's packer first runs its encoder over every argument in Python (44 us for an XADD, an
XREADGROUP, an XACK and a small XADD, against 4 us for the same bytes).

A connection error disconnects the held connection (the next call connects again) and is raised,
as the client raises it; an error reply (NOGROUP, ...) is raised or, with ``raise_on_error=False``,
left in its place among the replies, as a redis-py pipeline does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import hiredis
import redis
import redis.asyncio as aioredis


def _pairs(fields: list | None) -> dict:
    """An entry's flat [field, value, ...] as redis-py's pairs_to_dict makes it (nil: {})."""
    if fields is None:
        return {}
    it = iter(fields)
    return dict(zip(it, it))


def _parse_read(reply) -> list:
    """An XREAD / XREADGROUP reply as redis-py hands it over: [[stream, [(id, fields), ...]], ...],
    whichever protocol the connection speaks (RESP3, redis-py's default, answers a map
    {stream: entries}; RESP2 a list of [stream, entries]); a timeout's nil is []."""
    if reply is None:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    return [[stream, [(e[0], _pairs(e[1])) if e is not None else (None, None) for e in got]]
            for stream, got in streams]


def _identity(reply):
    return reply


class DirectPipe:
    """The stream commands a hot loop pipelines, queued as on a redis-py pipeline (the methods
    take the same arguments) and run as one write on a held connection."""

    def __init__(self, held: HeldConnection | None = None):
        self.held = held
        self.commands: list[tuple] = []
        self._parsers: list = []

    def __len__(self) -> int:
        return len(self.commands)

    def xadd(self, name, fields: Mapping, maxlen: int | None = None, approximate: bool = True) -> DirectPipe:
        args: list = ["XADD", name]
        if maxlen is not None:
            args += ["MAXLEN", "~" if approximate else "=", maxlen]
        args.append("*")
        for key, value in fields.items():
            args += [key, value]
        return self._queue(args, _identity)

    def xread(self, streams: Mapping, count: int | None = None, block: int | None = None) -> DirectPipe:
        return self._queue(["XREAD", *_read_options(count, block), "STREAMS", *streams, *streams.values()],
                           _parse_read)

    def xreadgroup(self, groupname, consumername, streams: Mapping, count: int | None = None,
                   block: int | None = None) -> DirectPipe:
        return self._queue(["XREADGROUP", "GROUP", groupname, consumername, *_read_options(count, block),
                            "STREAMS", *streams, *streams.values()], _parse_read)

    def _queue(self, args: list, parse) -> DirectPipe:
        self.commands.append(tuple(args))
        self._parsers.append(parse)
        return self

    def take(self) -> tuple[list[tuple], list]:
        """The queued commands and their parsers; the pipe is empty after."""
        taken = self.commands, self._parsers
        self.commands, self._parsers = [], []
        return taken

    def execute(self, raise_on_error: bool = True) -> list:
        """The queued commands, sent on the held connection as one write: their replies, in order."""
        commands, parsers = self.take()
        return _parse(parsers, self.held.execute(commands) if commands else [], raise_on_error)


def _parse(parsers: list, replies: Sequence, raise_on_error: bool) -> list:
    """Each raw reply as redis-py's callback shapes it; an error reply raised, or kept in its place."""
    out = []
    for parse, reply in zip(parsers, replies):
        if isinstance(reply, Exception):
            if raise_on_error:
                raise reply
            out.append(reply)
        else:
            out.append(parse(reply))
    return out


def _pack(commands: Sequence[tuple]) -> list[bytes]:
    """The commands in Redis's protocol, one buffer (what the connections' send_packed_command takes).
    Their arguments are str (UTF-8), bytes, int or float, as the loops here build them; anything else
    is a DataError, as redis-py's encoder would raise it."""
    try:
        return [b"".join([hiredis.pack_command(command) for command in commands])]
    except TypeError as exc:
        raise redis.DataError(f"a stream command's argument: {exc}") from None


def _read_options(count: int | None, block: int | None) -> list:
    options: list = []
    if count is not None:
        options += ["COUNT", count]
    if block is not None:
        options += ["BLOCK", block]
    return options


class HeldConnection:
    """One connection of a client's pool, held by one loop for its round trips."""

    def __init__(self, pool: redis.ConnectionPool):
        self.pool = pool
        self._conn = None

    def execute(self, commands: Sequence[tuple]) -> list:
        """The raw replies of ``commands``, sent as one write; error replies in their places."""
        conn = self._conn or self.pool.get_connection()
        self._conn = conn
        try:
            conn.send_packed_command(_pack(commands))
            replies = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:  # the reply was read whole: the connection is fine
                    replies.append(exc)
            return replies
        except BaseException:  # a lost connection, a timeout, an interrupt: its state is unknown
            self._drop()
            raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()
            self.pool.release(conn)

    def close(self) -> None:
        self._drop()


class AsyncHeldConnection:
    """HeldConnection over redis.asyncio (the gateway's reply-stream reads)."""

    def __init__(self, pool: aioredis.ConnectionPool, *, read_timeout_s: float | None = None):
        self.pool = pool
        self.read_timeout_s = read_timeout_s  # None: the pool's socket timeout
        self._conn = None

    async def execute(self, commands: Sequence[tuple]) -> list:
        conn = self._conn or await self.pool.get_connection()
        self._conn = conn
        try:
            await conn.send_packed_command(_pack(commands))
            replies = []
            # our own timer: redis-py answers None for a read that outlasts a timeout given to it
            async with asyncio.timeout(self.read_timeout_s):
                for _ in commands:
                    try:
                        replies.append(await conn.read_response())
                    except redis.ResponseError as exc:
                        replies.append(exc)
            return replies
        except TimeoutError:  # our timer (asyncio's, the builtin): the reply is still to come, the connection goes
            await self._drop()
            raise redis.TimeoutError(f"no reply from Redis within {self.read_timeout_s}s") from None
        except BaseException:  # cancelled mid-read included: the next reply would be this one's
            await self._drop()
            raise

    async def run(self, pipe: DirectPipe, raise_on_error: bool = True) -> list:
        """``pipe``'s commands on this connection, their replies parsed (the pipe is emptied)."""
        commands, parsers = pipe.take()
        return _parse(parsers, await self.execute(commands) if commands else [], raise_on_error)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect()
            await self.pool.release(conn)

    async def close(self) -> None:
        await self._drop()
