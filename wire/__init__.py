"""The data protocol, sans-IO after h11: ``events`` (messages, limits, error codes, the
exception tree), ``frames`` (the byte layout of each op), ``connection`` (the state
machine), and ``sockets``, the one module here that touches a socket."""
