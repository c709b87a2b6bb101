"""Verified blocks -> the engine's KV, decoded straight where the KV is wanted.

A block is its layer groups' objects (header + codec payload each, already verified).
Raw payloads on the host are copied once into any destination, whatever its strides
(an output tensor's token range, a host-pool page); other codecs, and device
destinations, decode into a reused per-thread scratch block first. Raw blocks bound for a
load's own output may land there straight off the socket (:meth:`BlockDecoder.landing`;
then only their codec header is left to check). A payload the codec rejects is a miss
(``False``): wrong KV never reaches the engine.
"""
from __future__ import annotations

import threading
from typing import Sequence

from kvtier.common.blockformat import HEADER_SIZE, payload_of
from kvtier.common.keys import KVLayout

from .block_payload import copy_tensor, host_bits, torch_dtype
from .scatter_plan import LandedBlock, Landing


class BlockDecoder:
    """Decodes one namespace's blocks; thread-safe (scratch blocks are per thread)."""

    def __init__(self, layout: KVLayout, codec, device: str) -> None:
        self.layout = layout
        self.codec = codec
        self.device = device
        self._scratch = threading.local()

    def empty_block(self):
        import torch

        return torch.empty(self.layout.block_shape, dtype=torch_dtype(self.layout), device=self.device)

    def landing(self, out, first_block: int) -> Landing | None:
        """Where raw blocks ``first_block ..`` of ``out`` (``[L, 2, 1, H, T, D]``, C-contiguous,
        on the host) are received straight into place, or None where they cannot be (another
        codec, a device tensor): group g of block i lands in ``out``'s layers of g, its tokens."""
        if not self._lands_directly(out) or not out.is_contiguous():
            return None
        heads = {len(self._raw_header(g)) for g in range(self.layout.layer_groups)}
        assert len(heads) == 1, f"raw codec headers of one layout differ in size: {heads}"
        _, _, _, H, T, D = out.shape
        flat = memoryview(host_bits(out).reshape(-1)).cast("B")  # rows of T x D per (layer, K|V, head)
        row = T * D * out.element_size()
        run = self.layout.block_tokens * D * out.element_size()  # one block's tokens of a row

        def views(i: int, group: int) -> list[memoryview]:
            start = (first_block + i) * run
            rows = range(self.layout.group_layers(group).start * 2 * H, self.layout.group_layers(group).stop * 2 * H)
            return [flat[r * row + start:r * row + start + run] for r in rows]
        return Landing(HEADER_SIZE + heads.pop(), views, flat)

    def _raw_header(self, group: int) -> bytes:
        headers = getattr(self, "_raw_headers", None)
        if headers is None:
            from kvtier.kernels.arrays import BF16
            import numpy as np

            dtype = BF16 if self.layout.dtype == "bfloat16" else np.dtype(self.layout.dtype)
            headers = self._raw_headers = [
                self.codec.payload_header((len(self.layout.group_layers(g)), *self.layout.block_shape[1:]), dtype)
                for g in range(self.layout.layer_groups)]
        return headers[group]

    def decode(self, objects, out) -> bool:
        """A block's objects into ``out`` (``block_shape``; contiguous unless the codec is raw)."""
        for group, data in enumerate(objects):
            layers = self.layout.group_layers(group)
            if not self._decode_object(data, out[layers.start:layers.stop]):
                return False
        return True

    def decode_into(self, objects, target) -> bool:
        """A block's objects into ``target`` (``block_shape``, any strides, any device)."""
        if self._lands_directly(target):
            return self.decode(objects, target)
        scratch = self._scratch_block()
        if not self.decode(objects, scratch):
            return False
        copy_tensor(target, scratch)
        return True

    def decode_into_tokens(self, objects, out, index: int, groups: Sequence[int] | None = None) -> bool:
        """A block's objects (its layer groups ``groups``, all by default) into block
        ``index``'s tokens of ``out`` (``[L, 2, 1, H, T, D]``)."""
        b = self.layout.block_tokens
        groups = range(self.layout.layer_groups) if groups is None else groups
        for group, data in zip(groups, objects):
            if isinstance(data, LandedBlock):  # already in place (see landing()): its codec header says so
                if bytes(data.head[HEADER_SIZE:]) != self._raw_header(group):
                    return False
                continue
            layers = self.layout.group_layers(group)
            dest = out[layers.start:layers.stop, :, 0, :, index * b:(index + 1) * b]
            if self._lands_directly(out):
                if not self._decode_object(data, dest):
                    return False
                continue
            part = self._scratch_block()[:len(layers)]
            if not self._decode_object(data, part):
                return False
            copy_tensor(dest, part)
        return True

    def _lands_directly(self, dest) -> bool:
        return self.codec.name == "raw" and dest.device.type == "cpu"

    def _scratch_block(self):
        block = getattr(self._scratch, "block", None)
        if block is None:
            block = self._scratch.block = self.empty_block()
        return block

    def _decode_object(self, data, out) -> bool:
        assert not isinstance(data, LandedBlock), "a landed block reached a decode into another destination"
        try:
            self.codec.decode(payload_of(data), out)
        except ValueError:
            return False
        return True
