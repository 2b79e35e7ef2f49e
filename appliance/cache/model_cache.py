"""One model's view of the KV store: find a prompt's cached prefix, restore it, save new KV.

A prompt's prefix is matched block by block along the key chain; then, among the stored
blocks that follow the last match, the one sharing the longest token prefix with the
rest of the prompt serves that shared part. A revisited prompt restores all but its last
token, and a new question after a cached context restores the whole context.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from appliance.cache.keys import DEFAULT_TENANT, KeySpace, KVLayout, key_space, model_dir
from appliance.cache.kv import build_batch_cache, cut_blocks
from appliance.cache.store import HOST, MEMORY, SSD, KVStore
from appliance.kernels.kv_quant import block_meta, payload_nbytes
from appliance.moving_average import moving_average

# An SSD hit is restored only when its estimated restore, times this, still beats
# recomputing it. An SSD restore's speed varies with what else the machine is doing, and
# the estimate comes from a probe or from earlier restores: after a restart on an H200,
# 8B prompts' SSD restores took 1.9-2.9 times their estimate (reads at a third of the
# probed rate while the engine pinned host memory), and chosen by margins of 4-33%, each
# lost to recomputing (by 1.2-2.7 times its TTFT). A wrong recompute forgoes the margin;
# a wrong restore costs the misestimate, so the margin asked for is wide.
SSD_RISK = 1.5


@dataclass(frozen=True)
class Saving:
    """One request's KV to store: the blocks of `tokens` past `skip_tokens` that `cache` holds."""

    cache: list[KVCache]
    tokens: Sequence[int]
    tenant: str = DEFAULT_TENANT
    skip_tokens: int = 0


@dataclass(frozen=True)
class Hit:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]  # the stored block's tokens
    tier: str
    use_tokens: int  # how many of them this prompt restores


@dataclass(frozen=True)
class Lookup:
    hits: tuple[Hit, ...] = ()
    tenant: str = DEFAULT_TENANT

    @property
    def num_tokens(self) -> int:
        return sum(h.use_tokens for h in self.hits)

    def truncated(self, n: int) -> Lookup:
        return Lookup(self.hits[:n], self.tenant)

    def aligned(self, multiple: int) -> Lookup:
        """Returns the prefix of this lookup whose length is a multiple of `multiple`
        tokens, its last hit shortened (a block's first tokens serve alone); itself where it
        is whole already (every lookup off MLX CUDA, where `multiple` is 1)."""
        if self.num_tokens % multiple == 0:
            return self
        left = self.num_tokens // multiple * multiple
        hits = []
        for hit in self.hits:
            if left <= 0:
                break
            use = min(hit.use_tokens, left)
            hits.append(hit if use == hit.use_tokens else replace(hit, use_tokens=use))
            left -= use
        return Lookup(tuple(hits), self.tenant)


@dataclass(frozen=True)
class Restored:
    cache: list[BatchKVCache] | None  # the engine's batch-of-one cache, one per layer
    num_tokens: int
    tiers: dict[str, int]  # tokens restored from each tier


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Returns how many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# The tenant of the request being served: its API key's, set by the server's auth
# (appliance.server.guard) for the task serving the request; the default tenant elsewhere.
REQUEST_TENANT: ContextVar[str] = ContextVar("omlx_request_tenant", default=DEFAULT_TENANT)


def kv_tenant(tenant: str, salt: str | None = None) -> str:
    """Returns whose KV a tenant's requests read and write, narrowed by a `cache_salt`:
    KV tenants never share blocks, and no salt reaches another tenant's KV (tenant names
    have no '.', salts are hashed)."""
    salted = "salt-" + hashlib.sha256(salt.encode()).hexdigest()[:24] if salt else None
    if tenant == DEFAULT_TENANT:
        return salted or DEFAULT_TENANT
    return f"tenant-{tenant}" + (f".{salted}" if salted else "")


def request_tenant(salt: str | None) -> str:
    """Returns the KV tenant of the request being served, with its `cache_salt`."""
    return kv_tenant(REQUEST_TENANT.get(), salt)


def block_payloads(layout: KVLayout, block_tokens: int, store: KVStore) -> set[int]:
    """Returns the payload bytes of a full block of `layout` at each of `store`'s tiers'
    precisions."""
    k_shape = [layout.num_layers, layout.kv_heads, block_tokens, layout.k_head_dim]
    v_shape = [layout.num_layers, layout.kv_heads, block_tokens, layout.v_head_dim]
    return {payload_nbytes(block_meta(layout.dtype, k_shape, v_shape, bits))
            for bits in {store.kv_bits[HOST], store.kv_bits[SSD]}}


class ModelCache:
    def __init__(self, store: KVStore, *, weights: str, compute_dtype: str, layout: KVLayout,
                 block_tokens: int):
        self.store = store
        self.weights = weights
        self.layout = layout
        self.block_tokens = block_tokens
        # The tiers' precision is part of every key: blocks of another precision never mix.
        self._identity = {"weights": weights, "compute_dtype": compute_dtype, "layout": layout,
                          "block_tokens": block_tokens, "kv_bits": (store.kv_bits[HOST], store.kv_bits[SSD])}
        self._spaces: dict[str, KeySpace] = {}
        self._lock = threading.Lock()
        self.counters: Counter = Counter()
        self.last_decision: dict | None = None  # restore or recompute: the inputs and the choice
        # What a restore costs beyond moving its bytes (looking up, assembling the batch
        # cache, a wait for the device), measured on restores from memory: a restore must
        # gain more than this. On an H200, 32 short chats' restores of the chat template's
        # ~30 shared tokens took 3-5 ms each on the engine thread, for a few milliseconds'
        # prefill that their batched start did anyway (bench/batch_steps.py).
        self.restore_call_s: float | None = None
        store.expect_layout(dtype=layout.dtype, k_dim=layout.k_head_dim, v_dim=layout.v_head_dim)
        store.expect_blocks(*block_payloads(layout, block_tokens, store))  # pinned ahead on CUDA

    @property
    def dir(self) -> str:
        """The SSD directory of every tenant of this model."""
        return model_dir(self.weights)

    def space(self, tenant: str) -> KeySpace:
        with self._lock:
            if tenant not in self._spaces:
                self._spaces[tenant] = key_space(tenant=tenant, **self._identity)
            return self._spaces[tenant]

    def lookup(self, tokens: Sequence[int], *, tenant: str = DEFAULT_TENANT) -> Lookup:
        """Returns the longest cached prefix of `tokens`, at most all but the last token."""
        space = self.space(tenant)
        limit, b = len(tokens) - 1, self.block_tokens
        hits: list[Hit] = []
        parent, start = space.root, 0
        while start + b <= limit:
            piece = tuple(tokens[start:start + b])
            key = space.block_key(parent, piece)
            tier = self.store.tier_of(key, space.dir)
            if tier is None:
                break
            hits.append(Hit(key, parent, piece, tier, b))
            parent, start = key, start + b
        tail = self._longest_child(parent, tuple(tokens[start:start + b]), space.dir, limit - start)
        if tail is not None:
            hits.append(tail)
        return Lookup(tuple(hits), tenant)

    def _longest_child(self, parent: bytes, rest: tuple[int, ...], dir: str, room: int) -> Hit | None:
        """Returns the stored block after `parent` sharing the longest token prefix with `rest`.

        KV of a block's first k tokens is valid whatever followed them, so a block saved
        by another turn (other question, other answer) still serves the shared part.
        """
        best: Hit | None = None
        for key, (stored, tier) in self.store.children(parent, dir).items():
            use = min(common_prefix(stored, rest), room)
            if use > 0 and (best is None or use > best.use_tokens):
                best = Hit(key, parent, stored, tier, use)
        return best

    def worth_restoring(self, lookup: Lookup, *, prefill_tok_s: float | None, count: bool = True) -> Lookup:
        """Returns the prefix of `lookup` whose restore beats recomputing it the most.

        Each block's restore time comes from its tier's measured bandwidth (an SSD
        block's times SSD_RISK), its recompute time from the model's measured prefill
        speed; the restore as a whole costs `restore_call_s` more. Unknown speed means
        restore all.
        """
        if not prefill_tok_s:
            if count:
                self.last_decision = {"prefill_tok_s": None, "hit_tokens": lookup.num_tokens,
                                      "restore_tokens": lookup.num_tokens, "why": "prefill speed not measured yet"}
            return lookup
        best, best_gain, gain = 0, 0.0, -(self.restore_call_s or 0.0)
        restore_by_tier: Counter = Counter()
        for n, hit in enumerate(lookup.hits, 1):
            restore_s = self.store.restore_s(hit.tier, hit.use_tokens * self.layout.bytes_per_token)
            restore_by_tier[hit.tier] += restore_s
            gain += hit.use_tokens / prefill_tok_s - restore_s * (SSD_RISK if hit.tier == SSD else 1.0)
            if gain > best_gain:
                best, best_gain = n, gain
        chosen = lookup.truncated(best)
        if count:
            if best < len(lookup.hits):
                self.counters["recompute_chosen"] += 1
            self.last_decision = {
                "prefill_tok_s": round(prefill_tok_s), "hit_tokens": lookup.num_tokens,
                "recompute_s": round(lookup.num_tokens / prefill_tok_s, 4),
                "restore_s_by_tier": {t: round(v, 4) for t, v in restore_by_tier.items()},
                "restore_gbps": {t: round(self.store.rates[t].bytes_per_s / 1e9, 3) for t in restore_by_tier},
                "ssd_risk": SSD_RISK, "restore_call_s": round(self.restore_call_s or 0.0, 4),
                "restore_tokens": chosen.num_tokens, "gain_s": round(best_gain, 4)}
        return chosen

    def restorable(self, tokens: Sequence[int], *, tenant: str = DEFAULT_TENANT,
                   prefill_tok_s: float | None, multiple: int = 1, count: bool = True) -> Lookup:
        """Returns the cached prefix of `tokens` whose restore beats recomputing it, a
        multiple of `multiple` tokens long (see Engine._restore)."""
        return self.worth_restoring(self.lookup(tokens, tenant=tenant).aligned(multiple),
                                    prefill_tok_s=prefill_tok_s, count=count)

    def prefetch(self, tokens: Sequence[int], *, tenant: str = DEFAULT_TENANT,
                 prefill_tok_s: float | None = None, multiple: int = 1,
                 started: Callable[[], None] | None = None) -> int:
        """Reads the SSD blocks worth restoring into host RAM; returns how many. `started`
        is called once their reads are under way (KVStore.prefetch), when there are any."""
        lookup = self.restorable(tokens, tenant=tenant, prefill_tok_s=prefill_tok_s, multiple=multiple,
                                 count=False)
        wanted = [(h.key, h.tokens) for h in lookup.hits if h.tier == SSD]
        return self.store.prefetch(wanted, dir=self.space(tenant).dir, started=started) if wanted else 0

    def restore(self, lookup: Lookup, *, prompt_tokens: int) -> Restored:
        """Returns a ready prompt cache holding the looked-up prefix (engine thread only)."""
        started = time.perf_counter()
        dir = self.space(lookup.tenant).dir
        blocks, tiers, used = [], Counter(), 0
        # Up to the first block lost or corrupt since the lookup: what precedes it is restored.
        fetched_all = self.store.fetch_all([(hit.key, hit.tokens) for hit in lookup.hits], dir=dir)
        for hit, fetched in zip(lookup.hits, fetched_all):
            blocks.append(fetched.block)
            tiers[fetched.tier] += hit.use_tokens
            used += hit.use_tokens
        self.counters["lookups"] += 1
        self.counters["prompt_tokens"] += prompt_tokens
        self.counters["hit_tokens"] += used
        self.counters["hits" if used else "misses"] += 1
        if not blocks:
            return Restored(None, 0, {})
        restored = Restored(build_batch_cache(blocks, used), used, dict(tiers))
        if set(tiers) == {MEMORY}:  # nothing crossed a link: what is left is the call's own cost
            moved_s = self.store.restore_s(MEMORY, used * self.layout.bytes_per_token)
            self.restore_call_s = moving_average(self.restore_call_s,
                                                 max(0.0, time.perf_counter() - started - moved_s))
        return restored

    def save(self, cache: list[KVCache], tokens: Sequence[int], *, tenant: str = DEFAULT_TENANT,
             skip_tokens: int = 0) -> int:
        """Stores the blocks of `tokens` that `cache` holds and the store lacks; returns how many."""
        return self.save_all([Saving(cache, tokens, tenant, skip_tokens)])

    def save_all(self, savings: Sequence[Saving]) -> int:
        """Stores the new blocks of several requests (those finishing in one step) with one
        wait for the device's copies, not one per request: on an H200 each wait cost a
        request 4-5 ms of the engine thread, so a wave of 32 short chats finishing together
        held the next decode step up by 0.13-0.17 s. Returns how many blocks it stored:
        none, and nothing cut, while every tier's budget is 0."""
        if not self.store.keeps_blocks:
            return 0
        blocks: list = []
        cut: set[bytes] = set()  # two requests may share blocks the store lacks: cut once

        for saving in savings:
            space = self.space(saving.tenant)
            cache = saving.cache
            tokens = list(saving.tokens)[: cache[0].offset] if cache and cache[0].keys is not None else []
            if not tokens:
                continue

            def known(key: bytes, dir: str = space.dir) -> bool:
                return key in cut or self.store.tier_of(key, dir) is not None

            new = cut_blocks(cache, tokens, space, skip_tokens=saving.skip_tokens, is_known=known, wait=False)
            cut.update(b.key for b in new)
            blocks += new
        if not blocks:
            return 0
        mx.eval([(b.keys, b.values) for b in blocks])
        self.store.save(blocks)
        self.counters["saved_blocks"] += len(blocks)
        return len(blocks)

    def stats(self) -> dict:
        c = self.counters
        prompt = c["prompt_tokens"]
        return {**dict(c), "hit_ratio": round(c["hit_tokens"] / prompt, 4) if prompt else None,
                "last_decision": self.last_decision,
                "block_tokens": self.block_tokens, "bytes_per_token": self.layout.bytes_per_token,
                "dir": self.dir}
