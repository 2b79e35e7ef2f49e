import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cache.keys import DEFAULT_TENANT, KeySpace, KVLayout, key_space

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "0123456789abcdef" * 4
LAYOUT = KVLayout(num_layers=2, kv_heads=2, k_head_dim=16, v_head_dim=16, dtype="float32", itemsize=4)
BASE = dict(weights=WEIGHTS, compute_dtype="float32", layout=LAYOUT, block_tokens=4)


def space(**changes) -> KeySpace:
    return key_space(**{**BASE, **changes})


def test_bytes_per_token_counts_keys_and_values_of_every_layer():
    assert LAYOUT.bytes_per_token == 2 * 2 * (16 + 16) * 4
    assert dataclasses.replace(LAYOUT, v_head_dim=8).bytes_per_token == 2 * 2 * (16 + 8) * 4


def test_same_inputs_give_the_same_root():
    assert space() == space()
    assert space(tenant=DEFAULT_TENANT).root == space().root
    assert len(space().root) == 32


IDENTITY_CHANGES = {
    "weights": {"weights": "f" * 64},
    "weights-same-prefix": {"weights": WEIGHTS[:16] + "x" * 48},  # same directory, other weights
    "compute_dtype": {"compute_dtype": "bfloat16"},
    "block_tokens": {"block_tokens": 8},
    "tenant": {"tenant": "alice"},
    **{f"layout-{name}": {"layout": dataclasses.replace(LAYOUT, **{name: value})}
       for name, value in [("num_layers", 3), ("kv_heads", 4), ("k_head_dim", 32),
                           ("v_head_dim", 8), ("dtype", "float16"), ("itemsize", 2)]},
}


def test_identity_changes_cover_every_layout_field():
    covered = {k.removeprefix("layout-") for k in IDENTITY_CHANGES if k.startswith("layout-")}
    assert covered == {f.name for f in dataclasses.fields(KVLayout)}


@pytest.mark.parametrize("name", IDENTITY_CHANGES)
def test_any_identity_field_changes_the_root(name):
    assert space(**IDENTITY_CHANGES[name]).root != space().root


def test_identity_changes_give_distinct_roots():
    roots = {space(**c).root for c in IDENTITY_CHANGES.values()} | {space().root}
    assert len(roots) == len(IDENTITY_CHANGES) + 1


def test_root_is_the_same_in_another_process():
    code = ("from appliance.cache.keys import KVLayout, key_space\n"
            "layout = KVLayout(num_layers=2, kv_heads=2, k_head_dim=16, v_head_dim=16, dtype='float32', itemsize=4)\n"
            f"print(key_space(weights={WEIGHTS!r}, compute_dtype='float32', layout=layout, block_tokens=4,"
            " tenant='alice').root.hex())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "random", "PATH": ""}).stdout
    assert out.strip() == space(tenant="alice").root.hex()


def test_dir_names_the_weights_prefix_and_tenant():
    assert space().dir == f"{WEIGHTS[:16]}/{DEFAULT_TENANT}"
    assert space(tenant="alice").dir == "0123456789abcdef/alice"
    assert space().block_tokens == 4


def test_chain_has_one_key_per_full_block_only():
    s = space()
    assert s.chain([]) == [] and s.chain([1, 2, 3]) == []
    assert len(s.chain(list(range(4)))) == 1
    assert len(s.chain(list(range(11)))) == 2
    assert len(s.chain(list(range(12)))) == 3


def test_chain_links_each_key_to_its_parent():
    s = space()
    tokens = list(range(12))
    keys = s.chain(tokens)
    assert keys[0] == s.block_key(s.root, tokens[0:4])
    assert keys[1] == s.block_key(keys[0], tokens[4:8])
    assert keys[2] == s.block_key(keys[1], tokens[8:12])
    assert len(set(keys)) == 3
    assert s.chain(tuple(tokens)) == keys  # any sequence type hashes the same


def test_changing_a_token_changes_its_block_and_every_later_key():
    s = space()
    tokens = list(range(16))
    keys = s.chain(tokens)
    first = s.chain([99] + tokens[1:])
    assert all(a != b for a, b in zip(keys, first))
    third = s.chain(tokens[:9] + [99] + tokens[10:])
    assert third[:2] == keys[:2] and third[2] != keys[2] and third[3] != keys[3]


def test_chain_differs_between_roots():
    tokens = list(range(8))
    assert space().chain(tokens) != space(tenant="alice").chain(tokens)


def test_partial_block_key_differs_from_every_full_block_key():
    s = space()
    tokens = list(range(12))
    full = s.chain(tokens)
    parents = [s.root, *full]
    partials = {s.block_key(parent, tokens[i * 4:i * 4 + n]) for i, parent in enumerate(parents[:3])
                for n in (1, 2, 3)}
    assert len(partials) == 9
    assert partials.isdisjoint(full)
    # A block's bytes are its token ids, so a short block is not a prefix-padded full one.
    assert s.block_key(s.root, [0, 1, 2]) != s.block_key(s.root, [0, 1, 2, 0])


def test_the_tiers_precision_is_part_of_the_root():
    spaces = {bits: key_space(weights="ab" * 32, compute_dtype="float32", layout=LAYOUT, block_tokens=4,
                              kv_bits=bits) for bits in [(16, 16), (8, 8), (8, 4)]}
    assert len({s.root for s in spaces.values()}) == 3
    assert spaces[(16, 16)].root == key_space(weights="ab" * 32, compute_dtype="float32", layout=LAYOUT,
                                              block_tokens=4).root
