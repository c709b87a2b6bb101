"""The data protocol, sans-IO after h11: ``events`` (messages, limits, error codes, the
exception tree), ``frames`` (the byte layout of a frame), ``readers`` and ``writers``
(decoding and encoding each op), ``state`` (the transition table, the HELLO-first rule,
the requests a client awaits), ``connection`` (the sans-IO connection that puts them
together), and ``sockets``, the one module here that touches a socket."""
