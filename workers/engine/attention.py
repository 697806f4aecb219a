"""Packed attention: every token of a step (decode rows and prefill chunks) in one forward.

The engine feeds the model one packed sequence ``[1, T]``: first one token per decoding
request, then each scheduled prefill chunk. The linear layers, which dominate a forward, run
once over all ``T`` tokens; only attention is split, here, because each token attends over its
own request's KV slot. ``SlotKVCache.update`` writes the step's keys and values in place and
hands back the whole layer; ``packed_attention`` then runs one batched SDPA over the decode
rows (on a CPU in float32, decode_kernel.py's op instead) and one causal SDPA per prefill
chunk, reading the slots as views.

It is registered with transformers' ``AttentionInterface`` under the name ``"spool"`` and the
model is loaded with ``attn_implementation="spool"``, so any model whose attention layers
dispatch through that interface (Llama, Qwen2, GPT-2, OPT, ...) runs packed. Outside a packed
forward (no ``PackedBatch`` active) it is plain SDPA.

A compiled forward (``EngineConfig.compile``) passes the model no cache: each layer's key/value
write and its packed attention are then the custom op ``spool::attend``, opaque to the compiler
(``torch.export``, then AOTInductor), so what changes shape every step stays out of the graph.

The contract: docs/internals.md#engine-api-workersengine ("Inside a step").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "spool"


@dataclass(frozen=True)
class PrefillSegment:
    offset: int  # index of the chunk's first token in the packed sequence
    slot: int
    start: int  # position of the chunk's first token
    length: int
    mask: torch.Tensor | None  # [1, 1, length, start + length]; None when start == 0 (plain causal)


@dataclass(frozen=True)
class PackedBatch:
    """One packed forward, set up by ``SlotKVCache.begin``: its tokens, and where each goes."""

    input_ids: torch.Tensor  # [1, T'] the tokens, then T' - T of padding (a compiled forward's)
    position_ids: torch.Tensor  # [1, T'] the position of each (0 for padding)
    logits_rows: torch.Tensor  # [rows] the tokens whose logits the step needs (repeated: padding)
    slots: torch.Tensor  # [T] the KV slot of each token
    positions: torch.Tensor  # [T] the position of each token
    num_tokens: int  # T
    num_rows: int  # the rows of logits_rows that are not padding
    num_decode: int  # tokens 0..num_decode-1 are decode rows, one per request
    decode_slots: torch.Tensor | None  # [num_decode]; None when the rows are slots 0..num_decode-1
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, decode_kv_len]; None with decode_kernel
    decode_kv_len: int
    decode_kernel: bool  # the decode rows attend by decode_kernel.py's op (a CPU, float32), not SDPA
    prefills: tuple[PrefillSegment, ...]


class KVWriter(Protocol):
    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


_current: ContextVar[PackedBatch | None] = ContextVar("spool_packed_batch", default=None)
_writer: ContextVar[KVWriter | None] = ContextVar("spool_kv_writer", default=None)
calls = 0  # attention calls seen; the model runner checks that a model dispatches here


@contextmanager
def active(batch: PackedBatch, writer: KVWriter | None = None) -> Iterator[None]:
    """Run a forward packed as ``batch``. ``writer`` is only for a compiled forward, which passes
    the model no cache, so the attention op writes each layer's keys and values itself (``attend``)."""
    token, writer_token = _current.set(batch), _writer.set(writer)
    try:
        yield
    finally:
        _current.reset(token)
        _writer.reset(writer_token)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hkv * groups, L, D], result head h being head h // groups (as
    transformers' repeat_kv): an expand and a reshape, with no copy when ``groups`` is 1."""
    if groups == 1:
        return x
    b, heads, length, dim = x.shape
    return x[:, :, None].expand(b, heads, groups, length, dim).reshape(b, heads * groups, length, dim)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # packed: the layer's whole cache [slots, Hkv, max_len, D]; compiled: [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if torch.compiler.is_compiling():  # the model runs with no cache: the op writes the layer
        return attend(query, key, value, module.layer_idx, scaling).unsqueeze(0), None
    global calls
    calls += 1
    batch = _current.get()
    if batch is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    return _packed(batch, query, key, value, scaling).unsqueeze(0), None


@torch.library.custom_op("spool::attend", mutates_args=())
def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scaling: float | None
) -> torch.Tensor:
    """A compiled forward's attention layer: write the step's keys and values [1, Hkv, T, D] into
    the cache, then attend as ``packed_attention`` does; [T, Hq, D]. One opaque op to the
    compiler: its shapes change every step (the requests' lengths), so it runs as it does
    eagerly, and what the compiler fuses is the rest of the layer."""
    batch, writer = _current.get(), _writer.get()
    assert batch is not None and writer is not None, "a compiled forward runs inside active(batch, writer)"
    k_layer, v_layer = writer.update(key, value, layer_idx)
    return _packed(batch, query, k_layer, v_layer, scaling)


@attend.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scaling: float | None
) -> torch.Tensor:
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])


def _packed(
    batch: PackedBatch, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """The packed attention of ``query`` [1, Hq, T, D] over the layer's cache ``key``/``value``
    [slots, Hkv, max_len, D]: [T, Hq, D]. Rows past the batch's tokens (a compiled forward's
    padding) are zeros."""
    # NOTE: grouped-query attention (fewer key/value heads than query heads) never goes to SDPA
    # with both a mask and enable_gqa: on CUDA that pair falls back to the slow math kernel.
    _, heads, length, dim = query.shape
    groups = heads // key.shape[1]  # query heads per key/value head
    out = query.new_empty(length, heads, dim)  # [T, Hq, D]
    if length > batch.num_tokens:
        out[batch.num_tokens :] = 0
    n = batch.num_decode
    if n and batch.decode_kernel:  # each row read to its own position from its slot: no mask, no gather
        q = query[0, :, :n].transpose(0, 1)  # [n, Hq, D], a view
        scale = dim**-0.5 if scaling is None else scaling
        out[:n] = torch.ops.spool_cpu.decode_attention(
            q, key, value, batch.slots[:n], batch.positions[:n], scale
        )
    elif n:
        kv = batch.decode_kv_len
        if batch.decode_slots is None:
            k, v = key[:n, :, :kv], value[:n, :, :kv]
        else:
            k, v = key[batch.decode_slots, :, :kv], value[batch.decode_slots, :, :kv]
        # One query per row: a key/value head's query heads go in as a query "length" of `groups`
        # (head h reads key/value head h // groups), so the mask [n, 1, 1, kv] serves them all.
        q = query[0, :, :n].transpose(0, 1).reshape(n, heads // groups, groups, dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.decode_mask, scale=scaling)
        out[:n] = o.reshape(n, heads, dim)
    for seg in batch.prefills:
        end = seg.start + seg.length
        q = query[:, :, seg.offset : seg.offset + seg.length]  # [1, Hq, L, D]
        k, v = key[seg.slot : seg.slot + 1, :, :end], value[seg.slot : seg.slot + 1, :, :end]
        if seg.mask is None:  # the chunk starts the sequence: plain causal, no mask
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
        else:  # a later chunk of a long prompt (rare): repeat the key/value heads
            k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=scaling)
        out[seg.offset : seg.offset + seg.length] = o[0].transpose(0, 1)
    return out


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)
