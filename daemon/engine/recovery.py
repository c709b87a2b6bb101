"""Recovery: find every region's entries on flash and pick the live blocks.

1. Read every region's header page and last page (one parallel batch each).
2. Header invalid, of another generation, or not above the store's seq floor
   (an erased generation's) -> the region is free.
   Trailer valid with the header's generation and base_seq -> *sealed*: read
   its summary (CRC-checked). A valid trailer with a *newer* base_seq: a later
   use of the region was sealed before its (unsynced) header reached flash --
   sealed with the trailer's base_seq, or free if that summary is torn.
   Otherwise the region was *open*: read it whole
   and walk its self-describing blocks; the walk stops at the first block that
   is torn or corrupt (CRCs), out of place, or not newer than the one before.
   Every entry must lie in the region's seq span, ``base_seq < seq <=
   base_seq + span_max`` (:func:`seq_span_max`), and a block entry's bytes
   in the region's data area (:func:`_in_place`): anything else on flash is
   stale or damaged and is dropped (never an assert).
3. :func:`select_live` merges all entries: per key the newest block wins,
   then tombstones (``seq <= target_seq`` of the key), namespace tombstones
   and pin/unpin records (newest record for that exact block) apply.

Summary entries of sealed regions are trusted after their CRC; the blocks
they point to are verified on every read (a torn one is a miss), and fully by
``fsck``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, decode_header, verify_block

from . import regionfmt as fmt
from kvtier.common.aligned import ALIGNMENT_BYTES, aligned_buffer, align_down
from .index import DELETED, SEQ_DELTA_MAX  # DELETED: the index's marker, never a block length
from .raid0 import StripedArray
from .regions import RegionState

SCAN_BATCH_REGIONS = 256  # header/trailer pages read per parallel batch: bounds the scratch memory


@dataclass
class RegionScan:
    region: int
    kind: RegionState  # as found on flash: FREE, SEALED or OPEN (open at the crash)
    base_seq: int = 0
    last_seq: int = 0
    data_end: int = 0
    entries: np.ndarray = field(default_factory=lambda: np.zeros(0, fmt.SUMMARY_DTYPE))
    dropped_entries: int = 0
    note: str = ""
    image: memoryview | None = None  # open regions: the region as read
    seq_bound: int = 0  # no seq of any use of this region still on flash exceeds this (any generation)


def seq_span_max(region_size_bytes: int) -> int:
    """The largest ``seq - base_seq`` a region can hold: every seq taken while a region is open
    is one of its summary entries, so a region of N entry slots spans at most N seqs (and the
    span must fit the index's seq delta field)."""
    return min(region_size_bytes // fmt.ENTRY_BYTES, SEQ_DELTA_MAX)


def scan_regions(array: StripedArray, region_count: int, region_size_bytes: int, generation: int,
                 seq_floor: int = 0) -> list[RegionScan]:
    """Classify every region (see the module doc). ``seq_floor``: the superblock's; a region of
    this generation whose base_seq is not above it is treated as free."""
    scans: list[RegionScan] = []
    for first in range(0, region_count, SCAN_BATCH_REGIONS):
        batch = range(first, min(region_count, first + SCAN_BATCH_REGIONS))
        heads = aligned_buffer(len(batch) * ALIGNMENT_BYTES)
        tails = aligned_buffer(len(batch) * ALIGNMENT_BYTES)
        ranges = []
        for i, region in enumerate(batch):
            base = region * region_size_bytes
            ranges.append((base, heads[i * ALIGNMENT_BYTES:(i + 1) * ALIGNMENT_BYTES]))
            ranges.append((base + region_size_bytes - ALIGNMENT_BYTES, tails[i * ALIGNMENT_BYTES:(i + 1) * ALIGNMENT_BYTES]))
        array.read_ranges(ranges)
        for i, region in enumerate(batch):
            head = heads[i * ALIGNMENT_BYTES:(i + 1) * ALIGNMENT_BYTES]
            tail = tails[(i + 1) * ALIGNMENT_BYTES - fmt.TRAILER_BYTES:(i + 1) * ALIGNMENT_BYTES]
            scans.append(_classify(array, region, region_size_bytes, generation, head, tail, seq_floor))
    return scans


def _classify(array, region, region_size_bytes, generation, head, tail, seq_floor=0) -> RegionScan:
    try:
        header = fmt.decode_region_header(head)
    except fmt.RegionFormatError as exc:
        return RegionScan(region, RegionState.FREE, note=str(exc))
    span_max = seq_span_max(region_size_bytes)
    bound = header.base_seq + span_max  # any generation: its blocks may still lie in this region
    if header.generation != generation or header.region_index != region:
        return RegionScan(region, RegionState.FREE, note="region header of an older generation", seq_bound=bound)
    if header.base_seq <= seq_floor:
        return RegionScan(region, RegionState.FREE, note=f"region base_seq {header.base_seq} is not above the "
                          f"store's seq floor {seq_floor} (erased)", seq_bound=bound)
    try:
        trailer = fmt.decode_trailer(tail)
        # a trailer newer than the header: a later use of the region was sealed but its header
        # page (not synced until the next durability promise) never reached flash. Its summary is
        # whole (CRC) and self-describing: the region is that use's (the older use held nothing
        # that had to outlive it). An older trailer is a former use's: the region is open.
        if (trailer.generation, trailer.region_index) != (generation, region) or \
                trailer.base_seq < header.base_seq:
            raise fmt.RegionFormatError("trailer of an older use of this region")
        newer = trailer.base_seq != header.base_seq
        if newer:
            bound = max(bound, trailer.base_seq + span_max)
        try:
            entries = _read_summary(array, region, region_size_bytes, trailer)
        except fmt.RegionFormatError as exc:
            if not newer and not _overwritten_by_newer_use(array, region, region_size_bytes, trailer):
                raise  # damaged: its blocks are scanned
            # a later use's summary (torn) lies over this one: neither can be read back whole, and the
            # older use held nothing that had to outlive it (a walk would serve blocks its lost
            # summary deleted)
            return RegionScan(region, RegionState.FREE,
                              note=f"summary overwritten by a later use of the region ({exc})", seq_bound=bound)
        entries, dropped = _in_span(entries, trailer.base_seq, span_max)
        entries, misplaced = _in_place(entries, region_size_bytes, trailer.entry_count)
        dropped += misplaced
        last = min(trailer.last_seq, trailer.base_seq + span_max)
        note = f"{dropped} summary entries outside the region's seq span or data area dropped" if dropped else ""
        return RegionScan(region, RegionState.SEALED, trailer.base_seq, last, trailer.data_end, entries, dropped,
                          note, seq_bound=bound)
    except fmt.RegionFormatError as exc:
        note = f"open or torn region ({exc}); blocks scanned"
    image = aligned_buffer(region_size_bytes)
    array.read(region * region_size_bytes, image)
    entries, data_end, dropped = scan_open_image(image, header.base_seq)
    last = int(entries["seq"].max()) if len(entries) else header.base_seq
    kind = RegionState.OPEN if len(entries) else RegionState.FREE
    return RegionScan(region, kind, header.base_seq, last, data_end, entries, dropped, note, image, bound)


def _in_span(entries: np.ndarray, base_seq: int, span_max: int) -> tuple[np.ndarray, int]:
    """The entries whose seq lies in (base_seq, base_seq + span_max], and how many were not."""
    seq = entries["seq"]
    ok = (seq > np.uint64(base_seq)) & (seq - np.uint64(base_seq) <= np.uint64(span_max))
    return (entries, 0) if ok.all() else (entries[ok], int(len(entries) - np.count_nonzero(ok)))


def _in_place(entries: np.ndarray, region_size_bytes: int, entry_count: int) -> tuple[np.ndarray, int]:
    """The entries of a known kind whose block (block entries) lies whole in the region's data
    area -- at least a block header long, from REGION_HEADER_BYTES to the start of the summary
    of ``entry_count`` entries -- and how many were not. A CRC-valid summary may still hold
    such an entry (a bug, a stray write): dropped here, never handed to the index."""
    kind = entries["kind"]
    is_block = kind == fmt.KIND_BLOCK
    offset = entries["offset"].astype(np.int64)
    length = entries["length"].astype(np.int64)
    data_end = region_size_bytes - fmt.summary_bytes(entry_count)
    placed = ((length >= HEADER_SIZE) & (length < DELETED) & (offset >= fmt.REGION_HEADER_BYTES)
              & (offset + length <= data_end))
    ok = np.where(is_block, placed, np.isin(kind, _META_KINDS))
    return (entries, 0) if ok.all() else (entries[ok], int(len(entries) - np.count_nonzero(ok)))


def _overwritten_by_newer_use(array, region, region_size_bytes, trailer) -> bool:
    """Whether a summary that failed its CRC holds an entry newer than its trailer's last seq:
    written by a later use of the region whose header never reached flash (a torn seal)."""
    count = min(trailer.entry_count, (region_size_bytes - fmt.REGION_HEADER_BYTES - fmt.TRAILER_BYTES)
                // fmt.ENTRY_BYTES)
    end = region_size_bytes - fmt.TRAILER_BYTES
    start = align_down(end - fmt.ENTRY_BYTES * count)
    buf = aligned_buffer(region_size_bytes - start)
    array.read(region * region_size_bytes + start, buf)
    raw = np.frombuffer(buf[end - fmt.ENTRY_BYTES * count - start:end - start], dtype=fmt.SUMMARY_DTYPE)
    return bool(np.any(raw["seq"] > np.uint64(trailer.last_seq)))


def _read_summary(array, region, region_size_bytes, trailer) -> np.ndarray:
    raw_bytes = fmt.ENTRY_BYTES * trailer.entry_count
    end = region_size_bytes - fmt.TRAILER_BYTES
    if raw_bytes > end - fmt.REGION_HEADER_BYTES:
        raise fmt.RegionFormatError(f"summary of {trailer.entry_count} entries does not fit the region")
    start = align_down(end - raw_bytes)
    buf = aligned_buffer(region_size_bytes - start)
    array.read(region * region_size_bytes + start, buf)
    return fmt.decode_entries(buf[end - raw_bytes - start:end - start], trailer)


def scan_open_image(image: memoryview, base_seq: int) -> tuple[np.ndarray, int, int]:
    """Walk the blocks of a region image from the header page on, then the summary entries that
    were made durable before the seal (metadata records, flags of blocks).

    Returns (entries in seq order, data_end, dropped): ``dropped`` is 1 when the walk stopped at
    something that looked like a block but failed its checks.
    """
    size = image.nbytes
    seq_max = base_seq + seq_span_max(size)
    pos = fmt.REGION_HEADER_BYTES
    prev_seq = base_seq
    rows = []
    dropped = 0
    while pos + HEADER_SIZE + fmt.summary_bytes(len(rows) + 1) <= size:
        try:
            header = decode_header(image[pos:pos + HEADER_SIZE])
        except BlockFormatError:
            break
        end = pos + header.block_size
        if header.seq <= prev_seq or header.seq > seq_max or end + fmt.summary_bytes(len(rows) + 1) > size:
            break  # older (an earlier use of the region, an erased generation), implausible or too long
        try:
            verify_block(image[pos:end])
        except BlockFormatError:
            dropped = 1
            break
        k0, k1 = np.frombuffer(header.key, "<u8")
        rows.append([int(k0), int(k1), header.ns_id, header.seq, header.seq, pos, header.block_size,
                     fmt.KIND_BLOCK, 0, b""])
        prev_seq = header.seq
        pos = end
    rows += _durable_entries(image, base_seq, pos, rows)
    rows.sort(key=lambda row: row[3])
    return np.array([tuple(r) for r in rows], dtype=fmt.SUMMARY_DTYPE), pos, dropped


_META_KINDS = (fmt.KIND_TOMBSTONE, fmt.KIND_PIN, fmt.KIND_UNPIN, fmt.KIND_NS_TOMBSTONE)


def _durable_entries(image: memoryview, base_seq: int, data_end: int, blocks: list) -> list:
    """Summary entries of an open region, read from its tail while they are plausible: seqs
    increasing from base_seq (older or stale bytes stop the walk). Entries are 64 bytes inside
    512-byte sectors, so a torn write leaves each one old or new, never mixed. A block entry
    only lends its flags to the scanned block it matches exactly; metadata records are returned."""
    by_offset = {row[5]: row for row in blocks}
    size = image.nbytes
    seq_max = base_seq + seq_span_max(size)
    meta = []
    prev_seq = base_seq
    index = 0
    while (position := fmt.entry_position(size, index)) >= data_end:
        k0, k1, ns, seq, target, offset, length, kind, flags = fmt.ENTRY_STRUCT.unpack_from(image, position)
        if seq <= prev_seq or seq > seq_max or (kind != fmt.KIND_BLOCK and kind not in _META_KINDS):
            break
        if kind == fmt.KIND_BLOCK:
            row = by_offset.get(offset)
            if row is not None and (row[0], row[1], row[3], row[6]) == (k0, k1, seq, length):
                row[8] = flags
        else:
            meta.append([k0, k1, ns, seq, target, 0, 0, kind, 0, b""])
        prev_seq = seq
        index += 1
    return meta


@dataclass(frozen=True)
class LiveSet:
    """The blocks recovery keeps, as columns."""

    k0: np.ndarray
    k1: np.ndarray
    region: np.ndarray  # int32
    offset: np.ndarray  # uint32, in the region
    length: np.ndarray  # uint32
    seq: np.ndarray
    pinned: np.ndarray
    max_seq: int
    meta_records: dict  # region -> [(kind, k0, k1, ns, seq, target_seq)]


def select_live(scans: list[RegionScan]) -> LiveSet:
    """The live blocks of every scanned region. Each region's entries are split into block columns
    as it is visited, and a sealed region's raw entries are released then (only open regions'
    are written back, by rebuild): recovery never holds every entry twice."""
    active = [scan for scan in scans if scan.kind != RegionState.FREE]
    with_ns = any(len(scan.entries) and (scan.entries["kind"] == fmt.KIND_NS_TOMBSTONE).any() for scan in active)
    names = ("k0", "k1", "seq", "offset", "length", "flags") + (("ns",) if with_ns else ())
    is_block = [scan.entries["kind"] == fmt.KIND_BLOCK for scan in active]
    total = sum(int(np.count_nonzero(mask)) for mask in is_block)
    # block columns, contiguous (sorted and fancy-indexed as columns, not as 64-byte records), filled in
    # place region by region: no list of parts concatenated at the end
    cols = {name: np.empty(total, fmt.SUMMARY_DTYPE[name]) for name in names}
    cols["region"] = np.empty(total, np.int32)
    metas: list[tuple[int, np.ndarray]] = []  # (region, its metadata records), in scan order
    max_seq, at = 0, 0
    for scan, blocks in zip(active, is_block):
        entries, count = scan.entries, int(np.count_nonzero(blocks))
        max_seq = max(max_seq, scan.last_seq, scan.base_seq, int(entries["seq"].max()) if len(entries) else 0)
        for name in names:
            cols[name][at:at + count] = entries[name][blocks]
        cols["region"][at:at + count] = scan.region
        at += count
        if count < len(entries):
            metas.append((scan.region, entries[~blocks]))
        if scan.kind == RegionState.SEALED:
            scan.entries = np.zeros(0, fmt.SUMMARY_DTYPE)
        del entries
    del is_block
    meta = np.concatenate([records for _, records in metas]) if metas else np.zeros(0, fmt.SUMMARY_DTYPE)
    keep = _newest_per_key(cols["k0"], cols["k1"], cols["seq"])
    pinned = (cols["flags"] & fmt.FLAG_PINNED) != 0
    if len(meta):
        keep, pinned = _apply_meta(cols, cols.get("ns"), keep, pinned, meta)
    return LiveSet(cols["k0"][keep], cols["k1"][keep], cols["region"][keep], cols["offset"][keep],
                   cols["length"][keep], cols["seq"][keep], pinned[keep], max_seq,
                   _records_by_region(metas))


def _records_by_region(metas: list[tuple[int, np.ndarray]]) -> dict[int, list[tuple]]:
    """``{region: [(kind, k0, k1, ns, seq, target_seq), ...]}`` of the metadata records, each
    region's in its summary order (built column by column: no per-record unpacking)."""
    return {region: list(zip(meta["kind"].tolist(), meta["k0"].tolist(), meta["k1"].tolist(), meta["ns"].tolist(),
                             meta["seq"].tolist(), meta["target_seq"].tolist()))
            for region, meta in metas}


def _newest_per_key(k0: np.ndarray, k1: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Mask of the newest entry of every key. One sort on k0; the rare keys seen more than once
    (re-put after delete, reinsertion) are resolved among themselves."""
    keep = np.ones(len(k0), bool)
    if len(k0) < 2:
        return keep
    order = np.argsort(k0)
    sorted_k0 = k0[order]
    same = np.nonzero(sorted_k0[1:] == sorted_k0[:-1])[0]
    if not same.size:
        return keep
    members = order[np.unique(np.concatenate([same, same + 1]))]
    sub = members[np.lexsort((seq[members], k1[members], k0[members]))]
    newest = np.ones(len(sub), bool)
    newest[:-1] = (k0[sub][:-1] != k0[sub][1:]) | (k1[sub][:-1] != k1[sub][1:])
    keep[sub[~newest]] = False
    return keep


def _apply_meta(cols, ns, keep, pinned, meta):
    """Tombstones, namespace tombstones and pin/unpin records, vectorized: a tombstone drops its
    key's newest block if that block is not newer than its target; of the pin and unpin records
    that name a block (its key and seq), the newest decides whether it is pinned."""
    seqs = cols["seq"]
    live = np.nonzero(keep)[0]  # the newest block of each key: what per-key records refer to
    kind = meta["kind"]
    for rec in meta[kind == fmt.KIND_NS_TOMBSTONE]:
        ns_id = np.frombuffer(np.array([rec["k0"], rec["k1"]], "<u8").tobytes(), "V16")[0]
        keep &= ~((ns == ns_id) & (seqs < rec["target_seq"]))
    per_key = meta[np.isin(kind, (fmt.KIND_TOMBSTONE, fmt.KIND_PIN, fmt.KIND_UNPIN))]
    if not len(per_key) or not len(live):
        return keep, pinned
    at = _positions(cols["k0"][live], cols["k1"][live], per_key["k0"], per_key["k1"])
    named = at >= 0
    recs, block = per_key[named], live[at[named]]
    tomb = recs["kind"] == fmt.KIND_TOMBSTONE
    keep[block[tomb][seqs[block[tomb]] <= recs["target_seq"][tomb]]] = False
    pins = ~tomb & (seqs[block] == recs["target_seq"])
    block, recs = block[pins], recs[pins]
    if not len(block):
        return keep, pinned
    order = np.lexsort((recs["seq"], block))  # per block, its records oldest first
    block, recs = block[order], recs[order]
    newest = np.r_[block[1:] != block[:-1], True]
    pinned[block[newest]] = recs["kind"][newest] == fmt.KIND_PIN
    return keep, pinned


def _positions(k0: np.ndarray, k1: np.ndarray, q0: np.ndarray, q1: np.ndarray) -> np.ndarray:
    """For each query key (q0, q1), its position in the distinct keys (k0, k1), or -1. One sort
    on k0; the rare k0 shared by several keys is resolved by a scan of those few."""
    order = np.argsort(k0, kind="stable")
    sorted_k0 = k0[order]
    queries = np.argsort(q0)  # sorted queries walk the sorted keys in order: cache-friendly
    lo, hi = np.empty(len(q0), np.int64), np.empty(len(q0), np.int64)
    lo[queries] = np.searchsorted(sorted_k0, q0[queries], "left")
    hi[queries] = np.searchsorted(sorted_k0, q0[queries], "right")
    out = np.full(len(q0), -1, np.int64)
    one = hi - lo == 1
    cand = order[lo[one]]
    out[np.flatnonzero(one)[k1[cand] == q1[one]]] = cand[k1[cand] == q1[one]]
    for i in np.flatnonzero(hi - lo > 1).tolist():
        for j in order[lo[i]:hi[i]].tolist():
            if k1[j] == q1[i]:
                out[i] = j
                break
    return out


def write_summary(array: StripedArray, image: memoryview, region: int, generation: int, entries: np.ndarray,
                  base_seq: int, data_end: int) -> None:
    """Lay ``entries`` out as the summary of a region image and write the summary pages, synced.
    Used to seal a region found open at recovery, and by fsck to drop bad entries."""
    size = image.nbytes
    for i, row in enumerate(entries.tolist()):
        k0, k1, ns, seq, target, offset, length, kind, flags, _ = row
        fmt.pack_entry(image, fmt.entry_position(size, i), k0, k1, bytes(ns), seq, target, offset, length, kind, flags)
    first = fmt.entry_position(size, len(entries) - 1) if len(entries) else size - fmt.TRAILER_BYTES
    last_seq = int(entries["seq"].max()) if len(entries) else base_seq
    trailer = fmt.make_trailer(image[first:size - fmt.TRAILER_BYTES], generation, region, len(entries), base_seq,
                               last_seq, data_end)
    image[size - fmt.TRAILER_BYTES:] = fmt.encode_trailer(trailer)
    start = align_down(first)
    array.write(region * size + start, image[start:])
    array.sync()


def read_region_entries(array: StripedArray, region: int, region_size_bytes: int, base_seq: int) -> np.ndarray:
    """A sealed region's summary entries; if its summary was damaged since, or is not this use's
    (a region recovered open whose summary the device refused still ends in its previous use's
    trailer), its blocks, scanned."""
    tail = aligned_buffer(ALIGNMENT_BYTES)
    array.read(region * region_size_bytes + region_size_bytes - ALIGNMENT_BYTES, tail)
    try:
        trailer = fmt.decode_trailer(tail[ALIGNMENT_BYTES - fmt.TRAILER_BYTES:])
        if trailer.region_index != region or trailer.base_seq != base_seq:
            raise fmt.RegionFormatError(f"region {region}'s trailer is of another use (base_seq "
                                        f"{trailer.base_seq}, this use's {base_seq})")
        return _read_summary(array, region, region_size_bytes, trailer)
    except fmt.RegionFormatError:
        image = aligned_buffer(region_size_bytes)
        array.read(region * region_size_bytes, image)
        return scan_open_image(image, base_seq)[0]
