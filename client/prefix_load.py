"""A prefix load in flight, layer group by layer group.

The prefix's length is known before any byte moves (the hot pool's lease and one
LOOKUP), so its per-layer K and V tensors exist at once; the warm blocks' layer groups
then arrive in order and each is decoded into place::

    start_load ──lease + LOOKUP──> layers (allocated, hot blocks copied in)
      group 0 of every warm block ──decoded──> ready(0)   <- the model's layer 0 may run
      group 1 ...                  ──decoded──> ready(1)
      ...

A consumer waits for the group of the layer it is about to use (:meth:`wait_layer`). A
block whose later group is missing or fails verification shortens the prefix: every
wait from then on raises :class:`PrefixShortened`, with the tokens that are still good,
so the consumer recomputes instead of using KV it was promised and did not get.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Mapping

from kvtier.common.keys import KVLayout


class PrefixShortened(Exception):
    """Part of the prefix failed after its length was promised; ``valid_tokens`` are good."""

    def __init__(self, valid_tokens: int, promised_tokens: int) -> None:
        super().__init__(f"the stored prefix shrank from {promised_tokens} to {valid_tokens} tokens while loading "
                         "(a block was evicted or failed verification)")
        self.valid_tokens = valid_tokens
        self.promised_tokens = promised_tokens


@dataclass
class PrefixLoad:
    """See the module doc. ``layers[i] = (k, v)``, each ``[1, kv_heads, num_tokens, head_dim]``;
    layer i holds its KV once :meth:`wait_layer` (i) returns."""

    layout: KVLayout
    num_tokens: int
    layers: tuple
    blocks_hot: int
    blocks_warm: int
    transports: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._ready = [threading.Event() for _ in range(self.layout.layer_groups)]
        self._lock = threading.Lock()
        self._valid_tokens = self.num_tokens
        self._error: BaseException | None = None

    # --- the consumer's side ------------------------------------------------------
    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Return once ``layer``'s KV is in place; raises :class:`PrefixShortened` if the
        prefix failed, the load's own error if it raised, TimeoutError after ``timeout_s``."""
        if not self._ready[self.layout.group_of_layer(layer)].wait(timeout_s):
            raise TimeoutError(f"layer {layer} of a {self.num_tokens}-token prefix not loaded in {timeout_s} s")
        self._raise_if_failed()

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once every layer is in place (raises as :meth:`wait_layer`)."""
        for group in range(self.layout.layer_groups):
            self.wait_layer(self.layout.group_layers(group).start, timeout_s)

    def wait_prefix(self, timeout_s: float | None = None) -> tuple[int, tuple]:
        """Wait for every layer; the tokens that are good and the layers cut to them (the
        load's own error, or TimeoutError, raises as in :meth:`wait`)."""
        try:
            self.wait(timeout_s)
            return self.num_tokens, self.layers
        except PrefixShortened as short:
            valid = short.valid_tokens
        return valid, tuple((k[:, :, :valid], v[:, :, :valid]) for k, v in self.layers)

    def ready(self, layer: int) -> bool:
        return self._ready[self.layout.group_of_layer(layer)].is_set()

    @property
    def valid_tokens(self) -> int:
        """The tokens that are (or will be) good: ``num_tokens`` unless the prefix shrank."""
        with self._lock:
            return self._valid_tokens

    def _raise_if_failed(self) -> None:
        with self._lock:
            error, valid = self._error, self._valid_tokens
        if error is not None:
            raise error
        if valid < self.num_tokens:
            raise PrefixShortened(valid, self.num_tokens)

    # --- the loader's side ----------------------------------------------------------
    def group_done(self, group: int) -> None:
        self._ready[group].set()

    def shorten(self, valid_tokens: int) -> None:
        """The prefix is good up to ``valid_tokens`` only: every wait now raises."""
        with self._lock:
            self._valid_tokens = min(self._valid_tokens, valid_tokens)
        self._release_all()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
        self._release_all()

    def _release_all(self) -> None:
        for event in self._ready:
            event.set()
