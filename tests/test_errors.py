"""Bad input gets a clear Python exception naming the problem and the fix: never a crash, a
hang or silent corruption. Every case runs on 2 real ranks; afterwards the same processes
still shard and train a model (a failed fully_shard leaves nothing behind)."""
import pytest
import torch
import torch.nn as nn

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid

CELLS = rank_grid.Cells(__name__)

CFG = GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=2)


class NotInModel(nn.Module):
    pass


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


def _complex_model():
    m = _model()
    m.register_parameter("phase", nn.Parameter(torch.zeros(4, dtype=torch.complex64)))
    return m


def _two_device_model():
    m = _model()
    m.blocks[1].fc.weight = nn.Parameter(torch.empty(4 * CFG.d, CFG.d, device="meta"))
    return m


def _wrapped_twice():
    model, _ = mf.fully_shard(_model(), fsdp_unit_modules=[Block])
    return mf.fully_shard(model, fsdp_unit_modules=[Block])


def _inner_wrapped_twice():
    inner = _model()
    mf.fully_shard(inner, fsdp_unit_modules=[Block])
    return mf.fully_shard(inner, fsdp_unit_modules=[Block])


def _foreign_optimizer():
    stranger = nn.Linear(3, 3)
    return mf.fully_shard(_model(), torch.optim.SGD(list(stranger.parameters()), lr=0.1), fsdp_unit_modules=[Block])


CASES = {
    "unknown strategy name": (lambda: mf.fully_shard(_model(), zero_dp_strategy="zero4"), ValueError,
                              ["zero4", "optim_grads_params"]),
    "strategy out of range": (lambda: mf.fully_shard(_model(), zero_dp_strategy=5), ValueError, ["5", "no_shard"]),
    "strategy as bool": (lambda: mf.fully_shard(_model(), zero_dp_strategy=True), ValueError, ["True"]),
    "strategy 3 without units": (lambda: mf.fully_shard(_model(), zero_dp_strategy=3), ValueError,
                                 ["fsdp_unit_modules", "optim_grads"]),
    "fully_shard twice on the wrapper": (_wrapped_twice, RuntimeError, ["already"]),
    "fully_shard twice on one module": (_inner_wrapped_twice, RuntimeError, ["already"]),
    "unit class not in model": (lambda: mf.fully_shard(_model(), fsdp_unit_modules=[NotInModel]), ValueError,
                                ["NotInModel", "Block"]),
    "unit entry not a module class": (lambda: mf.fully_shard(_model(), fsdp_unit_modules=[int]), TypeError,
                                      ["int", "nn.Module"]),
    "unit string that does not import": (lambda: mf.fully_shard(_model(), fsdp_unit_modules=["no.such.Block"]),
                                         ValueError, ["no.such.Block"]),
    "parameters on different devices": (lambda: mf.fully_shard(_two_device_model(), fsdp_unit_modules=[Block]),
                                        ValueError, ["different devices", "meta", "init_model_with_meta_device"]),
    "complex parameter that requires grad": (lambda: mf.fully_shard(_complex_model(), fsdp_unit_modules=[Block]),
                                             TypeError, ["phase", "complex64", "requires_grad=False"]),
    "policy of the wrong type": (lambda: mf.fully_shard(_model(), fsdp_unit_modules=[Block],
                                                        mixed_precision_policy={"main_params_dtype": "fp32"}),
                                 TypeError, ["MixedPrecisionPolicy"]),
    "device_mesh of the wrong type": (lambda: mf.fully_shard(_model(), fsdp_unit_modules=[Block], device_mesh=[0, 1]),
                                      TypeError, ["device_mesh", "ProcessGroup"]),
    "unknown keyword": (lambda: mf.fully_shard(_model(), fsdp_unit_modules=[Block], shard_everything=True),
                        TypeError, ["shard_everything"]),
    "optimizer over other parameters": (_foreign_optimizer, ValueError, ["not part of the sharded model"]),
    "not a module": (lambda: mf.fully_shard("model", fsdp_unit_modules=[Block]), TypeError, ["nn.Module"]),
    "no parameters": (lambda: mf.fully_shard(nn.ReLU(), zero_dp_strategy=2), ValueError, ["no parameters"]),
}


@CELLS.cell("bad input", tests=["test_bad_input_raises_clear_error"])
def error_cases(rank, world):
    seen = {}
    for name, (fn, _, _) in CASES.items():
        try:
            fn()
            seen[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - what the user would see
            seen[name] = (type(e).__name__, str(e))
    # Afterwards these processes still shard and train.
    model, opt = mf.fully_shard(_model(), torch.optim.SGD(_model().parameters(), lr=0.1) and None,
                                fsdp_unit_modules=[Block])
    x, y = batch(CFG, 2, seed=rank)
    model(x, y).backward()
    seen["still trains"] = ("ok", str(model.comm_stats()["reduce_scatters"]))
    return seen


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_clear_error(name):
    _, expected_type, fragments = CASES[name]
    for rank, seen in enumerate(CELLS.result("bad input", 2)):
        kind, message = seen[name]
        assert kind == expected_type.__name__, f"rank {rank}: {kind}: {message}"
        for fragment in fragments:
            assert fragment in message, f"rank {rank}: {fragment!r} not in: {message}"
        assert seen["still trains"][0] == "ok"


def test_uninitialised_process_group_is_a_clear_error():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        mf.fully_shard(_model(), fsdp_unit_modules=[Block])


def test_policy_validation():
    with pytest.raises(ValueError, match="not a floating dtype"):
        mf.MixedPrecisionPolicy(main_params_dtype=torch.int32)
    with pytest.raises(TypeError, match="torch.dtype"):
        mf.MixedPrecisionPolicy(grad_comm_dtype="bf16")
    with pytest.raises(ValueError, match="narrower than grad_comm_dtype"):
        mf.MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16, grad_comm_dtype=torch.float32)
    mf.MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16, grad_comm_dtype=torch.float32,
                            allow_lossy_accumulation=True)
    with pytest.raises(TypeError, match="sum_in_comm_dtype must be True or False"):
        mf.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16, sum_in_comm_dtype="bf16")


@pytest.mark.parametrize("value", ["lots", "-1"])
def test_bad_heap_trim_setting_names_the_variable(monkeypatch, value):
    from megatron_fsdp_c._owner import host_trim_bytes as _host_trim_bytes

    monkeypatch.setenv("MFSDP_HOST_TRIM_BYTES", value)
    with pytest.raises(ValueError, match="MFSDP_HOST_TRIM_BYTES=.*byte count.*or 0"):
        _host_trim_bytes()
    monkeypatch.setenv("MFSDP_HOST_TRIM_BYTES", "0")
    assert _host_trim_bytes() == 0
