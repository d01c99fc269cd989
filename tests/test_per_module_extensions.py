"""Tensor-subclass parameters with FSDP2's all-gather extensions on the per-module API ([Note:
extension parameters] in megatron_fsdp_c/_extensions.py): torchao's float8 training with the fp8
all-gather, torchao's int8 mixed-precision training, and a subclass of the tests' own
(support/subclass.py) that gathers int8 rows and per-row scales. The cells run in the shared spawns
(see [Note: one spawn per world size] in support/rank_grid.py).

Behaviours (cell names):
- the same script with torch's FSDP2 and ours, shards even: losses and parameters bit for bit,
  every step: vs_fsdp2[float8|int8|scaled|legacy] (worlds 2, 4); float8 under torchtitan's
  policy (bf16 compute, fp32 reduction): vs_fsdp2[float8-bf16]
- uneven shards (dims the world does not divide; FSDP2 raises for torchao's float8 there, torchao
  #3982): ours against a one-process model that runs every rank's batch in turn, float64 to rtol
  1e-9 (the fp8/int8 roundings are the same on both sides): vs_reference[float8|int8|scaled]
  (worlds 2, 4); under the other strategies (ZeRO-1, ZeRO-2, no_shard), on an HSDP 2x2 mesh, and
  with reshard_after_forward=False: vs_reference[scaled-optim|scaled-optim_grads|
  float8-optim_grads|scaled-no_shard|scaled-hsdp|float8-keep_weights]
- the fp8 gather's bytes: the float8 blocks' all-gathers carry one byte per weight element where
  the same run without the fp8 gather carries four: wire_bytes
- the protocol's corners, from what the subclass saw: pre_all_gather's arguments, metadata handed
  to the post_all_gather of the same gather, out= on every gather after the first with the same
  compute parameter, gathered inputs of other dtypes and sizes than the parameter: protocol
- DCP: a float8 model's checkpoint by ours and by FSDP2 at world 2 (the same state dicts), each
  read at world 4 by both: the same values, the next steps bit for bit: dcp_save, dcp_load
- refusals at fully_shard with the reason (settings not supported yet, a subclass without the
  extensions, the Megatron-style API's weights outside every unit), and inputs whose size
  changes: refusals
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp_c._extensions import values_of
from megatron_fsdp_c.per_module import fully_shard

from support import rank_grid
from support.checks import outcome, recorder_cells, verify
from support.subclass import CALLS, QLinear, ScaledInt8Weight, to_scaled_int8

torchao = pytest.importorskip("torchao")
from support.lowp_models import BATCH, Block, build, check_against_reference, train, values  # noqa: E402

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)


def shard(model: nn.Module, impl: str, world: int, hsdp: bool = False, **kw) -> nn.Module:
    """Sharded per block and at the root, on a 1-D mesh or (hsdp) a named (2, world / 2) one."""
    from torch.distributed.fsdp import fully_shard as torch_shard
    fs = torch_shard if impl == "torch" else fully_shard
    mesh = rank_grid.device_mesh("cpu", (2, world // 2), ("dp_replicate", "dp_shard")) if hsdp \
        else rank_grid.device_mesh("cpu", (world,))
    for block in (model[1], model[2]):
        fs(block, mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    return model


@cell("vs_fsdp2[float8]", worlds=(2, 4), kind="float8")
@cell("vs_fsdp2[int8]", worlds=(2, 4), kind="int8")
@cell("vs_fsdp2[scaled]", worlds=(2, 4), kind="scaled")
@cell("vs_fsdp2[legacy]", kind="legacy")
@cell("vs_fsdp2[float8-bf16]", kind="float8", bf16=True)
def vs_fsdp2(rank, world, ck, kind, bf16=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy  # torchtitan's: bf16 compute, fp32 reduction
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if bf16 else {}
    ours = shard(build(kind, 64), "ours", world, **kw)
    theirs = shard(build(kind, 64), "torch", world, **kw)
    ck.true("the blocks' weights are subclass shards", all(
        type(p.to_local()) is not torch.Tensor for p in (ours[1].up.weight, ours[2].down.weight)),
        str(type(ours[1].up.weight.to_local())))
    (ol, op), (tl, tp) = train(ours, kind, rank, world), train(theirs, kind, rank, world)
    for step, (a, b) in enumerate(zip(ol, tl)):
        ck.equal(f"step {step}: loss", a, b)
    for step, (a, b) in enumerate(zip(op, tp)):
        for name in b:
            ck.equal(f"step {step}: {name}", a[name], b[name])
    ck.true("the weights moved", not torch.equal(op[-1]["1.up.weight"], values(build(kind, 64)[1].up.weight)))


@cell("vs_reference[float8]", worlds=(2, 4), kind="float8")
@cell("vs_reference[int8]", worlds=(2, 4), kind="int8")
@cell("vs_reference[scaled]", worlds=(2, 4), kind="scaled")
@cell("vs_reference[scaled-optim]", kind="scaled", zero_dp_strategy="optim")
@cell("vs_reference[scaled-optim_grads]", worlds=(2, 4), kind="scaled", zero_dp_strategy="optim_grads")
@cell("vs_reference[float8-optim_grads]", kind="float8", zero_dp_strategy="optim_grads")
@cell("vs_reference[scaled-no_shard]", kind="scaled", zero_dp_strategy="no_shard")
@cell("vs_reference[scaled-hsdp]", worlds=(4,), kind="scaled", hsdp=True)
@cell("vs_reference[float8-keep_weights]", kind="float8", reshard_after_forward=False)
@cell("vs_reference[float8-fused_adamw]", kind="float8", fused=True)  # FusedAdamW steps the subclass's values
def vs_reference(rank, world, ck, kind, fused=False, **kw):
    dim = 67  # 67 and 134 rows: uneven pieces over 2 and 4 ranks
    ours = shard(build(kind, dim, torch.float64), "ours", world, **kw)
    opt = None
    if fused:
        import megatron_fsdp_c as mf
        opt = mf.FusedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)  # train()'s AdamW, fused
    ref = build(kind, dim, torch.float64, reference=True)
    if kw.get("zero_dp_strategy") != "no_shard":
        pieces = world // 2 if kw.get("hsdp") else world
        uneven = [n for n, p in ours.named_parameters() if p.shape[0] % pieces]
        ck.true("some subclass weights are unevenly sharded",
                any(n.endswith(("up.weight", "down.weight")) for n in uneven), str(uneven))
    check_against_reference(ck, train(ours, kind, rank, world, dtype=torch.float64, opt=opt),
                            train(ref, kind, rank, world, dtype=torch.float64, every_rank=True), world)


def gathered_bytes(model) -> int:
    return model[1]._mfsdp_group.owner.param_buffer.engine.stats()["all_gather_bytes"]


@cell("wire_bytes")
def wire_bytes(rank, world, ck):
    fp8 = shard(build("float8", 64), "ours", world)
    wide = shard(build("float8", 64, fp8_gather=False), "ours", world)
    train(fp8, "float8", rank, world, steps=2)
    train(wide, "float8", rank, world, steps=2)
    weights = sum(p.numel() for b in (fp8[1], fp8[2]) for p in (b.up.weight, b.down.weight))
    others = sum(p.numel() for n, p in fp8.named_parameters() if not n.endswith(("up.weight", "down.weight")))
    # two steps, each gathering the blocks twice (forward, backward); alignment and the flag tails
    # add a few elements per bucket
    per_step_fp8, per_step_wide = gathered_bytes(fp8) / 2, gathered_bytes(wide) / 2
    saved = per_step_wide - per_step_fp8  # 80,544 against 277,280 bytes a step at world 2
    ck.true(f"the fp8 run gathers {per_step_fp8:.0f} bytes a step, the fp32 run {per_step_wide:.0f}: the float8 "
            f"weights ({weights} elements, gathered twice a step) cross the wire at one byte an element, not four",
            abs(saved - 2 * 3 * weights) <= 0.01 * 2 * 3 * weights, f"saved {saved:.0f}, expected {2 * 3 * weights}")


@cell("protocol", worlds=(2, 4))
def protocol(rank, world, ck):
    CALLS.clear()
    dim = 64 if world == 2 else 67
    model = shard(build("scaled", dim), "ours", world)
    outputs_in_forward = []  # bytes of the gathered inputs while the weight computes

    def look(mod, args):
        g = model[1]._mfsdp_group
        outputs_in_forward.extend(i.output.untyped_storage().nbytes()
                                  for e in g.owner.extension_gathers.by_unit[g.unit_state.index] for i in e.inputs)
    model[1].up.register_forward_pre_hook(look)
    train(model, "scaled", rank, world, steps=2)
    ck.true("fsdp_should_release_all_gather_outputs_after_post_all_gather() True: the gathered inputs are freed "
            "before the weight computes", outputs_in_forward and not any(outputs_in_forward), str(outputs_in_forward))
    pres = [c for k, c in CALLS if k == "pre"]
    posts = [c for k, c in CALLS if k == "post"]
    ck.true("pre_all_gather got the mesh, the full size and stride, the module and torch's policy", pres and all(
        c["mesh"] == world and c["module"] == "QLinear" and c["mp"] == "MixedPrecisionPolicy"
        and c["outer_size"] in ((2 * dim, dim), (dim, 2 * dim))
        and c["outer_stride"] == (c["outer_size"][1], 1) for c in pres), str(pres[:2]))
    metas = {c["meta"] for c in pres}
    ck.true("each post_all_gather got metadata a pre_all_gather returned", all(c["meta"] in metas for c in posts))
    by_weight = {}
    for c in posts:
        by_weight.setdefault(c["meta"][2], []).append(c)  # meta[2]: the weight's module
    firsts = [c for c in posts if not c["out"]]
    ck.equal("one post_all_gather without out= per weight (4 weights)", len(firsts), 4)
    ck.true("post_all_gather without out= comes first", all(not cs[0]["out"] for cs in by_weight.values()))
    ck.true("every later gather refills the same compute parameter through out=",
            all(len({c["out_id"] for c in cs[1:] if c["out"]}) >= 1 for cs in by_weight.values())
            and len([c for c in posts if c["out"]]) >= 4 * 2 * 2 - 4)
    ck.true("the gathered inputs: int8 rows and one float32 scale per row, the parameter's rows",
            all(c["dtypes"] == ["torch.int8", "torch.float32"] and c["shapes"][0][0] == c["shapes"][1][0]
                and c["shapes"][1][1:] == (1,) and c["shapes"][0][0] in (dim, 2 * dim) for c in posts), str(posts[:1]))
    outs = {}
    for c in posts:
        if c["out"]:
            outs.setdefault(c["meta"][2], set()).add(c["out_id"])
    ck.true("out= is one tensor per weight for the whole run", all(len(v) == 1 for v in outs.values()), str(outs))


class _Shrinking(ScaledInt8Weight):
    """Gives its scale as (rows,) instead of (rows, 1) once `shrink` is set."""
    shrink = False

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return _Shrinking(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        (q, scale), meta = super().fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
        return (q, scale.view(-1) if _Shrinking.shrink else scale), meta


@cell("refusals")
def refusals(rank, world, ck):
    from megatron_fsdp_c import QuantizedCommPolicy
    import megatron_fsdp_c
    from torch.testing._internal.two_tensor import TwoTensor
    mesh = rank_grid.device_mesh("cpu", (world,))
    for label, kw, want in (("Shard(1)", dict(shard_placement_fn=lambda p: Shard(p.ndim - 1)), "Shard(dim)"),
                            ("quantized_comm_policy", dict(quantized_comm_policy=QuantizedCommPolicy(weights="int8")),
                             "quantized_comm_policy")):
        model = build("scaled", 64)
        got = outcome(lambda: fully_shard(model[1], mesh=mesh, **kw))
        ck.true(f"{label}: NotImplementedError naming it", got.startswith("NotImplementedError") and want in got, got)
        ck.true(f"{label}: the module is left as it was", type(model[1].up.weight) is ScaledInt8Weight
                and not isinstance(model[1].up.weight, DTensor))
    model = build("scaled", 64, reference=True)
    model[1].up.weight = nn.Parameter(TwoTensor(model[1].up.weight.detach(), model[1].up.weight.detach().clone()))
    shard(model, "ours", world)  # accepted: FSDP2 lets the extensions be set on the local shard later
    got = outcome(lambda: model(torch.randn(BATCH, 32)))
    ck.true("a subclass without the extensions at the first forward: refused, naming them",
            got.startswith("NotImplementedError") and "without FSDP2's all-gather extensions" in got, got)
    model = build("scaled", 64)
    got = outcome(lambda: megatron_fsdp_c.fully_shard(model, fsdp_unit_modules=[], device_mesh=mesh,
                                                      zero_dp_strategy="optim_grads"))
    ck.true("the Megatron-style API, subclass weights outside every unit: refused, pointing at the per-module API",
            got.startswith("NotImplementedError") and "outside every unit" in got and "per_module" in got, got)
    # inputs of another size than planned: a clear error before any collective, on every rank
    model = to_scaled_int8(build("scaled", 64, reference=True), _Shrinking)
    for m in model.modules():
        if isinstance(m, QLinear):
            m.reference = False
    _Shrinking.shrink = False
    shard(model, "ours", world)
    x = torch.randn(BATCH, 32)
    model(x).sum().backward()
    _Shrinking.shrink = True
    got = outcome(lambda: model(x))
    _Shrinking.shrink = False
    ck.true("an input whose shape changed: ValueError naming the parameter and both shapes",
            got.startswith("ValueError") and "returned an input of shape" in got, got)


def checkpoints(name: str) -> str:
    """A path for this session's checkpoints (spawns of every world size see it)."""
    return os.path.join(rank_grid.session_dir(), "per_module_extensions", name)


@cell("dcp_save")
def dcp_save(rank, world, ck):
    """A float8 model (fp8 gather) trained by ours and by FSDP2, each saved with DCP: the state
    dicts hold the same subclass DTensors and values; dcp_load reads both at world 4."""
    saved = {}
    for impl in ("ours", "torch"):
        model = shard(build("float8", 64), impl, world)
        train(model, "float8", rank, world, steps=2)
        sd = get_model_state_dict(model)
        saved[impl] = {k: (type(v.to_local()).__name__, values(v)) for k, v in sd.items()}
        dcp.save(sd, checkpoint_id=checkpoints(f"float8-{impl}"))
    for k, (kind, v) in saved["torch"].items():
        ck.equal(f"state dict {k}: the local tensor's class", saved["ours"][k][0], kind)
        ck.equal(f"state dict {k}", saved["ours"][k][1], v)
    if rank == 0:
        torch.save({k: v for k, (_, v) in saved["torch"].items()}, checkpoints("float8-values.pt"))
    dist.barrier()


@cell("dcp_load", worlds=(4,), needs=[(__name__, "dcp_save", 2)])
def dcp_load(rank, world, ck):
    """Each world-2 checkpoint read at world 4 (another sharding: 128 rows over 4, not 2) by ours
    and by FSDP2: the same values, and the next steps train alike, bit for bit."""
    expected = torch.load(checkpoints("float8-values.pt"))
    for writer in ("ours", "torch"):
        runs = {}
        for impl in ("ours", "torch"):
            model = shard(build("float8", 64), impl, world)
            sd = get_model_state_dict(model)
            dcp.load(sd, checkpoint_id=checkpoints(f"float8-{writer}"))
            set_model_state_dict(model, sd)
            for k, v in model.state_dict().items():
                ck.equal(f"written by {writer}, read by {impl} at world 4: {k}", values(v), expected[k])
            runs[impl] = train(model, "float8", rank, world, steps=2)
        for step, (a, b) in enumerate(zip(runs["ours"][0], runs["torch"][0])):
            ck.equal(f"written by {writer}: step {step} after the load, loss", a, b)
        for name, v in runs["torch"][1][-1].items():
            ck.equal(f"written by {writer}: {name} after two more steps", runs["ours"][1][-1][name], v)


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys()))
def test_extension_parameters(name, world):
    verify(CELLS, name, world)
