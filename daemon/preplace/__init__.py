"""Pre-placement of hot prefixes: the region counts which prefixes are asked for and keeps the
most popular ones soft-pinned at its edges (``kvtierd --preplace-edges``).

- :mod:`.popularity`    decayed counts per chain head, the prefix each head is asked for (pure)
- :mod:`.observations`  the data server's hook: chains queued for counting, off the hot path
- :mod:`.budget`        which ranked prefixes fit an edge's byte budget (pure)
- :mod:`.ledger`        what the region holds soft-pinned at each edge, until when (pure)
- :mod:`.settings`      the ``preplace_*`` settings, checked
- :mod:`.edges`         the edges: a fixed list, or the members of their etcd cluster
- :mod:`.edge_link`     one push's connection to one edge: LOOKUP, PUT, PIN with a TTL
- :mod:`.statistics`    counters and their frozen snapshot
- :mod:`.pusher`        PrePlacer: the periodic worker and the admin API's placements
"""
