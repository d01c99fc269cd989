"""Bad input to megatron_fsdp_c.per_module.fully_shard (issue 15's list, and what torch's own
FSDP2 suite refuses) gets an error naming the fix, and the processes still shard and train
afterwards. The cell runs in the shared spawns (see [Note: one spawn per world size] in
support/rank_grid.py).
"""
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

import megatron_fsdp_c as mf
from megatron_fsdp_c.per_module import fully_shard
from megatron_fsdp_c.testing import GPT, Block, GPTConfig

from support import rank_grid
from support.checks import raised_by, recorder_cells, reraise, verify
from support.data import normal_batch
from support.train_both import average_grads

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS, tests=["test_bad_input_names_the_fix"])


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids):
        return self.out(self.tok(ids))


def _twice():
    m = nn.Linear(4, 4)
    fully_shard(m)
    fully_shard(m)


def _shared_across_groups():
    """FSDP2 refuses it at the lazy init (test_shared_params_separate_fsdp_groups_error)."""
    m = Tied()
    fully_shard(m.tok)
    fully_shard(m.out)
    fully_shard(m)
    m(torch.randint(0, 10, (2, 3)))


def _child_first(rank):
    """A child's first forward initialises the model through its root (unshard_child_first,
    first_forward_through_child); one run before its parent was sharded made it a root of its own."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(m[0])
    m[0](torch.randn(2, 4))
    fully_shard(m)
    m(torch.randn(2, 4))


def _two_meshes(world):
    """Groups on two meshes are supported (tests/test_moe.py); one parameter in both is not."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].weight = m[0].weight
    fully_shard(m[0], mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("a",)))
    fully_shard(m, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("b",)))
    m(torch.randn(2, 4))


class _MixedDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))

    def forward(self, x):
        return x @ self.a @ self.b


def _mixed_dtypes_in_a_group():
    """float32 and bfloat16 parameters in one group under param_dtype=bfloat16: two engine
    policies for one bucket (FSDP2: "FSDP expects uniform original parameter dtype")."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    m = _MixedDtypes()
    fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    m(torch.randn(2, 4, dtype=torch.bfloat16))


def _dtensor_parameter(world):
    m = nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (world,))
    m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Replicate()]))
    fully_shard(m)


def _v1_sharded():
    m = GPT(GPTConfig(vocab=16, seq=4, d=8, heads=2, layers=1))
    mf.fully_shard(m, fsdp_unit_modules=[Block])
    fully_shard(m)


BAD_INPUT = {
    "already sharded": (RuntimeError, r"already applied.*apply it once per module"),
    "a parameter shared across two groups": (ValueError, r"Parameter 'out.weight' is shared with a parameter already "
                                                         r"managed by another FSDP group.*fully_shard\(\[module_a, "
                                                         r"module_b\]\).*common parent.*or untie"),
    "a mesh on the wrong device type": (ValueError, r"mesh is on 'cuda' but the parameters are on 'cpu'.*"
                                                    r"init_device_mesh\('cpu'"),
    "shard_placement_fn returning Replicate()": (ValueError, r"Replicate\(\).*takes None or Shard\(dim\)"),
    "offload_policy of another kind": (TypeError, r"offload_policy must be torch's OffloadPolicy\(\), "
                                                  r"CPUOffloadPolicy\(\) or None, got str"),
    "CPUOffloadPolicy(pin_memory=False) on a cuda mesh": (ValueError, r"CPUOffloadPolicy\(pin_memory=False\) for "
                                                                   r"this Linear on cuda.*needs pinned memory; use "
                                                                   r"CPUOffloadPolicy\(\)"),
    "a parameter in groups on two meshes": (ValueError, r"in groups on two different meshes.*one fully_shard call"),
    "a 3-D mesh": (ValueError, r"fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh.*takes a 1-D mesh "
                               r"\(FSDP\) or a 2-D \(replicate, shard\) mesh \(HSDP\)"),
    "a 2-D mesh without dim names": (AssertionError, r"Please init the 2D mesh for HSDP with mesh_dim_names specified"),
    "reshard_after_forward=3, not a factor of the group's size": (ValueError, r"should be a factor of 2, but got 3"),
    "reshard_after_forward as a string": (ValueError, r"should be a bool or an int .* not 'yes'"),
    "a child's forward ran first as its own root": (RuntimeError, r"already been lazily initialized for 0\nFSDP "
                                                                  r"requires running forward through the root.*"
                                                                  r"outermost sharded module"),
    "a DTensor parameter": (ValueError, r"already a DTensor"),
    "mp_policy of another type": (TypeError, r"torch.distributed.fsdp.MixedPrecisionPolicy"),
    "a model sharded by the Megatron-FSDP API": (RuntimeError, r"one API per model"),
    "float32 and bfloat16 parameters in one group": (ValueError, r"parameter 'b' computes in torch.bfloat16 like other "
                                                                 r"parameters of its fully_shard group.*share their "
                                                                 r"dtype"),
}


@cell("bad_input")
def bad_input(rank, world, ck):
    from torch.distributed.fsdp import CPUOffloadPolicy
    lin = lambda: nn.Linear(4, 4)  # noqa: E731
    cases = {
        "already sharded": _twice,
        "a parameter shared across two groups": _shared_across_groups,
        "a mesh on the wrong device type": lambda: fully_shard(lin(), mesh=DeviceMesh("cuda", torch.arange(world))),
        "shard_placement_fn returning Replicate()": lambda: fully_shard(lin(), shard_placement_fn=lambda p: Replicate()),
        "offload_policy of another kind": lambda: fully_shard(lin(), offload_policy="cpu"),
        "CPUOffloadPolicy(pin_memory=False) on a cuda mesh": lambda: fully_shard(
            nn.Linear(4, 4, device="meta"), offload_policy=CPUOffloadPolicy(pin_memory=False),
            mesh=DeviceMesh("cuda", torch.arange(world))),
        "a parameter in groups on two meshes": lambda: _two_meshes(world),
        "a 3-D mesh": lambda: fully_shard(lin(), mesh=init_device_mesh("cpu", (1, 1, world),
                                                                       mesh_dim_names=("p", "r", "s"))),
        "a 2-D mesh without dim names": lambda: fully_shard(lin(), mesh=init_device_mesh("cpu", (1, world))),
        "reshard_after_forward=3, not a factor of the group's size": lambda: fully_shard(lin(), reshard_after_forward=3),
        "reshard_after_forward as a string": lambda: fully_shard(lin(), reshard_after_forward="yes"),
        "a child's forward ran first as its own root": lambda: _child_first(rank),
        "a DTensor parameter": lambda: _dtensor_parameter(world),
        "mp_policy of another type": lambda: fully_shard(lin(), mp_policy={"param_dtype": torch.bfloat16}),
        "a model sharded by the Megatron-FSDP API": _v1_sharded,
        "float32 and bfloat16 parameters in one group": _mixed_dtypes_in_a_group,
    }
    for label, fn in cases.items():
        ck.raised(label, fn)
    # afterwards these processes still shard and train
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double()
    ref = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    x = normal_batch(0, rank, (2, 4))
    model(x).sum().backward()
    ref(x).sum().backward()
    average_grads(ref, world)
    ck.grads("a model sharded afterwards", model, ref)


@pytest.mark.parametrize("label", list(BAD_INPUT))
def test_bad_input_names_the_fix(label):
    expected, pattern = BAD_INPUT[label]
    verify(CELLS, "bad_input", 2)
    for kind, message in raised_by(CELLS.result("bad_input", 2), label):
        with pytest.raises(expected, match=pattern):
            reraise(kind, message)
