"""KV blocks as MLX arrays: cut from a request's cache, rebuilt into one, and turned into
bytes blocks (block.Block) and back.

A block holds `block_tokens` tokens (or fewer, for a prompt's tail) of every layer's keys
and values, stacked as [layers, kv_heads, tokens, head_dim]: one contiguous array each,
so a block is two evaluated copies that never pin the live cache's buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from appliance.cache.block import Block
from appliance.cache.keys import KeySpace, KVLayout
from appliance.engine.mlxlm_seam import BatchCache, set_size
from appliance.kernels.gate import GATE
from appliance.kernels.kv_quant import pack, unpack
from appliance.platform import on_cuda

CUT_RUN_BLOCKS = 8  # blocks cut_blocks stacks at once: its scratch copy is this many blocks
GATHER_BYTES = 1 << 30  # on CUDA, the most of a prefix's keys (or values) build_batch_cache gathers at once


@dataclass(frozen=True)
class KVBlock:
    """A KV block as MLX arrays: what the memory tier holds and a restore concatenates
    (block.Block is the same block as bytes)."""

    key: bytes
    parent: bytes  # the key space's root for the first block
    dir: str  # where its file lives on the SSD (KeySpace.dir)
    tokens: tuple[int, ...]
    keys: mx.array  # [layers, kv_heads, tokens, k_head_dim]
    values: mx.array  # [layers, kv_heads, tokens, v_head_dim]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def probe_layout(model: nn.Module) -> KVLayout | None:
    """Returns the model's KV layout, or None when its caches are not plain, uniform KVCaches.

    Sliding-window (rotating), quantized and recurrent caches cannot be cut into
    position-independent blocks, so such models bypass the cache instead of risking
    wrong output.
    """
    caches = make_prompt_cache(model)
    if not caches or any(type(c) is not KVCache for c in caches):
        return None
    with GATE.shared():  # a model call, as an engine's step (kernels/gate.py)
        model(mx.array([[0]]), cache=caches)
        mx.eval([c.state for c in caches])
    shapes = {(c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype) for c in caches}
    if len(shapes) != 1:
        return None
    heads, dk, dv, dtype = shapes.pop()
    return KVLayout(num_layers=len(caches), kv_heads=heads, k_head_dim=dk, v_head_dim=dv,
                    dtype=str(dtype).removeprefix("mlx.core."), itemsize=dtype.size)


def cut_blocks(cache: list[KVCache], tokens: list[int], space: KeySpace, *, skip_tokens: int,
               is_known: Callable[[bytes], bool], wait: bool = True) -> list[KVBlock]:
    """Returns copies of the blocks of `tokens` held in `cache` (batch of one), evaluated
    unless `wait` is false (the caller then evaluates them, with others).

    Full blocks and the final partial block are cut from `skip_tokens` on; blocks whose
    key `is_known` are not copied again. Runs of up to CUT_RUN_BLOCKS adjacent blocks are
    stacked across layers in one copy and then split, one copy per block: on a GPU each
    copy is a kernel launch, and per block and layer a 25K-token 8B prompt took 3,136 of
    them (29-31 ms on an H200, between decode steps).
    """
    b = space.block_tokens
    parent = space.root
    wanted: list[tuple[int, bytes, bytes, tuple[int, ...]]] = []  # start, key, parent, tokens
    for start in range(0, len(tokens), b):
        piece = tokens[start:start + b]
        key = space.block_key(parent, piece)
        if start + len(piece) > skip_tokens and not is_known(key):
            wanted.append((start, key, parent, tuple(piece)))
        parent = key
    blocks: list[KVBlock] = []
    for run in _runs(wanted, b):
        first, end = run[0][0], run[-1][0] + len(run[-1][3])
        keys = mx.stack([c.keys[0, :, first:end, :] for c in cache])
        values = mx.stack([c.values[0, :, first:end, :] for c in cache])
        for start, key, parent, piece in run:
            at = slice(start - first, start - first + len(piece))
            blocks.append(KVBlock(key, parent, space.dir, piece, mx.contiguous(keys[:, :, at]),
                                  mx.contiguous(values[:, :, at])))
    if wait:
        mx.eval([(blk.keys, blk.values) for blk in blocks])
    return blocks


def _runs(wanted: list[tuple], block_tokens: int) -> list[list[tuple]]:
    """Splits blocks (start first) into runs of adjacent ones, at most CUT_RUN_BLOCKS each."""
    runs: list[list[tuple]] = []
    for item in wanted:
        if runs and len(runs[-1]) < CUT_RUN_BLOCKS and runs[-1][-1][0] + block_tokens == item[0]:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def build_batch_cache(blocks: list[KVBlock], num_tokens: int, *,
                      gather_bytes: int | None = None) -> list[BatchKVCache]:
    """Returns the first `num_tokens` tokens of `blocks` as the engine's batch-of-one cache,
    one BatchKVCache per layer.

    Each layer's keys and values end in a buffer of their own with a step of free room,
    so neither mlx-lm's merge nor the first decode steps copy them again: every copy of a
    restored prefix is fresh memory, and page faults, not bandwidth, bound how fast a
    large prefix comes back.

    Off CUDA (`gather_bytes` 0) each layer is one concatenation of its slices of every
    block and its room. On CUDA MLX launches one copy kernel per concatenated array:
    3,968 for a 31K-token prefix of an 8B model (61 blocks, 32 layers, keys and values)
    that holds only 4 GB. So there (`gather_bytes`, default GATHER_BYTES) runs of layers
    holding at most `gather_bytes` are first gathered from every block at once, then each
    layer is copied out with its room: the bytes copied twice, in ~370 launches, holding
    at most `gather_bytes` more for a while.
    """
    layers, heads = blocks[0].keys.shape[:2]
    room = -num_tokens % BatchKVCache.step or BatchKVCache.step
    if gather_bytes is None:
        gather_bytes = GATHER_BYTES if on_cuda() else 0

    def by_layer(arrays: list[mx.array]) -> list[mx.array]:
        parts, left = [], num_tokens
        for a in arrays:
            parts.append(a[:, :, :left] if left < a.shape[2] else a)
            left -= a.shape[2]
            if left <= 0:
                break
        pad = mx.broadcast_to(mx.zeros((), dtype=arrays[0].dtype), (1, heads, room, arrays[0].shape[3]))
        if not gather_bytes:
            # each block split into its layers in one call, not sliced once a layer: a 31K
            # prompt of an 8B model is 61 blocks of 32 layers (54 -> 37 ms of ops on a CPU)
            split = [mx.split(p, layers, axis=0) for p in parts]
            return [mx.concatenate([*(s[layer] for s in split), pad], axis=2) for layer in range(layers)]
        layer_size = sum(p.size for p in parts) // layers
        # at most gather_bytes, and under 2**31 elements: MLX CUDA's copies index with int32
        # (a 70B prefix's 80 layers gathered at once came back wrong)
        run = max(1, min(layers, gather_bytes // max(1, layer_size * parts[0].itemsize), (2**31 - 1) // layer_size))
        out: list[mx.array] = []
        for first in range(0, layers, run):
            gathered = mx.concatenate([p[first:first + run] for p in parts], axis=2)
            out += [mx.concatenate([g, pad], axis=2) for g in mx.split(gathered, gathered.shape[0], axis=0)]
            if first + run < layers:
                mx.eval(out[first:])  # frees this run's gathered copy before the next is made
        return out

    caches = []
    for keys, values in zip(by_layer([b.keys for b in blocks]), by_layer([b.values for b in blocks]), strict=True):
        c = BatchCache(left_padding=[0])
        c.keys, c.values = keys, values
        c.offset = mx.array([num_tokens])
        set_size(c, num_tokens)
        caches.append(c)
    mx.eval([(c.keys, c.values, c.offset) for c in caches])
    return caches


def to_bytes(blocks: list[KVBlock], *, bits: int = 16) -> list[Block]:
    """Returns `blocks` as bytes at `bits` bits (16: as computed; 8, 4: quantized,
    kernels/kv_quant.py), each payload one uint8 array made by MLX, all evaluated in one
    wait.

    The copy is made by MLX (on a GPU: by the device), and the payload is that array
    itself: its bytes reach the host when they are first read through the buffer
    protocol, by whoever writes them out. So the engine thread never waits for them to
    cross (on an H200 that took ~2 s for a 25K-token prompt's blocks, stalling
    decoding). On MLX CUDA even taking a memoryview of a device array moves it to
    managed memory (a cudaMallocManaged and a synchronous copy, MLX's
    `Buffer::raw_ptr`): done here, that cost the engine thread ~2 ms a block on an H200
    (`store.to_bytes` in bench/batch_steps.py).
    """
    packed = [pack(b.keys, b.values, bits) for b in blocks]
    mx.eval([payload for payload, _ in packed])
    return [Block(b.key, b.parent, b.dir, b.tokens, meta, payload)
            for b, (payload, meta) in zip(blocks, packed)]


def from_bytes(block: Block, *, wait: bool = True) -> KVBlock:
    """Returns the block as MLX arrays in the dtype they were computed in (dequantized when
    stored at 8 or 4 bits; evaluated unless `wait` is false); raises ValueError when its payload does not fit its meta
    (KeyError, AttributeError when the meta is not one `to_bytes` wrote)."""
    raw = mx.array(np.frombuffer(block.payload, dtype=np.uint8))  # a copy: the buffer may be reused
    keys, values = unpack(raw, block.meta)
    if keys.shape[2] != len(block.tokens) or values.shape[2] != len(block.tokens):
        raise ValueError("payload shape does not match the block's tokens")
    if wait:
        mx.eval(keys, values)
    return KVBlock(block.key, block.parent, block.dir, block.tokens, keys, values)
