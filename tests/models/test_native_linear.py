"""Linear layers that run few-row calls through our kernel: the same layers otherwise,
on the real model; on an NVIDIA GPU, the same logits through a KV cache with the kernel on
(`bench/gpu_run.sh kernels` runs them there)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from appliance.kernels import small_matmul
from appliance.kernels.registry import backend
from appliance.models.fuse import fuse_projections
from appliance.models.native_linear import NativeLinear, native_linear_here, use_native_linear

PROMPTS = mx.array([[1, 504, 2114, 314, 253, 1789, 30], [1, 7151, 28, 2799, 1182, 30, 2]])


@pytest.fixture
def model(model_dir: Path) -> nn.Module:
    """A fresh copy of the real model in bfloat16 (the kernel's dtype)."""
    model = mlx_lm.load(str(model_dir))[0]
    model.set_dtype(mx.bfloat16)
    return model


@pytest.fixture
def enabled():
    small_matmul.ENABLED = True
    yield
    small_matmul.ENABLED = False


def native_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, NativeLinear)]


def test_every_linear_layer_of_the_model_becomes_native_with_its_parameters(model):
    before = dict(tree_flatten(model.parameters()))
    layers = len(model.model.layers)
    assert use_native_linear(model) == 7 * layers  # q, k, v, o, gate, up, down; the head is the embedding's
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert use_native_linear(model) == 0  # once


def test_fused_projections_become_native_too(model):
    fuse_projections(model)
    assert use_native_linear(model) == 4 * len(model.model.layers)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, NativeLinear)


def test_while_the_kernel_is_off_a_native_layer_computes_what_linear_does(model):
    before = model(PROMPTS)
    use_native_linear(model)
    assert not small_matmul.ENABLED
    assert mx.array_equal(model(PROMPTS), before).item()


def test_calls_the_kernel_does_not_take_run_as_linear_does(model, enabled, monkeypatch):
    """One row, more than ROWS rows, or rows in another dtype than the weight (which MLX
    promotes) never reach the kernel, even while it is on."""
    layer = model.model.layers[0].mlp.up_proj
    use_native_linear(model)
    taken = []
    monkeypatch.setattr(small_matmul, "matmul", lambda x, w: taken.append(x.shape) or x @ w.T)
    k = layer.weight.shape[1]
    for x in (mx.ones((1, 1, k), dtype=mx.bfloat16), mx.ones((1, small_matmul.ROWS + 1, k), dtype=mx.bfloat16),
              mx.ones((1, 4, k), dtype=mx.float32)):
        assert mx.array_equal(layer(x), x @ layer.weight.T).item()
    assert taken == []
    layer(mx.ones((1, 4, k), dtype=mx.bfloat16))
    assert taken == [(1, 4, k)]


def test_layers_the_kernel_cannot_take_stay_as_they_are(model):
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: path.endswith("q_proj"))
    model.model.layers[0].mlp.down_proj.set_dtype(mx.float32)
    use_native_linear(model)
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.QuantizedLinear
    assert type(layer.mlp.down_proj) is nn.Linear
    assert type(layer.mlp.up_proj) is NativeLinear


@pytest.mark.skipif(backend() == "cuda", reason="CUDA has the kernel")
def test_where_the_backend_has_no_kernel_nothing_changes(model):
    assert native_linear_here(model) == 0 and not native_layers(model)


@pytest.mark.skipif(backend() != "cuda", reason=f"small_matmul runs on CUDA; this backend is {backend()}")
def test_on_cuda_a_model_with_a_kv_cache_computes_the_same_logits_natively(enabled, generated_llama):
    """A generated Llama-shaped model in bfloat16 (the real one is not carried to the GPU
    machine), projections fused: a prompt (14 rows) then decode steps of 2 rows through a
    KV cache, each call's matmuls run by the kernel."""
    from mlx_lm.models.cache import make_prompt_cache

    model = generated_llama(4, seed=5)

    def run() -> list[mx.array]:
        cache = make_prompt_cache(model)
        out = [model(PROMPTS % 512, cache=cache)]
        for token in (7, 11, 13):
            out.append(model(mx.array([[token], [token + 1]]), cache=cache))
        return [o.astype(mx.float32) for o in out]

    small_matmul.ENABLED = False
    before = run()
    fuse_projections(model)
    assert native_linear_here(model) == 4 * 4  # the fused, o and down projections (the head is tied)
    small_matmul.ENABLED = True
    for a, b in zip(before, run(), strict=True):
        assert mx.allclose(a, b, rtol=2e-2, atol=2e-2).item(), mx.abs(a - b).max().item()
