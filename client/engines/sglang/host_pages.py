"""SGLang host-pool pages <-> kvtier blocks (torch only, no framework imports).

SGLang's ``MHATokenToKVPoolHost`` keeps every layer's K and V in one
``kv_buffer`` whose axis order is the pool's ``layout``; a page is
``page_size`` consecutive token slots. A kvtier block is one page::

    block = [layers, 2 (K, V), kv_heads, page_size, head_dim]

    layout             kv_buffer                                  flat data page (generic API)
    layer_first        [2, layers, tokens, heads, dim]            [2, layers, page, heads, dim]
    page_first         [2, tokens, layers, heads, dim]            [2, page, layers, heads, dim]
    page_first_direct  [2, pages, layers, page, heads, dim]       [2, 1, layers, page, heads, dim]
    page_head          [2, pages, heads, page, layers, dim]       [2, 1, heads, page, layers, dim]

:class:`HostPages` gives each page of the pool as a block-shaped view
(:meth:`page_views`: basic slicing and a permutation, no copy), so the v1
interface reads and writes the pool in place: a loaded block is copied
straight into its page, a saved page is copied straight out of it into the
send buffer. It also moves whole batches with one advanced-indexing gather or
scatter, and converts single flat pages (the generic interface).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

# kv_buffer[<index>] -> [n, layers, 2, heads, page, dim]: (index style, permutation)
_GATHER = {
    "layer_first": ("tokens_at_2", (2, 1, 0, 4, 3, 5)),  # [2, L, n, P, H, D]
    "page_first": ("tokens_at_1", (1, 3, 0, 4, 2, 5)),  # [2, n, P, L, H, D]
    "page_first_direct": ("pages_at_1", (1, 2, 0, 4, 3, 5)),  # [2, n, L, P, H, D]
    "page_head": ("pages_at_1", (1, 4, 0, 2, 3, 5)),  # [2, n, H, P, L, D]
}
# kv_buffer[<one page>] -> [L, 2, H, P, D]: (index style, permutation); every style is a basic slice (a view)
_PAGE = {
    "layer_first": ("tokens_at_2", (1, 0, 3, 2, 4)),  # [2, L, P, H, D]
    "page_first": ("tokens_at_1", (2, 0, 3, 1, 4)),  # [2, P, L, H, D]
    "page_first_direct": ("pages_at_1", (1, 0, 3, 2, 4)),  # [2, L, P, H, D]
    "page_head": ("pages_at_1", (3, 0, 1, 2, 4)),  # [2, H, P, L, D]
}
# flat page (reshaped to 5 axes) -> block [L, 2, H, P, D], and back
_FLAT = {
    "layer_first": ("2LPHD", (1, 0, 3, 2, 4), (1, 0, 3, 2, 4)),
    "page_first": ("2PLHD", (2, 0, 3, 1, 4), (1, 3, 0, 2, 4)),
    "page_first_direct": ("2LPHD", (1, 0, 3, 2, 4), (1, 0, 3, 2, 4)),
    "page_head": ("2HPLD", (3, 0, 1, 2, 4), (1, 2, 3, 0, 4)),
}


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


@dataclass
class HostPages:
    """Page I/O on one host pool's ``kv_buffer``."""

    kv_buffer: torch.Tensor
    layout: str
    page_size: int
    num_layers: int
    num_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"host pool layout {self.layout!r} is not supported; supported: {LAYOUTS}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_heads, self.page_size, self.head_dim)

    # --- the v1 interface: pages addressed by host token indices --------------
    def page_tokens(self, host_indices: torch.Tensor, num_pages: int) -> torch.Tensor:
        """``host_indices`` as ``[num_pages, page_size]`` token slots; ValueError
        unless each page is ``page_size`` consecutive slots starting on a page boundary."""
        idx = torch.as_tensor(host_indices, dtype=torch.int64).reshape(-1).cpu()
        if idx.numel() != num_pages * self.page_size:
            raise ValueError(f"{idx.numel()} host indices for {num_pages} pages of {self.page_size}")
        tokens = idx.view(num_pages, self.page_size)
        starts = tokens[:, :1]
        if bool((starts % self.page_size != 0).any()) or not torch.equal(
                tokens - starts, torch.arange(self.page_size).expand_as(tokens)):
            raise ValueError("host indices are not whole, aligned pages")
        return tokens

    def page_views(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Each page at ``tokens`` (from :meth:`page_tokens`) as a ``[L, 2, H, P, D]`` view
        into ``kv_buffer``: writes go straight into the host pool."""
        style, perm = _PAGE[self.layout]
        out = []
        for start in tokens[:, 0].tolist():
            if style == "tokens_at_2":
                page = self.kv_buffer[:, :, start:start + self.page_size]
            elif style == "tokens_at_1":
                page = self.kv_buffer[:, start:start + self.page_size]
            else:
                page = self.kv_buffer[:, start // self.page_size]
            out.append(page.permute(perm))
        return out

    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        """The pages at ``tokens`` (from :meth:`page_tokens`) as ``[n, L, 2, H, P, D]``."""
        style, perm = _GATHER[self.layout]
        return self._index(style, tokens).permute(perm).contiguous()

    def write(self, tokens: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write ``blocks`` ``[n, L, 2, H, P, D]`` into the pages at ``tokens``."""
        style, perm = _GATHER[self.layout]
        src = blocks.permute(_inverse(perm))
        if style == "tokens_at_2":
            self.kv_buffer[:, :, tokens] = src
        elif style == "tokens_at_1":
            self.kv_buffer[:, tokens] = src
        else:
            self.kv_buffer[:, tokens[:, 0] // self.page_size] = src

    def _index(self, style: str, tokens: torch.Tensor) -> torch.Tensor:
        if style == "tokens_at_2":
            return self.kv_buffer[:, :, tokens]
        if style == "tokens_at_1":
            return self.kv_buffer[:, tokens]
        return self.kv_buffer[:, tokens[:, 0] // self.page_size]

    # --- the generic interface: one flat data page ---------------------------
    def _flat_shape(self) -> tuple[int, ...]:
        order = _FLAT[self.layout][0]
        size = {"2": 2, "L": self.num_layers, "P": self.page_size, "H": self.num_heads, "D": self.head_dim}
        return tuple(size[c] for c in order)

    def block_from_flat(self, flat: torch.Tensor) -> torch.Tensor:
        shape = self._flat_shape()
        if flat.numel() != 2 * self.num_layers * self.page_size * self.num_heads * self.head_dim:
            raise ValueError(f"flat page of {flat.numel()} elements, expected a page of shape {shape}")
        return flat.reshape(shape).permute(_FLAT[self.layout][1]).contiguous()

    def flat_from_block(self, block: torch.Tensor) -> torch.Tensor:
        return block.permute(_FLAT[self.layout][2]).contiguous().flatten()
