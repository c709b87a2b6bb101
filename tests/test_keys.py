import subprocess
import sys

import numpy as np
import pytest

from kvtier.common.keys import KEY_SIZE_BYTES, KVLayout, Namespace, chain_keys

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=16)
NS = Namespace("llama-test", LAYOUT, codec="raw")


def test_one_key_per_full_block_only():
    assert len(NS.keys(range(15))) == 0
    assert len(NS.keys(range(16))) == 1
    assert len(NS.keys(range(47))) == 2
    assert all(len(k) == KEY_SIZE_BYTES for k in NS.keys(range(64)))


def test_keys_chain_so_a_shared_prefix_shares_keys_and_nothing_after():
    a = NS.keys(list(range(64)))
    b = NS.keys(list(range(32)) + [7] * 32)
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]
    # a change in block 0 changes every later key, even with identical later tokens
    c = NS.keys([1] + list(range(1, 64)))
    assert all(x != y for x, y in zip(a, c))


def test_list_and_array_inputs_agree():
    toks = list(range(1000, 1064))
    assert NS.keys(toks) == NS.keys(np.array(toks, dtype=np.int64)) == NS.keys(np.array(toks, dtype=np.uint32))


@pytest.mark.parametrize("change", [
    dict(tenant_salt="tenant-b"),
    dict(model="other-model"),
    dict(codec="int8"),
    dict(layout=KVLayout(4, 2, 8, "bfloat16", 16)),
    dict(layout=KVLayout(5, 2, 8, "float16", 16)),
    dict(extra={"lora": "adapter-1"}),
])
def test_every_namespace_field_changes_every_key(change):
    fields = dict(model=NS.model, layout=NS.layout, codec=NS.codec, tenant_salt=NS.tenant_salt, extra={})
    fields.update(change)
    other = Namespace(**fields)
    assert other.id != NS.id
    assert not set(other.keys(range(64))) & set(NS.keys(range(64)))


def test_keys_are_deterministic_across_processes():
    code = (
        "from kvtier.common.keys import KVLayout, Namespace;"
        "ns = Namespace('llama-test', KVLayout(4, 2, 8, 'float16', 16), codec='raw');"
        "print(','.join(k.hex() for k in ns.keys(range(64))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out.split(",") == [k.hex() for k in NS.keys(range(64))]


def test_known_vector_pins_the_format():
    # Changing this value means every stored block in the field becomes unreachable.
    ns_id = bytes(range(16))
    assert chain_keys(ns_id, range(4), 4)[0].hex() == chain_keys(ns_id, [0, 1, 2, 3], 4)[0].hex()
    assert chain_keys(ns_id, range(4), 4)[0].hex() == _blake_reference(ns_id, range(4))


def _blake_reference(prev, tokens):
    import hashlib
    import struct
    data = b"".join(struct.pack("<I", t) for t in tokens)
    return hashlib.blake2b(prev + data, digest_size=16, person=b"kvtier-blk-v1").hexdigest()


@pytest.mark.parametrize("bad", [[-1], [2**32], [[1, 2]], [1.5]])
def test_bad_tokens_are_rejected(bad):
    with pytest.raises(ValueError):
        NS.keys(bad)


def test_bad_namespaces_are_rejected():
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 1, 1, "int7")
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout(0, 1, 1)
    with pytest.raises(ValueError, match="model"):
        Namespace("", LAYOUT)
    with pytest.raises(TypeError):
        NS.extra["x"] = "y"  # type: ignore[index]


def test_layout_sizes():
    assert LAYOUT.block_shape == (4, 2, 2, 16, 8)
    assert LAYOUT.block_raw_bytes == 4 * 2 * 2 * 16 * 8 * 2


def test_the_daemon_side_imports_stay_light():
    """A storage node installs no GPU stack: the daemon's modules and the codec
    id table must import without torch, numba or the codec kernels."""
    code = (
        "import sys, kvtier.daemon.main, kvtier.daemon.server, kvtier.daemon.engine, kvtier.common.codec_ids;"
        "heavy = [m for m in ('torch', 'numba', 'cupy', 'transformers', 'kvtier.kernels.codec') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"heavy modules imported by the daemon side: {out}"


def test_key_chain_extends_by_new_blocks_only():
    ns = Namespace("m", KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=4))
    tokens = list(range(1, 40))
    chain = ns.key_chain()
    seen = []
    for n in (0, 3, 4, 5, 11, 12, 12, 39):
        seen.append(len(chain.extend(tokens[:n])))
        assert chain.keys == ns.keys(tokens[:n])
    assert seen == [0, 0, 1, 1, 2, 3, 3, 9]
    assert chain.tokens_hashed == 36


def test_key_chain_hashes_only_the_new_tokens(monkeypatch):
    import kvtier.common.keys as keys_mod

    ns = Namespace("m", KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=4))
    chain = ns.key_chain()
    chain.extend(list(range(400)))
    converted = []
    real = keys_mod.tokens_as_uint32
    monkeypatch.setattr(keys_mod, "tokens_as_uint32", lambda t: converted.append(len(t)) or real(t))
    chain.extend(list(range(408)))
    assert converted == [8]
    assert chain.keys == ns.keys(list(range(408)))


def test_tokens_from_lists_are_range_checked():
    from kvtier.common.keys import tokens_as_uint32

    assert tokens_as_uint32([0, 2**32 - 1]).tolist() == [0, 2**32 - 1]
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError, match="token ids must lie"):
            tokens_as_uint32(bad)
    with pytest.raises(ValueError, match="must be integers"):
        tokens_as_uint32([1.5])


def test_namespace_id_is_computed_once():
    ns = Namespace("m", KVLayout(num_layers=2, num_kv_heads=1, head_dim=4))
    assert ns.id is ns.id
    assert ns.id == Namespace("m", KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)).id


def test_layer_groups_split_layers_evenly_and_keep_ids_of_whole_blocks():
    from kvtier.common.keys import layer_group_key

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, layer_groups=3)
    assert [layout.group_layers(g) for g in range(3)] == [range(0, 10), range(10, 21), range(21, 32)]
    assert [layout.group_of_layer(i) for i in (0, 9, 10, 20, 21, 31)] == [0, 0, 1, 1, 2, 2]
    assert layout.group_shape(1) == (11, 2, 8, 16, 128)
    whole = Namespace("m", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128))
    assert b"layer_groups" not in whole.canonical()  # ids of existing namespaces do not change
    assert Namespace("m", layout).id != whole.id
    key = whole.keys(list(range(16)))[0]
    assert layer_group_key(key, 0) == key
    group_keys = {layer_group_key(key, g) for g in range(1, 4)}
    assert len(group_keys) == 3 and key not in group_keys
    for bad in (0, 33):
        with pytest.raises(ValueError, match="layer_groups"):
            KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, layer_groups=bad)
    with pytest.raises(ValueError, match="outside"):
        layout.group_layers(3)
