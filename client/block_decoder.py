"""Verified blocks -> the engine's KV, decoded straight where the KV is wanted.

A block is its layer groups' objects (header + codec payload each, already verified).
Raw payloads on the host are copied once into any destination, whatever its strides
(an output tensor's token range, a host-pool page); other codecs, and device
destinations, decode into a reused per-thread scratch block first. A payload the codec
rejects is a miss (``False``): wrong KV never reaches the engine.
"""
from __future__ import annotations

import threading
from typing import Sequence

from kvtier.common.blockformat import payload_of
from kvtier.common.keys import KVLayout

from .block_payload import copy_tensor, torch_dtype


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
        try:
            self.codec.decode(payload_of(data), out)
        except ValueError:
            return False
        return True
