"""The owners of keys among a cluster's members: the rendezvous rule lives in
:mod:`kvtier.common.rendezvous` (the daemon's upstream client routes by it too); its names
are re-exported here for the clients and tools that import them from ``kvtier.client``."""
from __future__ import annotations

from kvtier.common.rendezvous import (  # noqa: F401  (re-exported)
    MEMBERS_MAX, RANK_BY_ARGMAX_MAX, SCORE_CELLS_MAX, Rendezvous, _key_hashes, _mix, _mix_inplace, _top,
    positions_by_owner)
