"""The CUDA path's Python side, checked without a GPU: device resolution, the transport choice,
timeouts, the torch transport's waits on CUDA, the one-NCCL check, and close(). What needs a GPU
is in tests/test_cuda.py."""
import datetime

import pytest
import torch
import torch.nn as nn

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c._distributed import resolve_device, use_native_nccl
from megatron_fsdp_c._nccl import check_one_nccl, divmod_version
from megatron_fsdp_c.fully_shard import _check_params
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid, spawns

CELLS = rank_grid.Cells(__name__)


@pytest.fixture
def current_gpu_3(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_cuda_without_index_is_the_current_gpu(current_gpu_3):
    # every rank otherwise made its communicators on GPU 0 and launched on device 0's stream
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) is None


def test_meta_init_target_is_indexed(current_gpu_3):
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    assert _check_params(model, meta_device_init=True, device=torch.device("cuda")) == torch.device("cuda", 3)


def test_auto_transport_is_torch_until_a_gpu_proves_native_nccl():
    assert not use_native_nccl("auto", torch.device("cuda", 0))
    assert not use_native_nccl("torch", torch.device("cuda", 0))
    assert use_native_nccl("nccl", torch.device("cuda", 0))


class _Work:
    def __init__(self, calls):
        self.calls = calls

    def wait(self, *args):
        self.calls.append(args)
        return True


@pytest.mark.parametrize("device", [-1, 0], ids=["cpu", "cuda"])
def test_torch_transport_waits_without_timeout_on_cuda(monkeypatch, device):
    # Work.wait(timeout) on ProcessGroupNCCL blocks the host until the collective ends
    calls = []
    for name in ("all_gather_single", "all_gather_into_tensor"):
        monkeypatch.setattr(torch.distributed, name, lambda *a, **k: _Work(calls), raising=False)
    timeout = datetime.timedelta(seconds=5)
    transport = _C.TorchTransport(None, None, device, timeout)
    spec = _C.plan([(4, 1, 0, 0, True, False)], 1, 0, 0, 16)[0]  # one float32 parameter of 4 elements
    spec.update(param_dtype=0, main_dtype=0, grad_dtype=0, comm_dtype=0, weights_sharded=1, weights_regather=0,
                grad_mode=_C.GRAD_SCATTER_ACCUMULATE)
    engine = _C.Engine([spec], 1, 0, 1.0, "sum", 1 << 20, torch.device("cpu"), transport, True)
    engine.init_begin(0)
    engine.set_item(0, 0, torch.ones(4))
    engine.init_end(0)
    engine.unshard([0])
    engine.wait_unshard([0])
    engine.close()
    assert calls == ([(timeout,)] if device < 0 else [()])


def _group_timeout(rank, world):
    import torch.distributed as dist

    from megatron_fsdp_c._distributed import group_timeout

    group = dist.new_group(ranks=[0], timeout=datetime.timedelta(seconds=77))
    return group_timeout(group, torch.device("cpu")), group_timeout(dist.group.WORLD, torch.device("cpu"))


CELLS.add("group timeout", _group_timeout, worlds=(1,), tests=["test_no_collective_timeout_means_the_process_group_timeout"])


def test_no_collective_timeout_means_the_process_group_timeout():
    own, world = CELLS.result("group timeout", 1)[0]
    assert own == datetime.timedelta(seconds=77)
    assert world == datetime.timedelta(seconds=spawns.GROUP_TIMEOUT_S)  # the grid's default group timeout


def test_one_nccl_in_the_process():
    check_one_nccl(ours=(2, 28, 9), torchs=(2, 28, 9), libraries=["/site/nvidia/nccl/lib/libnccl.so.2"])
    check_one_nccl(ours=(2, 28, 9), torchs=None, libraries=[])  # CPU torch: nothing to compare
    with pytest.raises(RuntimeError, match="two NCCL libraries"):
        check_one_nccl(ours=(2, 28, 9), torchs=(2, 28, 9), libraries=["/a/libnccl.so.2", "/b/libnccl.so.2"])
    with pytest.raises(RuntimeError, match="NCCL 2.27.3 but torch runs 2.28.9"):
        check_one_nccl(ours=(2, 27, 3), torchs=(2, 28, 9), libraries=[])
    assert divmod_version(22809) == (2, 28, 9) and divmod_version(2804) == (2, 8, 4)


CFG = GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=2)


def _close_worker(rank, world):
    torch.manual_seed(0)
    model, _ = mf.fully_shard(GPT(CFG), fsdp_unit_modules=[Block])
    x, y = batch(CFG, 2, seed=rank)
    model(x, y).backward()
    mf.close(model)  # the torch transport borrows the process group: nothing to end, nothing breaks
    return True


CELLS.add("close", _close_worker, tests=["test_close_is_collective_and_harmless_on_the_torch_transport"])


def test_close_is_collective_and_harmless_on_the_torch_transport():
    # the spawn's later cells still train on the same process group
    assert CELLS.result("close", 2) == [True, True]
