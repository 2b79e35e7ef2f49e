"""Random-weight models of a named shape, generated where they run (never carried).

A seeded mlx-lm Llama of a known shape (e.g. Llama-3-8B: 32 layers, hidden 4096, 32
query / 8 KV heads, FFN 14336) with the SmolLM2 tokenizer's vocabulary (49152), built
layer by layer so peak memory stays at the weights. Random weights are fine for speed:
the work per token does not depend on the values.

    python bench/gpu_model.py --shape 8b --out /tmp/llama-8b [--tokenizer DIR]
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
    "8b": (32, 4096, 32, 8, 14336),
    "1b": (16, 2048, 32, 8, 8192),
    "tiny": (2, 256, 4, 2, 512),  # for a CPU dry run of the bench scripts
}
VOCAB = 49152  # SmolLM2's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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


def generate(shape: str, *, seed: int = 0, dtype: str = "bfloat16"):
    """Returns (model, config) of `shape` with seeded random weights, evaluated layer by layer."""
    import mlx.core as mx
    from mlx_lm.models import llama

    cfg = config(shape)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    target = getattr(mx, dtype)
    # Parameters are lazy until evaluated: cast and evaluate one module at a time, so the
    # float32 originals of the whole model never exist at once.
    for module in [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]:
        module.set_dtype(target)
        mx.eval(module.parameters())
    return model, cfg


def save(model, cfg: dict, out: Path, *, tokenizer_dir: Path | None) -> Path:
    """Writes `model` as an MLX model directory (config.json, model.safetensors, tokenizer)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, out / name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a dir holding tokenizer.json etc.")
    args = parser.parse_args()
    import mlx.core as mx

    if mx.default_device() == mx.gpu:  # managed memory: never let MLX ask for more than the card has
        mx.set_memory_limit(100 << 30)
    started = time.perf_counter()
    model, cfg = generate(args.shape, seed=args.seed)
    built = time.perf_counter()
    save(model, cfg, args.out, tokenizer_dir=args.tokenizer)
    print(f"{args.shape}: generated in {built - started:.1f} s, saved to {args.out} in "
          f"{time.perf_counter() - built:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
