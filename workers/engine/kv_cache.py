"""A static, slot-based KV cache that Hugging Face models write into in place.

Storage is allocated once: keys and values of shape ``[layers, slots, kv_heads, max_len, head_dim]``.
Every running request owns one slot; the scheduler keeps the occupied slots contiguous
(``0..n-1``), so a decode forward reads ``[:n]`` as a view and nothing is ever gathered,
concatenated or re-stacked per step. When a request leaves, the request in the last slot is
moved into the hole (one copy of that request's tokens, once).

The object is passed to the model as its ``cache``: each attention layer calls
``update(key, value, layer_idx)``, which writes the new keys/values at the positions of the
current forward and returns the views the layer attends over. ``begin_prefill`` /
``begin_decode`` set up those positions (and the attention mask) before each forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


class ShapeProbe:
    """Stands in for the cache during one tiny forward to learn each layer's key/value shape."""

    def __init__(self) -> None:
        self.shapes: dict[int, tuple[int, ...]] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.shapes[layer_idx] = tuple(key.shape)
        return key, value

    def cache_shape(self) -> CacheShape:
        shapes = set(self.shapes.values())
        if not shapes or len(shapes) != 1:
            raise ValueError(f"unsupported model: attention layers have different key shapes {shapes}")
        (_, heads, _, dim) = shapes.pop()
        return CacheShape(num_layers=len(self.shapes), num_kv_heads=heads, head_dim=dim)


class SlotKVCache:
    def __init__(
        self, shape: CacheShape, num_slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        size = (shape.num_layers, num_slots, shape.num_kv_heads, max_len, shape.head_dim)
        self.keys = torch.zeros(size, device=device, dtype=dtype)
        self.values = torch.zeros(size, device=device, dtype=dtype)
        self._device = device
        self._rows = torch.arange(num_slots, device=device)
        self._positions = torch.arange(max_len, device=device)
        # Set by begin_prefill / begin_decode for the next forward.
        self._slot = 0  # prefill: the request's slot
        self._start = 0  # prefill: position of the chunk's first token
        self._num_rows = 0  # decode: rows 0..n-1 take part
        self._decode_pos: torch.Tensor | None = None  # decode: [n] position each row writes
        self._kv_len = 0  # keys/values the layers attend over

    # -- set-up before a forward ------------------------------------------------------------

    def begin_prefill(self, slot: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ``length`` tokens of ``slot`` at positions [start, start+length).

        Returns position_ids ``[1, length]`` and the attention mask ``[1, 1, length, start+length]``.
        """
        self._slot, self._start, self._decode_pos = slot, start, None
        self._kv_len = start + length
        query_pos = self._positions[start : start + length]  # [L]
        mask = self._positions[None, : self._kv_len] <= query_pos[:, None]  # [L, S]: causal, offset by start
        return query_pos[None, :], mask[None, None]

    def begin_decode(self, positions: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one token in each of the slots 0..n-1, slot i at ``positions[i]``.

        ``kv_len`` is 1 + the largest position (known on the host, so no device sync).
        Returns position_ids ``[n, 1]`` and the attention mask ``[n, 1, 1, kv_len]``.
        """
        self._num_rows = positions.shape[0]
        self._decode_pos = positions
        self._kv_len = kv_len
        mask = self._positions[None, :kv_len] <= positions[:, None]  # [n, S]
        return positions[:, None], mask[:, None, None, :]

    # -- the Hugging Face cache protocol (what attention layers call) --------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only used by models to infer position_ids, which Spool always passes.
        return 0

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_layer, v_layer = self.keys[layer_idx], self.values[layer_idx]  # [slots, H, max_len, D]
        if self._decode_pos is None:
            # key: [1, H, L, D]
            end = self._start + key.shape[2]
            k_layer[self._slot, :, self._start : end] = key[0]
            v_layer[self._slot, :, self._start : end] = value[0]
            s = slice(self._slot, self._slot + 1)
            return k_layer[s, :, : self._kv_len], v_layer[s, :, : self._kv_len]
        # key: [n, H, 1, D]; index_put_ writes each row at its own position.
        rows = self._rows[: self._num_rows]
        k_layer[rows, :, self._decode_pos] = key[:, :, 0]
        v_layer[rows, :, self._decode_pos] = value[:, :, 0]
        return k_layer[: self._num_rows, :, : self._kv_len], v_layer[: self._num_rows, :, : self._kv_len]

    # -- slot management ---------------------------------------------------------------------

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        self.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
        self.values[:, dst, :, :length] = self.values[:, src, :, :length]
