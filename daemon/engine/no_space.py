"""The text of a NoSpaceError from reclaim (pure): one line, whatever the region count.

Reclaim tries every victim and notes why each one failed; the reasons are few and the regions
many, so each reason is said once with how many regions it stopped and the first of them.
"""
from __future__ import annotations

REGIONS_NAMED_MAX = 8  # regions listed per reason: enough to look one up, short for any store


def no_space_message(causes: dict[str, list[int]], sealed_count: int, pinned_bytes: int,
                     capacity_bytes: int) -> str:
    """``causes``: reason -> the regions it stopped, in the order tried."""
    pinned = f"pinned bytes: {pinned_bytes} of {capacity_bytes}"
    if not causes:
        return (f"every one of the {sealed_count} sealed regions holds more pinned bytes than can be moved "
                f"({pinned}; unpin or delete blocks)")
    parts = []
    for reason, regions in causes.items():
        named = ", ".join(str(r) for r in regions[:REGIONS_NAMED_MAX])
        more = f", ... ({len(regions) - REGIONS_NAMED_MAX} more)" if len(regions) > REGIONS_NAMED_MAX else ""
        parts.append(f"{reason}: {len(regions)} region{'s' if len(regions) != 1 else ''} ({named}{more})")
    return f"no region could be reclaimed without losing pinned blocks or records ({pinned}): {'; '.join(parts)}"
