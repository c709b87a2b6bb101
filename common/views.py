"""Lists of buffer views, as vectored I/O takes them."""
from __future__ import annotations


def views_past(views: list[memoryview], count: int) -> list[memoryview]:
    """``views`` without their first ``count`` bytes (what a short ``preadv``/``pwritev`` left to do)."""
    out = []
    for view in views:
        if count >= view.nbytes:
            count -= view.nbytes
            continue
        out.append(view[count:])
        count = 0
    return out
