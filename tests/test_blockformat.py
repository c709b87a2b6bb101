import pytest

from kvtier.common.blockformat import (HEADER_SIZE, BlockFormatError, decode_header, encode_block,
                                       encode_header, payload_of, stamp_sequence, verify_block)

KEY = bytes(range(16))
NS = bytes(range(16, 32))


def test_round_trip_and_payload_view():
    block = encode_block(KEY, NS, 2, b"payload bytes")
    h = verify_block(block, expected_key=KEY, expected_seq=0)
    assert (h.key, h.ns_id, h.codec_id, h.payload_len, h.seq) == (KEY, NS, 2, 13, 0)
    assert bytes(payload_of(block)) == b"payload bytes"
    assert len(encode_header(KEY, NS, 2, b"x")) == HEADER_SIZE == 64


def test_stamp_sequence_keeps_block_valid():
    block = bytearray(encode_block(KEY, NS, 1, b"abc"))
    stamp_sequence(block, 2**40 + 3)
    assert verify_block(block, expected_seq=2**40 + 3).seq == 2**40 + 3
    with pytest.raises(BlockFormatError, match="sequence"):
        verify_block(block, expected_seq=1)


def test_every_single_bit_flip_is_caught():
    block = encode_block(KEY, NS, 1, b"0123456789abcdef")
    for i in range(len(block)):
        for bit in (0, 7):
            bad = bytearray(block)
            bad[i] ^= 1 << bit
            with pytest.raises(BlockFormatError):
                verify_block(bad, expected_key=KEY)


@pytest.mark.parametrize("mutate,message", [
    (lambda b: b[:10], "shorter"),
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b + b"extra", "header says"),
    (lambda b: b[:-1], "header says"),
])
def test_malformed_blocks_name_the_problem(mutate, message):
    block = encode_block(KEY, NS, 1, b"abcdef")
    with pytest.raises(BlockFormatError, match=message):
        verify_block(mutate(block))


def test_wrong_key_is_a_mismatch():
    with pytest.raises(BlockFormatError, match="expected"):
        verify_block(encode_block(KEY, NS, 1, b"a"), expected_key=NS)


def test_bad_key_sizes_are_rejected():
    with pytest.raises(BlockFormatError, match="key"):
        encode_header(b"short", NS, 1, b"")
    with pytest.raises(BlockFormatError, match="namespace"):
        encode_header(KEY, b"short", 1, b"")


def test_decode_header_alone():
    assert decode_header(encode_block(KEY, NS, 3, b"zz")).codec_id == 3
