"""KV events in vLLM's format: every block a daemon stores or drops, published on ZMQ.

* :mod:`.kv_event_format` the msgspec structs and the multipart message (pure)
* :mod:`.event_sink`      the engine's listener: numbers and queues each change, never blocks
* :mod:`.publisher`       the thread with the PUB and replay (ROUTER) sockets
* :mod:`.snapshot`        every stored key and the sequence number it corresponds to
* :mod:`.service`         the three started and stopped together

Needs the ``events`` extra (pyzmq, msgspec); nothing here is imported unless
``--kv-events-endpoint`` is set.
"""
