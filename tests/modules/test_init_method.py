"""init_method / output_layer_init_method (TransformerEngine's arguments) of the layers."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

import graphfp8 as g8


def _fill(value: float):
    return lambda w: w.fill_(value)


def test_layers_take_init_methods():
    lin = g8.Linear(32, 16, init_method=_fill(0.5))
    assert bool((lin.weight == 0.5).all()) and bool((lin.bias == 0).all())
    ln = g8.LayerNormLinear(32, 16, init_method=_fill(0.25))
    assert bool((ln.weight == 0.25).all()) and bool((ln.bias == 0).all())
    assert bool((ln.layer_norm_weight == 1).all()), "norm weights keep their init"
    mlp = g8.LayerNormMLP(32, 64, init_method=_fill(1.0), output_layer_init_method=_fill(2.0))
    assert bool((mlp.fc1_weight == 1).all()) and bool((mlp.fc2_weight == 2).all())
    assert bool((mlp.fc1_bias == 0).all()) and bool((mlp.fc2_bias == 0).all())
    layer = g8.TransformerLayer(32, 2, 64, max_seq_len=8, init_method=_fill(3.0),
                                output_layer_init_method=_fill(4.0))  # fmt: skip
    assert bool((layer.qkv.weight == 3).all()) and bool((layer.mlp.fc1_weight == 3).all())
    assert bool((layer.proj.weight == 4).all()) and bool((layer.mlp.fc2_weight == 4).all())
    only_one = g8.TransformerLayer(32, 2, 64, max_seq_len=8, init_method=_fill(5.0))
    assert bool((only_one.proj.weight == 5).all()), "output layers default to init_method"


def test_default_is_torch_linear_init_and_rng_order():
    torch.manual_seed(3)
    ours = g8.Linear(48, 32)
    torch.manual_seed(3)
    ref = nn.Linear(48, 32)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)


def test_fp8_primary_weights_are_quantized_after_init():
    with g8.fp8_model_init():
        lin = g8.Linear(32, 16, init_method=partial(nn.init.normal_, std=0.02))
    assert isinstance(lin.weight, g8.Float8Tensor)
    deq = lin.weight.dequantize().float()
    assert 0.01 < float(deq.std()) < 0.03, "the FP8 weight holds the normal(0, 0.02) values"
