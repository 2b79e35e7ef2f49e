"""How many tokens one prefill call may process: bounded by the memory MLX may still take,
whatever `prefill_chunk_tokens` says.

A call over N new tokens at a context of C tokens needs, beyond the weights and the KV
it adds: per token, the logits and the layer's activations (MLP, attention projections),
and, when its attention runs unfused (any array mask: mlx-lm's padded batches), the
scores of one layer at a time, heads x C x 4 bytes per token. Measured on an H200 with
an 8B model (BENCHMARKS.md, "GPU"): a 16,384-token call at a 9K context peaks 14.5 GB
above the weights; 32 query heads at a 25K context make 3.3 MB of scores per token, so
mlx-lm's batch path asking for 32K tokens in one call wanted ≈ 100 GB and failed.

The generation batch is bounded too (`batch_fits`): mlx-lm's batch cache pads every row
to the longest, so one 32K-token request decoding beside 31 short ones holds 32 x 32K
tokens of KV (137 GB for an 8B model), and merging a row into it copies the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from appliance.models.memory import free_bytes
from appliance.platform import device_kind

SAFETY = 1.5  # measured peaks over the per-token estimate below (8B: 0.54 vs 0.36 MB/token)
RESERVE_FRACTION = 0.2  # of the free memory, kept for decode steps, restores and the allocator
MIN_CALL_TOKENS = 16


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn: int
    heads: int
    vocab: int
    kv_bytes_per_token: int  # all layers' keys and values
    itemsize: int = 2

    @property
    def token_bytes(self) -> int:
        """Returns the transient bytes one prefill token needs (logits, activations, new KV)."""
        return int(SAFETY * (self.vocab * 4 + (3 * self.ffn + 6 * self.hidden) * self.itemsize
                             + self.kv_bytes_per_token))

    def score_bytes(self, context_tokens: int) -> int:
        """Returns the bytes of one layer's materialized attention scores, per query token."""
        return self.heads * context_tokens * 4


def model_shape(model: nn.Module) -> ModelShape | None:
    """Returns the shape mlx-lm's model arguments declare, or None when they don't say."""
    args = getattr(model, "args", None)
    try:
        hidden, heads = int(args.hidden_size), int(args.num_attention_heads)
        layers = int(args.num_hidden_layers)
        kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(args, "head_dim", None) or hidden // heads)
        ffn, vocab = int(args.intermediate_size), int(args.vocab_size)
    except (AttributeError, TypeError, ValueError):
        return None
    itemsize = 4 if device_kind() == "cpu" else 2  # float32 on CPUs (resolve_dtype), else bf16/fp16
    return ModelShape(hidden=hidden, ffn=ffn, heads=heads, vocab=vocab, itemsize=itemsize,
                      kv_bytes_per_token=2 * layers * kv_heads * head_dim * itemsize)


def max_call_tokens(shape: ModelShape | None, *, context_tokens: int, rows: int = 1, fused: bool = True,
                    free: int | None = None) -> int | None:
    """Returns the most new tokens (all rows together) one prefill call may take at
    `context_tokens`, or None when nothing bounds it (shape or free memory unknown)."""
    free = free_bytes() if free is None else free
    if shape is None or free is None:
        return None
    room = free * (1 - RESERVE_FRACTION) - rows * context_tokens * shape.kv_bytes_per_token  # a grown copy
    per_token = shape.token_bytes + (0 if fused else shape.score_bytes(context_tokens))
    return max(MIN_CALL_TOKENS, int(room // per_token))


def batch_fits(shape: ModelShape | None, *, rows: int, tokens: int, free: int | None) -> bool:
    """Returns whether a generation batch of `rows` rows padded to `tokens` tokens fits in
    the memory MLX may still take (its merge makes a new copy of the whole batch); true
    when the shape or the free memory is unknown."""
    if shape is None or free is None:
        return True
    return rows * tokens * shape.kv_bytes_per_token <= free * (1 - RESERVE_FRACTION)
