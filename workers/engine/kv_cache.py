"""A static, slot-based KV cache that Hugging Face models write into in place.

Storage is allocated once, keys and values of shape ``[layers, slots, kv_heads, max_len, head_dim]``.
Every running request owns one slot, and the scheduler keeps the occupied slots contiguous
(``0..n-1``). So the decode rows are read as the view ``[:n]``, and nothing is gathered or
re-stacked per step (except the decode rows while a request in the middle of the slots is still
prefilled in chunks). When a request leaves, the request in the last slot moves into the hole. With
prefix caching that move is a swap, so the leaver's tokens stay cached in the slot that becomes free.

The object is the model's ``cache``. ``begin`` lays out the next packed forward (see
``attention.py``). Each attention layer then calls ``update(key, value, layer_idx)``, which writes
the forward's keys and values at their (slot, position) in one ``index_put_`` and returns the layer
for ``packed_attention`` to read. docs/internals.md#engine-api-workersengine has the design.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.engine.attention import PackedBatch, PrefillSegment
from workers.engine.device import to_device
from workers.engine.scheduler import CacheOp, Copy


class StepInterrupted(Exception):  # noqa: N818 (not an error: the engine asked for it)
    """Raised between layers when the forward's ``stop`` says so: the step's work is dropped."""


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
        self,
        shape: CacheShape,
        num_slots: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        decode_kernel: bool = False,
    ) -> None:
        self.num_slots = num_slots
        self.decode_kernel = decode_kernel  # the decode rows attend by decode_kernel.py's op
        self.max_len = max_len
        size = (shape.num_layers, num_slots, shape.num_kv_heads, max_len, shape.head_dim)
        self.keys = torch.zeros(size, device=device, dtype=dtype)
        self.values = torch.zeros(size, device=device, dtype=dtype)
        self._device = device
        self._positions = torch.arange(max_len, device=device)
        self._batch: PackedBatch | None = None  # set by begin() for the next forward
        self._stop: Callable[[], bool] | None = None  # likewise

    # -- set-up before a forward ------------------------------------------------------------

    def begin(
        self,
        decode: Sequence[tuple[int, int, int]],
        prefills: Sequence[tuple[int, int, list[int], int]],
        stop: Callable[[], bool] | None = None,
        pad: Callable[[int], int] | None = None,
    ) -> PackedBatch:
        """Lay out one packed forward: ``decode`` is (slot, position, token id) per decoding
        request, ``prefills`` is (slot, start, token ids, wanted) per prefill chunk; the packed
        tokens come in that order. Logits are wanted for every decode row, and for the last
        ``wanted`` tokens of each chunk (0: none; 1 (or True): its last, to sample; all of them:
        a prompt scored, for its prompt logprobs).

        Everything here is known on the host, so it goes to the device in one copy and nothing
        reads back from it. ``stop``, asked before each layer writes, raises ``StepInterrupted``
        when true: the positions written so far lie past every request's computed ones, and the
        step that runs them again overwrites them. ``pad`` (a compiled forward's) gives the token
        count to pad the model's input to, and the number of logits rows.
        """
        self._stop = stop
        tokens = [t for _, _, t in decode]
        slots = [s for s, _, _ in decode]
        positions = [p for _, p, _ in decode]
        rows = list(range(len(decode)))
        segments = []
        for slot, start, chunk, wanted in prefills:
            offset, length = len(tokens), len(chunk)
            tokens += chunk
            slots += [slot] * length
            positions += range(start, start + length)
            rows += range(len(tokens) - int(wanted), len(tokens))
            mask = None
            if start:
                query_pos = self._positions[start : start + length]
                mask = (self._positions[None, : start + length] <= query_pos[:, None])[None, None]
            segments.append(PrefillSegment(offset, slot, start, length, mask))
        num_tokens, num_rows = len(tokens), len(rows)
        padded, padded_rows = (num_tokens, num_rows) if pad is None else (pad(num_tokens), pad(num_rows))
        tokens += [0] * (padded - num_tokens)
        positions += [0] * (padded - num_tokens)
        slots += [0] * (padded - num_tokens)
        rows += [rows[-1] if rows else 0] * (padded_rows - num_rows)
        rows += [0] * (padded - padded_rows)  # (not rows: the copy is one rectangular tensor)
        layout = to_device([tokens, rows, slots, positions], torch.long, self._device)
        n = len(decode)
        kv_len = max(positions[:n], default=-1) + 1
        masked = n > 0 and not self.decode_kernel  # the kernel reads each row to its own position
        self._batch = PackedBatch(
            input_ids=layout[0:1],
            position_ids=layout[3:4],
            logits_rows=layout[1, :padded_rows],
            slots=layout[2, :num_tokens],
            positions=layout[3, :num_tokens],
            num_tokens=num_tokens,
            num_rows=num_rows,
            num_decode=n,
            decode_slots=None if slots[:n] == list(range(n)) else layout[2, :n],
            decode_mask=(self._positions[None, :kv_len] <= layout[3, :n, None])[:, None, None, :]
            if masked
            else None,
            decode_kernel=self.decode_kernel,
            decode_kv_len=kv_len,
            prefills=tuple(segments),
        )
        return self._batch

    # -- the Hugging Face cache protocol (what attention layers call) --------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only used by models to infer position_ids, which Spool always passes.
        return 0

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's keys/values [1, H, T, D] at their (slot, position); return the whole layer.

        ``packed_attention`` reads each request's part of the layer as a view.
        """
        assert self._batch is not None, "begin() sets up a forward before the model runs"
        if self._stop is not None and self._stop():
            raise StepInterrupted
        k_layer, v_layer = self.keys[layer_idx], self.values[layer_idx]  # [slots, H, max_len, D]
        if key.shape[2] > self._batch.num_tokens:  # a compiled forward's padding is not written
            key, value = key[:, :, : self._batch.num_tokens], value[:, :, : self._batch.num_tokens]
        # index_put_ with the slot and position index on dims 0 and 2: values come as [T, H, D].
        k_layer[self._batch.slots, :, self._batch.positions] = key[0].transpose(0, 1)
        v_layer[self._batch.slots, :, self._batch.positions] = value[0].transpose(0, 1)
        return k_layer, v_layer

    # -- slot management ---------------------------------------------------------------------

    def apply(self, ops: Sequence[CacheOp]) -> None:
        """Run the scheduler's slot copies in order: each is one copy over all layers."""
        for op in ops:
            if isinstance(op, Copy):
                self.keys[:, op.dst, :, op.start : op.stop] = self.keys[:, op.src, :, op.start : op.stop]
                self.values[:, op.dst, :, op.start : op.stop] = self.values[:, op.src, :, op.start : op.stop]
            else:  # the right-hand side is gathered into a new tensor first, so the swap is safe
                pair, swapped = [op.a, op.b], [op.b, op.a]
                self.keys[:, pair, :, : op.length] = self.keys[:, swapped, :, : op.length]
                self.values[:, pair, :, : op.length] = self.values[:, swapped, :, : op.length]
