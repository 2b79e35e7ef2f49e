"""Block keys: a chained hash of token blocks, rooted in what makes KV reusable at all.

The root covers the model's weights (content), compute dtype, KV layout, block size,
on-disk format, the tiers' KV precision and the tenant, so a key can never match KV written
by other weights, another layout, another precision or another tenant. Each block's key hashes its parent's
key with its token ids, so equal keys mean equal prefixes (and hits still compare the
stored token ids, so a collision cannot serve wrong KV).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import orjson

from appliance.cache.block import FORMAT_VERSION

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV across the model: what a block's payload holds."""

    num_layers: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: str  # e.g. "float32"
    itemsize: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_heads * (self.k_head_dim + self.v_head_dim) * self.itemsize


@dataclass(frozen=True)
class KeySpace:
    """Where a model's blocks live: its root key and its dir (the SSD directory)."""

    root: bytes
    dir: str
    block_tokens: int

    def block_key(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Returns the key of a block of `tokens` following `parent`."""
        return hashlib.sha256(parent + np.asarray(tokens, dtype="<i4").tobytes()).digest()

    def chain(self, tokens: Sequence[int]) -> list[bytes]:
        """Returns the keys of the full blocks of `tokens`, in order."""
        keys, parent, b = [], self.root, self.block_tokens
        for start in range(0, len(tokens) - b + 1, b):
            parent = self.block_key(parent, tokens[start:start + b])
            keys.append(parent)
        return keys


def key_space(*, weights: str, compute_dtype: str, layout: KVLayout, block_tokens: int,
              tenant: str = DEFAULT_TENANT, kv_bits: tuple[int, int] = (16, 16)) -> KeySpace:
    """Returns the key space of a model's KV for one tenant, with the host and SSD tiers
    keeping KV at `kv_bits` (so blocks of other precisions never match)."""
    identity = {
        "format": FORMAT_VERSION,
        "weights": weights,
        "compute_dtype": compute_dtype,
        "layout": asdict(layout),
        "block_tokens": block_tokens,
        "tenant": tenant,
    }
    if kv_bits != (16, 16):  # as computed, the keys of caches written before precisions existed
        identity["kv_bits"] = list(kv_bits)
    root = hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).digest()
    # The directory names the weights and tenant for people; the root keys everything else.
    return KeySpace(root=root, dir=tenant_dir(weights, tenant), block_tokens=block_tokens)


def model_dir(weights: str) -> str:
    """Returns the SSD directory holding every tenant's blocks of a model (by weights)."""
    return weights[:16]


def tenant_dir(weights: str, tenant: str = DEFAULT_TENANT) -> str:
    """Returns the SSD directory of one tenant's blocks of a model."""
    return f"{model_dir(weights)}/{tenant}"
