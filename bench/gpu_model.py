"""Random-weight models of a named shape, generated where they run (never carried).

A seeded mlx-lm Llama of a known shape (e.g. Llama-3-8B: 32 layers, hidden 4096, 32
query / 8 KV heads, FFN 14336) with the SmolLM2 tokenizer's vocabulary (49152), built
layer by layer so peak memory stays at the weights. Random weights are fine for speed:
the work per token does not depend on the values.

    python bench/gpu_model.py --shape 8b --out /tmp/llama-8b [--tokenizer DIR]
    python bench/gpu_model.py --shape 70b --bits 4 --out /tmp/llama-70b-4bit [--tokenizer DIR]
    python bench/gpu_model.py --shape 1b --dtype float32 --out /tmp/llama-1b-float32

With --bits 4 or 8 the weights are quantized as mlx-lm's convert does (affine, group size
64, Linear and Embedding layers, `quantization` in config.json) and saved as safetensors
shards of at most 5 GB with model.safetensors.index.json, so mlx_lm.utils.load reads the
directory. The model is a lazy graph until evaluated, and it is evaluated one module (a
decoder layer, the embedding, the lm_head) at a time: only that module's float weights
ever exist, next to the quantized ones made so far. A bf16 70B model (140 GB) never does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

SHAPES = {
    # name: (layers, hidden, query heads, KV heads, FFN)
    "70b": (80, 8192, 64, 8, 28672),
    "8b": (32, 4096, 32, 8, 14336),
    "1b": (16, 2048, 32, 8, 8192),
    "tiny": (2, 256, 4, 2, 512),  # for a CPU dry run of the bench scripts
}
VOCAB = 49152  # SmolLM2's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
GROUP_SIZE = 64  # mlx-lm's default for affine quantization


def config(shape: str, *, context_tokens: int = 32768) -> dict:
    """Returns the HF-style config.json of a Llama of `shape`."""
    layers, hidden, heads, kv_heads, ffn = SHAPES[shape]
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": ffn,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": context_tokens,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def generate(shape: str, *, seed: int = 0, dtype: str = "bfloat16", bits: int | None = None):
    """Returns (model, config) of `shape` with seeded random weights, evaluated layer by layer.

    With `bits` (4 or 8) the Linear and Embedding layers are quantized the way mlx-lm's
    `quantize_model` does it (affine, group size 64) and `config` carries `quantization`.
    The float weights are those of the unquantized model of the same seed, cast to `dtype`.
    """
    import mlx.core as mx
    from mlx_lm.models import llama

    cfg = config(shape)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    target = getattr(mx, dtype)
    # Parameters are lazy until evaluated: cast (and quantize) the whole graph, then evaluate
    # one module at a time, so that only one module's float32 originals exist at once.
    model.set_dtype(target)
    if bits is not None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {bits}")
        from mlx_lm.utils import quantize_model

        model, cfg = quantize_model(model, cfg, GROUP_SIZE, bits)
    for module in [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]:
        mx.eval(module.parameters())
    return model, cfg


def save(model, cfg: dict, out: Path, *, tokenizer_dir: Path | None) -> Path:
    """Writes `model` as an MLX model directory (config.json, weights, tokenizer).

    A float model goes into one model.safetensors; a quantized one (`quantization` in `cfg`)
    into mlx-lm's shards (≤ 5 GB each) with model.safetensors.index.json, as convert writes.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # mlx-lm loads every model*.safetensors it finds
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if "quantization" in cfg:
        from mlx_lm.utils import save_model

        save_model(out, model)
    else:
        mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                            metadata={"format": "mlx"})
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, out / name)
    return out


def sizes(shape: str, *, bits: int | None, float_bytes: int = 2) -> dict:
    """Returns the bytes of the largest module's float32 weights (a decoder layer, or the
    embedding), of the float model in `float_bytes` per weight, and of the model as
    generated (quantized when `bits`)."""
    layers, hidden, heads, kv_heads, ffn = SHAPES[shape]
    head_dim = hidden // heads
    layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * ffn
    matrices = layers * layer + 2 * VOCAB * hidden  # + embedding and lm_head
    norms = (2 * layers + 1) * hidden
    # affine: `bits` per weight plus a float scale and bias per group of GROUP_SIZE
    per_weight = float_bytes if bits is None else bits / 8 + 2 * float_bytes / GROUP_SIZE
    return {"module_float32": 4 * max(layer + 2 * hidden, VOCAB * hidden),
            "float_model": float_bytes * (matrices + norms),
            "model": int(per_weight * matrices) + float_bytes * norms}


def random_blocks(shape: str, tokens: int, block_tokens: int = 512) -> list:
    """Returns `tokens` tokens of memory-tier KV blocks of `shape` (cache/kv.KVBlock, bf16,
    random values, evaluated), as a prompt's restore finds them."""
    import mlx.core as mx

    from appliance.cache.kv import KVBlock

    layers, hidden, heads, kv_heads, _ = SHAPES[shape]
    dim = hidden // heads
    sizes = [block_tokens] * (tokens // block_tokens) + ([tokens % block_tokens] if tokens % block_tokens else [])
    mx.random.seed(0)
    blocks = []
    for i, n in enumerate(sizes):
        k, v = (mx.random.normal((layers, kv_heads, n, dim)).astype(mx.bfloat16) for _ in range(2))
        mx.eval(k, v)
        blocks.append(KVBlock(i.to_bytes(8, "little") + b"k" * 24, b"r" * 32, "bench", tuple(range(n)), k, v))
    return blocks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=None,
                        help="quantize (affine, group size 64) as mlx-lm's convert does; default: bf16")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="of the float weights (float32: what a GGUF source converts to on a GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a dir holding tokenizer.json etc.")
    args = parser.parse_args()
    import mlx.core as mx

    if mx.default_device() == mx.gpu:  # managed memory: never let MLX ask for more than the card has
        mx.set_memory_limit(100 << 30)
    gb = 1 << 30
    expect = sizes(args.shape, bits=args.bits)
    kind = f"{args.bits}-bit" if args.bits else args.dtype
    print(f"{args.shape} {kind}: expect {expect['model'] / gb:.2f} GiB of weights "
          f"(bf16 model {expect['float_model'] / gb:.2f} GiB; largest module in float32 "
          f"{expect['module_float32'] / gb:.2f} GiB)", flush=True)
    mx.reset_peak_memory()
    started = time.perf_counter()
    model, cfg = generate(args.shape, seed=args.seed, dtype=args.dtype, bits=args.bits)
    built = time.perf_counter()
    generated_peak = mx.get_peak_memory()
    save(model, cfg, args.out, tokenizer_dir=args.tokenizer)
    on_disk = sum(f.stat().st_size for f in args.out.glob("model*.safetensors"))
    print(f"{args.shape} {kind}: generated in {built - started:.1f} s "
          f"(peak {generated_peak / gb:.2f} GiB), saved to {args.out} in "
          f"{time.perf_counter() - built:.1f} s ({on_disk / gb:.2f} GiB; peak "
          f"{mx.get_peak_memory() / gb:.2f} GiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
