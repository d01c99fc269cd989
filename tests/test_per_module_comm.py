"""How megatron_fsdp_c.per_module.fully_shard communicates under gradient accumulation, tested
after torch's test_fully_shard_training.py::TestFullyShardGradientAccumulation through public
APIs only (torch's CommDebugMode, the engine's comm_stats). The cells run in the shared spawns
(see [Note: one spawn per world size] in support/rank_grid.py).

Behaviours (cell names):
- a backward with gradient sync off issues no collective after its gathers: no reduce-scatter,
  and no all-reduce of the used-parameter flags ([Note: unused parameters] in
  megatron_fsdp_c/_owner.py), as FSDP2 on a 1-D mesh: no_sync_backward
- the first forward and backward (the lazy init's included) issue the all-gathers FSDP2 issues
  (the lazy init gathers nothing: the compute parameters are pointed at the released full-weight
  buffers), for reshard_after_forward True, False and the default, also when the root's output is
  a child group's output; the losses are FSDP2's: first_step_gathers
- the flags of the backwards without sync wait for the next sync: a parameter one rank used in
  a microbatch without sync only gets its gradient on every rank; one no rank used keeps
  .grad None: flags_carried_to_sync
- a synced backward issues exactly FSDP2's collectives (the used-parameter flags ride in the
  gradient reductions, [Note: used-flag tail] in csrc/comm/reduce.c): on a 1-D mesh and on an HSDP
  2 x 2 mesh (one all-reduce per reduce-scatter; none in a set_requires_all_reduce(False)
  microbatch, as FSDP2), with a parameter one rank of the other replica
  used reaching every rank and one nobody used keeping .grad None; in the Megatron-FSDP API, every
  strategy's synced backward (1-D, and HSDP at world 4) issues only the engine's own reductions
  (CommDebugMode's counts equal comm_stats'); int8 gradients (ZeRO-3) issue no all-reduce either:
  synced_backward_collectives
- each group's reduction is issued while the backward of the groups before it runs (the root
  group, which completes last, waits for no other): reductions_overlap_backward
"""
import pytest
import torch
import torch.nn as nn

from megatron_fsdp_c.per_module import fully_shard

from support import rank_grid
from support.checks import recorder_cells, verify
from support.data import normal_batch

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)


def counts(fn):
    """(all-gathers, reduce-scatters, all-reduces) CommDebugMode sees while fn runs."""
    from torch.distributed.tensor.debug import CommDebugMode
    c10d = torch.ops.c10d
    with CommDebugMode() as cm:
        fn()
    c = cm.get_comm_counts()
    return c[c10d._allgather_base_], c[c10d._reduce_scatter_base_], c[c10d.allreduce_]


@cell("no_sync_backward")
def no_sync_backward(rank, world, ck):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    seen = {}
    for impl, shard in (("torch", torch_fully_shard), ("ours", fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        shard(model[1])
        shard(model)
        x = normal_batch(0, rank, (2, 8)).float()
        model(x).sum().backward()  # the first step (ours: its lazy init) is not counted
        for sync in (False, True):
            model.set_requires_gradient_sync(sync)
            before = model.comm_stats() if impl == "ours" else None
            seen[impl, sync] = counts(lambda: model(x).sum().backward())
            if impl == "ours":
                after = model.comm_stats()
                ck.equal(f"sync {sync}: the engine's reduce-scatters",
                         after["reduce_scatters"] - before["reduce_scatters"], 2 if sync else 0)
                ck.equal(f"sync {sync}: the engine's all-reduces", after["all_reduces"] - before["all_reduces"], 0)
    _, rs, ar = seen["ours", False]
    ck.equal("sync off: no reduce-scatter, no all-reduce (CommDebugMode)", (rs, ar), (0, 0))
    ck.equal("sync off: torch's counts", seen["ours", False][1:], seen["torch", False][1:])
    ck.equal("sync on: the reduce-scatters torch issues", seen["ours", True][1], seen["torch", True][1])


@cell("first_step_gathers")
def first_step_gathers(rank, world, ck):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    for raf in (True, False, None):
        seen, losses = {}, {}
        for impl, shard in (("torch", torch_fully_shard), ("ours", fully_shard)):
            torch.manual_seed(0)
            # the root holds the first Linear; its output is the last child's (test_gradient_accumulation's model)
            model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)), nn.Linear(8, 8))
            kw = {} if raf is None else {"reshard_after_forward": raf}
            for m in model[1:]:
                shard(m, **kw)
            shard(model, **kw)
            x = normal_batch(0, rank, (2, 8)).float()

            def step():
                loss = model(x).sum()
                loss.backward()
                losses[impl] = loss.detach()
            seen[impl] = counts(step)[0]
        ck.equal(f"reshard_after_forward={raf}: the first step's all-gathers, as torch's", seen["ours"], seen["torch"])
        ck.close(f"reshard_after_forward={raf}: the first loss, as torch's", losses["ours"], losses["torch"], 0, 0)


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)

    def forward(self, x, use):
        y = self.trunk(x)
        return self.sometimes(y) if use else y


@cell("flags_carried_to_sync")
def flags_carried_to_sync(rank, world, ck):
    torch.manual_seed(0)
    model = Branches().double()
    fully_shard(model)
    x = normal_batch(0, rank, (2, 8))
    model.set_requires_gradient_sync(False)
    model(x, use=rank == 0).sum().backward()  # rank 0 alone uses `sometimes`, without sync
    model.set_requires_gradient_sync(True)
    model(x, use=False).sum().backward()
    for name, p in model.named_parameters():
        want = not name.startswith("never")
        ck.true(f"{name}: .grad {'set' if want else 'None'} on every rank", (p.grad is not None) == want,
                f"grad is {'None' if p.grad is None else 'set'}")


class Unit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


@cell("synced_backward_collectives", worlds=(2, 4))
def synced_backward_collectives(rank, world, ck):
    import torch.distributed as dist
    import megatron_fsdp_c as mf
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    x = normal_batch(0, rank, (2, 8)).float()
    meshes = [("1-D", rank_grid.device_mesh("cpu", (world,)))]
    if world == 4:
        meshes.append(("HSDP 2x2", rank_grid.device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))))
    for label, mesh in meshes:
        hsdp = mesh.ndim == 2
        seen = {}
        for impl, shard in (("torch", torch_fully_shard), ("ours", fully_shard)):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            shard(model[1], mesh=mesh)
            shard(model, mesh=mesh)
            model(x).sum().backward()  # the first step (ours: its lazy init) is not counted
            seen[impl] = counts(lambda: model(x).sum().backward())
            if hsdp:  # a reduce-scatter-only microbatch, then one across the replicas again
                model.set_requires_all_reduce(False)
                seen[impl, "rs only"] = counts(lambda: model(x).sum().backward())
                model.set_requires_all_reduce(True)
                seen[impl, "after"] = counts(lambda: model(x).sum().backward())
        ag, rs, ar = seen["ours"]
        ck.equal(f"{label}: a synced backward's (all-gathers, reduce-scatters, all-reduces), as FSDP2's",
                 seen["ours"], seen["torch"])
        for phase in ("rs only", "after") if hsdp else ():
            ck.equal(f"{label}, set_requires_all_reduce {phase == 'after'}: the collectives, as FSDP2's",
                     seen["ours", phase], seen["torch", phase])
        ck.equal(f"{label}: all-reduces", ar, rs if hsdp else 0)
        # the flags cross the replicas with the gradients: `sometimes` used on the last rank only
        torch.manual_seed(0)
        model = Branches().double()
        fully_shard(model, mesh=mesh)
        model(x.double(), use=rank == world - 1).sum().backward()
        for name, p in model.named_parameters():
            want = not name.startswith("never")
            ck.true(f"{label}, {name}: .grad {'set' if want else 'None'} on every rank", (p.grad is not None) == want,
                    f"grad is {'None' if p.grad is None else 'set'}")
    # quantized gradients (an all-to-all of int8 pieces) carry the flags too: no all-reduce
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for m in (model[1], model):
        fully_shard(m, quantized_comm_policy=mf.QuantizedCommPolicy(grads="int8", block=32))
    model(x).sum().backward()
    ck.equal("1-D, int8 gradients: all-reduces of a synced backward", counts(lambda: model(x).sum().backward())[2], 0)
    # the Megatron-FSDP API: no collective but the engine's gradient reductions and gathers
    layouts = [("1-D", {})]
    if world == 4:
        layouts.append(("HSDP 2x2", dict(device_mesh=rank_grid.device_mesh("cpu", (2, 2), mesh_dim_names=(
            "dp_outer", "dp_shard")), dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
            hybrid_fsdp_group=dist.group.WORLD)))
    for label, kw in layouts:
        for strategy in (0, 1, 2, 3):
            torch.manual_seed(0)
            model, _ = mf.fully_shard(nn.Sequential(Unit(), Unit()), None, fsdp_unit_modules=[Unit],
                                      zero_dp_strategy=strategy, **kw)
            model(x).sum().backward()
            before = model.comm_stats()
            ag, rs, ar = counts(lambda: model(x).sum().backward())
            after = model.comm_stats()
            d = {k: after[k] - before[k] for k in after}
            ck.equal(f"Megatron-FSDP API {label}, strategy {strategy}: (all-gathers, reduce-scatters, all-reduces) "
                     "are the engine's", (ag, rs, ar),
                     (d["all_gathers"] + d["outer_all_gathers"], d["reduce_scatters"] + d["outer_reduce_scatters"],
                      d["all_reduces"] + d["outer_all_reduces"]))


@cell("reductions_overlap_backward")
def reductions_overlap_backward(rank, world, ck):
    """Each group's reduce-scatter is issued while the backward of the groups before it runs, as
    FSDP2's post-backward issues it: when the first block's backward starts, the last block's
    gradients are reducing already, though the root group (which contains every block and
    completes last) comes first in no order ([Note: collective order] in csrc/comm/reduce.c)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    for layer in model[1:]:  # the root keeps the first layer (an embedding's place): its gradients come last
        fully_shard(layer)
    fully_shard(model)
    x = normal_batch(0, rank, (4, 8)).float()
    model(x).sum().backward()  # the lazy init
    engine = model._mfsdp_group.owner.param_buffer.engine
    last = model[3]._mfsdp_group.unit_state.grad_buckets
    seen = []
    model[1].register_full_backward_pre_hook(lambda mod, grad: seen.append([engine.grad_state(b) for b in last]))
    model(x).sum().backward()
    ck.true("the last block's gradients left for reduction before the first block's backward",
            len(seen) == 1 and all(state in ("reducing", "clean") for state in seen[0]), str(seen))


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys()))
def test_comm_behaviour(name, world):
    verify(CELLS, name, world)
