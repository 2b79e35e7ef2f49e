"""The mlx-lm seam: the private mlx-lm code it was read from is unchanged, and BatchCache
hands out string masks (the fused attention kernels) only while no row can be padded."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from appliance.engine.mlxlm_seam import MLX_LM_VERSION, UPSTREAM, BatchCache, row_view, set_size, upstream_hash


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_the_mlx_lm_code_the_seam_depends_on_is_unchanged(name):
    recorded, recheck = UPSTREAM[name]
    assert upstream_hash(name) == recorded, (
        f"mlx-lm {mlx_lm.__version__} changed {name} (recorded from {MLX_LM_VERSION}): re-check "
        f"{recheck} in appliance/engine/mlxlm_seam.py, then record the new hash and version there")


def filled(left_padding: list[int], n: int) -> BatchCache:
    c = BatchCache(left_padding)
    k = mx.random.normal((len(left_padding), 2, n, 4))
    c.update_and_fetch(k, k)
    return c


def test_set_size_moves_where_the_tokens_end():
    c = filled([0], 10)
    set_size(c, 6)
    assert c.size() == 6
    assert c.extract(0).keys.shape[2] == 6


def test_an_unpadded_cache_hands_out_the_masks_of_a_plain_kv_cache():
    c = filled([0], 10)
    assert c.make_mask(1) is None
    assert c.make_mask(5) == "causal"
    assert isinstance(c.make_mask(5, return_array=True), mx.array)
    assert isinstance(c.make_mask(5, window_size=4), mx.array)


def test_padding_from_any_source_gives_array_masks():
    assert isinstance(filled([2, 0], 10).make_mask(1), mx.array)
    right = BatchCache([0, 0])
    right.prepare(lengths=[5, 3], right_padding=[0, 2])
    assert right.padded
    a, b = filled([0], 10), filled([0], 6)
    a.extend(b)  # different lengths: the shorter row is left-padded
    assert a.padded and isinstance(a.make_mask(1), mx.array)
    same = filled([0], 8)
    same.extend(filled([0], 8))
    assert not same.padded


def test_filter_and_merge_recompute_padding():
    a, b = filled([0], 10), filled([0], 6)
    a.extend(b)
    a.filter([0])  # the longer row alone: its padding is gone
    assert not a.padded and a.make_mask(1) is None
    plain = [KVCache(), KVCache()]
    plain[0].update_and_fetch(mx.zeros((1, 2, 4, 4)), mx.zeros((1, 2, 4, 4)))
    plain[1].update_and_fetch(mx.zeros((1, 2, 7, 4)), mx.zeros((1, 2, 7, 4)))
    merged = BatchCache.merge(plain)
    assert type(merged) is BatchCache and merged.padded


def test_a_state_set_from_outside_counts_as_padded():
    c = filled([0], 4)
    c.state = BatchKVCache.state.fget(filled([0], 4))
    assert c.padded


def test_array_masks_match_mlx_lms_when_padded():
    c = filled([2, 0], 10)
    mask = c.make_mask(3)
    assert mask.shape[-2:] == (3, 13) and not bool(mask[0, 0, 0, 0].item()) and bool(mask[1, 0, 0, 0].item())


def test_row_view_is_the_rows_tokens_without_padding():
    c = filled([3, 0], 8)
    view = row_view(c, 0)
    assert view.offset == 5 and view.keys.shape[2] == 5
    np.testing.assert_array_equal(np.array(view.keys), np.array(c.extract(0).keys))
