"""``kvtier-router``: which kvtierd node holds the longest stored prefix, from KV events.

* :mod:`.routing_table`  key -> nodes, per-node key sets and sequence checks (pure)
* :mod:`.node_sources`   a node's snapshot (admin API) and replay socket
* :mod:`.subscriber`     keeps the table from N nodes' PUB sockets; gaps -> replay or snapshot
* :mod:`.route_requests` the body of ``POST /v1/route`` -> a key chain (pure)
* :mod:`.router`         answers and counts
* :mod:`.accuracy`       routing-table accuracy, probed with LOOKUP
* :mod:`.node_lookup`    the LOOKUP clients of the probes
* :mod:`.http_api`       the HTTP API and /metrics
* :mod:`.cli`            the entry point
"""
