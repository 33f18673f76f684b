"""Physical KV blocks: who holds them, which prefixes they cache, which are free.

KV pool of one layer (K and V alike):

    block id ─▶ [ slot 0 | slot 1 | ... | slot block_size-1 ]   each slot: [num_kv_heads, head_dim]
    block 0  =  the null block: never handed out, pads block tables

A request's ``block_table[i]`` holds its tokens ``i*block_size .. (i+1)*block_size-1``; the token
at position p lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_svc.request import Request

NULL_BLOCK = 0
_ROOT_HASH = b"pagedserve-prefix-root-v1"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Iterable[int], extra_keys: bytes = b"") -> bytes:
    """SHA-256 over (parent hash ‖ fixed-width token ids ‖ extra keys): stable across processes,
    and no algebraic collisions (each id is its own 8 bytes, not a term in a polynomial)."""
    ids = list(token_ids)
    h = hashlib.sha256(parent_hash or _ROOT_HASH)
    h.update(struct.pack(f"<I{len(ids)}q", len(ids), *ids))
    h.update(struct.pack("<I", len(extra_keys)))
    h.update(extra_keys)
    return h.digest()


@dataclass(eq=False, slots=True)
class Block:
    """One physical block: its reference count, its prefix hash once full, its free-queue links."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head evicted first); O(1) removal
    from the middle, which a prefix-cache hit on a free block needs."""

    def __init__(self, blocks: Iterable[Block]):
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next, block.prev, block.next, self._tail.prev = block, last, self._tail, block
        self.num_free += 1

    def popleft(self) -> Block:
        block = self._head.next
        if block is None or block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, "block is not in the free queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def __iter__(self):
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Totals since start, in tokens: prompt tokens of first admissions, and those served from
    the cache (vLLM's prefix_cache_queries / prefix_cache_hits)."""

    queries: int
    hits: int


class BlockManager:
    """Allocates, frees, shares and matches blocks; never decides who runs.

    Invariants: a block is in the free queue iff its ref count is 0; a cached block (one with a
    hash) is the only block registered under that hash; block 0 is never handed out.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (1 is the null block), got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, Block] = {}
        self._num_cache_queries = 0  # tokens of first admissions; written by allocate_slots only
        self._num_cache_hits = 0  # of them, tokens served from the cache

    # ------------------------------------------------------------------ accounting
    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def update_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        if (len(request.block_hashes) + 1) * bs > request.num_tokens:
            return
        extra = request.cache_salt.encode() if request.cache_salt else b""
        while (len(request.block_hashes) + 1) * bs <= request.num_tokens:
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else None
            request.block_hashes.append(hash_block_tokens(parent, request.token_ids[i * bs:(i + 1) * bs], extra))

    def match_prefix(self, request: Request) -> list[Block]:
        """The longest chain of cached blocks for the request's prompt, covering at most
        num_tokens - 1 tokens (the last one is always computed, to give logits)."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_cache_queries, self._num_cache_hits)

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, hits: list[Block] | None = None,
                       copies: list[tuple[int, int]] | None = None, *, count_prefix_query: bool = False) -> bool:
        """Give ``request`` the blocks to write ``num_new_tokens`` more tokens (after taking the
        prefix-cache ``hits``), copying a shared block it must write into. False, with nothing
        changed, when the free blocks do not suffice. ``count_prefix_query`` (a first admission)
        counts the request's tokens and its hits in the prefix-cache stats, once it succeeded."""
        if not self._allocate(request, num_new_tokens, hits, copies):
            return False
        if count_prefix_query:
            self._num_cache_queries += request.num_tokens
            self._num_cache_hits += len(hits or ()) * self.block_size
        return True

    def _allocate(self, request: Request, num_new_tokens: int, hits: list[Block] | None,
                  copies: list[tuple[int, int]] | None) -> bool:
        if not hits and self._fits_in_place(request, num_new_tokens):  # the common decode step
            end = request.num_computed_tokens + num_new_tokens
            if self.enable_prefix_caching and end // self.block_size > request.num_registered_blocks:
                self._cache_full_blocks(request, end)
            return True
        hits = hits or []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens) - len(request.block_table) - len(hits)
        cow_index = self._cow_index(request, num_computed) if not hits else None
        evictable_hits = sum(1 for b in hits if b.ref_count == 0)
        if num_needed + (cow_index is not None) + evictable_hits > self.num_free_blocks:
            return False
        for block in hits:
            self._touch(block)
            request.block_table.append(block.block_id)
        if hits:
            request.num_computed_tokens = num_computed
        if cow_index is not None:
            src = self.blocks[request.block_table[cow_index]]
            dst = self._pop_free()
            dst.ref_count = 1
            src.ref_count -= 1  # still >= 1: another sharer holds it
            request.block_table[cow_index] = dst.block_id
            if copies is not None:
                copies.append((src.block_id, dst.block_id))
        for _ in range(num_needed):
            block = self._pop_free()
            block.ref_count = 1
            request.block_table.append(block.block_id)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (copy-on-write on its first write)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def free(self, request: Request) -> None:
        """Drop the request's references, tail first, so that its last blocks are evicted first."""
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue.append(block)
        request.block_table = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0

    # ------------------------------------------------------------------ internals
    def _fits_in_place(self, request: Request, num_new_tokens: int) -> bool:
        """The tokens land in blocks the request already owns alone."""
        start = request.num_computed_tokens
        if start + num_new_tokens > len(request.block_table) * self.block_size:
            return False
        return start % self.block_size == 0 or self.blocks[request.block_table[start // self.block_size]].ref_count == 1

    def _cow_index(self, request: Request, num_computed: int) -> int | None:
        """Index of the partly filled block the next write lands in, when others share it."""
        if num_computed % self.block_size == 0:
            return None
        index = num_computed // self.block_size
        if index < len(request.block_table) and self.blocks[request.block_table[index]].ref_count > 1:
            return index
        return None

    def _touch(self, block: Block) -> None:
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def _pop_free(self) -> Block:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # evict the least recently freed cached block
            del self.cached[block.block_hash]
            block.block_hash = None
        return block

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that will be full once ``num_tokens`` tokens are written. Their
        content is written this step, before any later step can read a hit on them."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(request.block_table))
        for i in range(request.num_registered_blocks, num_full):
            block = self.blocks[request.block_table[i]]
            if block.block_hash is not None:
                continue
            block_hash = request.block_hashes[i]
            if block_hash in self.cached:  # another request computed the same prefix meanwhile
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)
