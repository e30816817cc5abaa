"""graphfp8 layers under torch FSDP2 (fully_shard, gloo): FP8 primary weights stay FP8 shards
(they became plain fp32 parameters before fp8/tensor_fsdp.py), are all-gathered as FP8 bytes into
the gathered buffer itself, and train through MasterWeights equal to one process bit for bit, as
high-precision layers do; masters of a model whose FP8 weight was replaced by a high-precision copy
refuse it; graph capture of an FSDP2 model refuses, naming MasterWeights(shard_group=...)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import graphfp8 as g8
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.testing import assert_bitwise_equal
from tests.rank_pool import run_on_ranks

H, FFN, T = 32, 64, 48  # every shard a multiple of 16 elements at 2 ranks (AdamW's vector loop)
RECIPE = g8.DelayedScaling(amax_history_len=4)


def _pair(fp8_weights: bool, world: int):
    """(one-process model, the same model under fully_shard)."""
    torch.manual_seed(0)
    with g8.fp8_model_init(enabled=fp8_weights):
        ref = g8.LayerNormMLP(H, FFN, params_dtype=torch.float32)
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return ref, model


def _rows(t: torch.Tensor, rank: int, world: int) -> slice:
    per = -(-t.shape[0] // world)
    return slice(rank * per, min(t.shape[0], (rank + 1) * per))


def _compare(ref, model, rank: int, world: int, what: str) -> None:
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        local = q._local_tensor
        if isinstance(p, Float8Tensor):
            mine = p._data.view(torch.uint8)[_rows(p, rank, world)]
            assert_bitwise_equal(local._data.view(torch.uint8), mine, f"{what}: {name} data")
            assert_bitwise_equal(local._scale_inv, p._scale_inv, f"{what}: {name} scale_inv")
        else:
            assert_bitwise_equal(q.full_tensor(), p.detach(), f"{what}: {name}")


def _shards_stay_fp8(rank, device):
    world = dist.get_world_size()
    ref, model = _pair(True, world)
    for name, q in model.named_parameters():
        if "fc" in name and name.endswith("weight"):
            local = q._local_tensor
            assert isinstance(local, Float8Tensor), f"{name}: {type(local).__name__} {q.dtype}"
            assert local.fp8_dtype == torch.float8_e4m3fn and local.dtype == torch.float32
    _compare(ref, model, rank, world, "sharded")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    with g8.fp8_autocast(recipe=RECIPE):
        assert_bitwise_equal(model(x, is_first_microbatch=True), ref(x, is_first_microbatch=True),
                             "forward")  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_keeps_fp8_weights_fp8(world):
    """3 ranks: fc2's 32 rows in shards of 11, 11 and 10 (the last padded)."""
    run_on_ranks("gloo", _shards_stay_fp8, world=world)


def _fp8_all_gather(rank, device):
    _, model = _pair(True, 2)
    model.unshard()
    for param in model._get_fsdp_state()._fsdp_param_group.fsdp_params:
        if not isinstance(param.sharded_param._local_tensor, Float8Tensor):
            continue
        gathered = param.all_gather_outputs[0]
        assert gathered.dtype == torch.uint8  # what went over the wire
        weight = getattr(model, param._module_info.param_name)
        assert isinstance(weight, Float8Tensor) and weight.shape == param._orig_size
        assert weight._data.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()
    model.reshard()


def test_the_all_gather_moves_fp8_bytes_into_the_weight():
    run_on_ranks("gloo", _fp8_all_gather)


def _training_equals_one_process(rank, device, fp8_weights):
    ref, model = _pair(fp8_weights, 2)
    params = {}
    for key, m in (("ref", ref), ("fsdp", model)):
        masters = g8.MasterWeights(m) if fp8_weights else None
        params[key] = (masters, masters.parameters() if masters else list(m.parameters()))
    assert fp8_weights == (type(params["fsdp"][0]).__name__ == "FSDPMasterWeights")
    opts = {k: torch.optim.AdamW(p, lr=1e-2, foreach=False) for k, (_, p) in params.items()}
    for step in range(3):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(step)) * 2.0**step
        for key, m in (("ref", ref), ("fsdp", model)):
            with g8.fp8_autocast(recipe=RECIPE):
                y = m(x, is_first_microbatch=True)
            y.float().square().mean().backward()
            masters = params[key][0]
            if masters is not None:
                masters.step(opts[key])
                masters.zero_grad()
            else:
                opts[key].step()
                opts[key].zero_grad()
        _compare(ref, model, rank, 2, f"step {step}")


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_fp8_training_under_fully_shard_equals_one_process(fp8_weights):
    """The same data on both ranks: FSDP2's average of 2 equal gradients is exact."""
    run_on_ranks("gloo", _training_equals_one_process, fp8_weights)


def _misuse(rank, device):
    ref, model = _pair(True, 2)
    with pytest.raises(RuntimeError, match=r"MasterWeights\(model, shard_group=...\)"):
        g8.make_graphed_callables(model, (torch.randn(T, H, requires_grad=True),),
                                  fp8_enabled=True)  # fmt: skip
    with pytest.raises(TypeError, match="DTensor .* FSDP2"):
        g8.MasterWeights(model, shard_group=dist.group.WORLD)
    # A high-precision copy that replaced an FP8 weight (what fully_shard made) is refused by
    # every kind of masters, which would train it as such.
    ref._parameters["fc1_weight"] = nn.Parameter(ref.fc1_weight.dequantize())
    lost = r"FP8 primary weights .* \['fc1_weight \(torch.float32\)'\] are now high-precision"
    with pytest.raises(ValueError, match=lost):
        g8.MasterWeights(ref)
    with pytest.raises(ValueError, match=lost):
        g8.MasterWeights(ref, shard_group=dist.group.WORLD)


def test_misuse_is_refused():
    run_on_ranks("gloo", _misuse)


def test_row_views_of_an_fp8_weight_stay_fp8():
    """What fully_shard takes of a parameter: row chunks, narrow, view(-1), new_zeros - FP8,
    sharing the data and scale_inv (new_zeros: a copy of it); a column slice is not contiguous
    and stays the dequantized values."""
    from graphfp8.fp8.primary import quantize_weight

    w = quantize_weight(torch.randn(8, 32))
    rows = [w[:3], w.narrow(0, 3, 5), *torch.chunk(w, 2), w.view(-1)]
    for r in rows:
        assert isinstance(r, Float8Tensor) and r._scale_inv is w._scale_inv
        assert r._data.untyped_storage().data_ptr() == w._data.untyped_storage().data_ptr()
    assert_bitwise_equal(rows[1].dequantize(), w.dequantize()[3:], "narrow")
    zeros = w.new_zeros((4, 32))
    assert isinstance(zeros, Float8Tensor) and not zeros._data.view(torch.uint8).any()
    assert zeros._scale_inv is not w._scale_inv and torch.equal(zeros._scale_inv, w._scale_inv)
    cols = w[:, :4]
    assert type(cols) is torch.Tensor
    assert_bitwise_equal(cols, w.dequantize()[:, :4], "column slice")


def _state_counts_shards(rank, device):
    from graphfp8.memory import training_state

    _, model = _pair(True, 2)
    masters = g8.MasterWeights(model)
    state = training_state(model, None, masters)
    local = [q._local_tensor for q in model.parameters()]
    fp8 = sum(t._data.untyped_storage().nbytes() + 4 for t in local if isinstance(t, Float8Tensor))
    other = sum(t.untyped_storage().nbytes() for t in local if not isinstance(t, Float8Tensor))
    assert state.bytes["weights"] == fp8 + other > 0
    assert state.bytes["fp32 masters"] == 4 * sum(m._local_tensor.numel() for m in masters.masters)
    assert state.parameters == sum(q.numel() for q in model.parameters())  # the whole model's


def test_training_state_counts_this_ranks_shards():
    """graphfp8.memory.training_state of an FSDP2 model: each DTensor's local shard (it counted
    none of them before: a DTensor has no storage of its own)."""
    run_on_ranks("gloo", _state_counts_shards)


def _equal_meshes(rank, device):
    import dataclasses

    from torch.distributed.device_mesh import DeviceMesh

    _, model = _pair(True, 2)
    other = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # equal to the model's, not it
    model.fc2_weight._spec = dataclasses.replace(model.fc2_weight._spec, mesh=other)
    meshes = [model.fc1_weight.device_mesh, model.fc2_weight.device_mesh]
    assert meshes[0] is not meshes[1] and meshes[0] == meshes[1]
    masters = g8.MasterWeights(model)
    assert masters.names == ["fc1_weight", "fc2_weight"]


def test_masters_take_equal_meshes_that_are_different_objects():
    """FP8 weights whose DTensors hold equal DeviceMesh objects that are not the same one (as
    graphfp8-train --fsdp's got in the CPU suite, after earlier tests' meshes): FSDPMasterWeights
    compared the objects, took them for two meshes and refused."""
    run_on_ranks("gloo", _equal_meshes)
