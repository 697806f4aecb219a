"""Prefix caching over the slot cache: which prompt prefixes the KV slots hold. Pure Python.

Tokens are grouped in blocks of ``BLOCK_SIZE``; block ``i`` of a sequence is named by a hash
chained over every token id up to the block's end (``h_i = sha256(h_{i-1} + ids of block i)``),
so two sequences share block ``i``'s hash only if they share all their first ``(i + 1) *
BLOCK_SIZE`` tokens, and the keys and values at those positions are the same. The chain starts
from a hash of the request's ``cache_salt``: requests with different salts (different owners)
never match, so no tenant's time to first token tells it what another's prompts were.

The hashes only name blocks: what a slot holds is the list of hashes of its full blocks, which
a running request extends as it computes (``block_hashes``) and a finished one leaves behind
(``CachedPrefix``) until its slot is reused.

The design and why blocks are copied between slots rather than shared:
docs/internals.md#prefix-caching-prefix_cachepy-schedulerpy-engineconfigenable_prefix_caching-on-by-default-the-workers-spool_enable_prefix_caching.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.request import Request

BLOCK_SIZE = 16


def root_hash(salt: str) -> bytes:
    return hashlib.sha256(b"spool-prefix-cache\0" + salt.encode()).digest()


def block_hashes(request: Request, num_blocks: int) -> list[bytes]:
    """The chained hashes of the request's first ``num_blocks`` full blocks (prompt and output
    tokens), computed once each and kept on the request."""
    hashes = request.block_hashes
    if len(hashes) < num_blocks:
        tokens = request.tokens(len(hashes) * BLOCK_SIZE, num_blocks * BLOCK_SIZE)
        prev = hashes[-1] if hashes else root_hash(request.cache_salt)
        for i in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
            prev = hashlib.sha256(prev + array("q", tokens[i : i + BLOCK_SIZE]).tobytes()).digest()
            hashes.append(prev)
    return hashes[:num_blocks]


def known_blocks(request: Request) -> list[bytes]:
    """Hashes of every full block of the request's known tokens (what it could find cached)."""
    return block_hashes(request, request.num_tokens // BLOCK_SIZE)


def computed_blocks(request: Request) -> list[bytes]:
    """Hashes of the full blocks in the request's slot (what another request could copy)."""
    return block_hashes(request, request.num_computed // BLOCK_SIZE)


def common_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading blocks two chains share (chained: the first difference ends it)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CachedPrefix:
    """What a free slot still holds: a finished request's computed tokens, as block hashes."""

    blocks: list[bytes]  # positions [0, len(blocks) * BLOCK_SIZE) of the slot hold them
    last_used: int  # the scheduler's clock when it was left or last read: LRU order

    @property
    def length(self) -> int:
        return len(self.blocks) * BLOCK_SIZE
