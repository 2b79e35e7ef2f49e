"""Fusing a layer's projections: the same outputs from fewer matmuls, on the real model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from appliance.models.fuse import Fused, Part, fuse_as_asked, fuse_projections

PROMPTS = mx.array([[1, 504, 2114, 314, 253, 1789, 30], [1, 7151, 28, 2799, 1182, 30, 2]])


@pytest.fixture
def model(model_dir: Path) -> nn.Module:
    """A fresh copy of the real model (fusing changes it)."""
    return mlx_lm.load(str(model_dir))[0]


def logits(model: nn.Module) -> mx.array:
    return model(PROMPTS)


def greedy(model: nn.Module, tokens: int = 12) -> list[int]:
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(PROMPTS[0], model, max_tokens=tokens)]


def fused_groups(model: nn.Module) -> list[Fused]:
    return list({id(p.fused): p.fused for _, m in model.named_modules() for p in vars(m).values()
                 if isinstance(p, Part)}.values())


def test_a_fused_model_computes_what_it_did(model):
    before, tokens = logits(model), greedy(model)
    layers = len(model.model.layers)
    assert fuse_projections(model) == 2 * layers  # q/k/v and gate/up in every layer
    assert mx.allclose(logits(model), before, atol=1e-4).item()
    assert greedy(model) == tokens


def test_a_quantized_model_fuses_too(model):
    nn.quantize(model, group_size=64, bits=4)
    before = logits(model)
    assert fuse_projections(model) > 0
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, nn.QuantizedLinear)
    assert mx.allclose(logits(model), before, atol=1e-4).item()


def test_each_weight_is_held_once(model):
    def params(m: nn.Module) -> dict[str, mx.array]:
        return dict(tree_flatten(m.parameters()))

    before = params(model)
    fuse_projections(model)
    after = params(model)
    assert sum(a.nbytes for a in after.values()) == sum(a.nbytes for a in before.values())
    assert "model.layers.0.self_attn.qkv_proj.weight" in after
    assert "model.layers.0.mlp.gate_up_proj.weight" in after
    assert not any(k.endswith((".q_proj.weight", ".up_proj.weight")) for k in after)


def test_unlike_projections_stay_apart(model):
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: path.endswith("q_proj"))
    before = logits(model)
    layers = len(model.model.layers)
    assert fuse_projections(model) == layers  # gate/up only: q is quantized, k and v are not
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, nn.QuantizedLinear) and "qkv_proj" not in attention
    assert mx.allclose(logits(model), before, atol=1e-4).item()


def test_a_group_holds_nothing_once_each_part_has_its_output(model):
    fuse_projections(model)
    mx.eval(logits(model))
    groups = fused_groups(model)
    assert groups and all(g._input is None and g._outputs == [] for g in groups)


def test_fusing_again_fuses_nothing_more(model):
    first = fuse_projections(model)
    before = logits(model)
    assert first > 0 and fuse_projections(model) == 0
    assert mx.array_equal(logits(model), before).item()


def test_auto_fuses_on_cuda_only(model):
    assert fuse_as_asked(model, "off") == 0 and "qkv_proj" not in model.model.layers[0].self_attn
    assert fuse_as_asked(model, "on") > 0


def test_a_bfloat16_model_with_a_kv_cache_fuses_to_the_same_logits(generated_llama):
    """A generated Llama-shaped model in bfloat16 (as GPUs run it), a prompt then two
    decode steps through a KV cache: the parts' outputs are views of the fused one, which
    the keys and values go into the cache from (run on a GPU by bench/gpu_run.sh kernels)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = generated_llama(2, seed=3)

    def run() -> list[mx.array]:
        cache = make_prompt_cache(model)
        out = [model(PROMPTS[:, :5] % 512, cache=cache)]
        for token in (7, 11):
            out.append(model(mx.array([[token], [token + 1]]), cache=cache))
        return [o.astype(mx.float32) for o in out]

    before = run()
    assert fuse_projections(model) == 4
    for a, b in zip(before, run(), strict=True):
        assert mx.allclose(a, b, rtol=2e-2, atol=2e-2).item(), mx.abs(a - b).max().item()
