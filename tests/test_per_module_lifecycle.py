"""Parameter registration and the life cycle of megatron_fsdp_c.per_module.fully_shard, as FSDP2
does them (torch's test_fully_shard_training.py TestFullyShardRegisteredParams,
test_fully_shard_autograd.py's post-accumulate-grad hook tests, test_fully_shard_init.py's lazy
init tests), through public APIs only, against a plain replica on the same data, float64 to rtol
1e-9. The cells run in the shared spawns (see [Note: one spawn per world size] in support/rank_grid.py).

Behaviours (cell names):
- after a forward without its backward, each group's modules hold its sharded DTensors when it
  resharded, its full compute parameters when it kept them; a state dict taken there holds
  DTensors; the backward that follows is right: after_forward_registration
- post-accumulate-grad hooks on the DTensor parameters run once per parameter per synced
  backward, not with gradient sync off: post_acc_grad_hook_runs; an optimizer per parameter
  stepped in those hooks (optimizer in backward) trains as one optimizer after the backward:
  post_acc_grad_hook_optim_parity
- the first forward, or unshard(), through a sharded child initialises the model through its
  root; unshard() registers the gathered Parameter until reshard(): child_first
- a parameter replaced after fully_shard, before the first forward, is picked up at the lazy
  init: reset_param_in_lazy_init; so is load_state_dict(sharded_sd, assign=True) on a
  meta-device model, a tied weight staying tied: load_assign_on_meta
- the first forward inside torch.func.jvp after meta-device init (no warm-up): no_warmup_jvp
- torch.compile of the model: compiled
- .to(dtype) after the first forward (and between steps, the optimizer kept; with gradients
  attached, carried and converted): to_after_first_forward; refused at the call while a
  replicated parameter's gradient is attached: to_with_replicated_grad
"""
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from megatron_fsdp_c.per_module import FSDPModule, fully_shard

from support import rank_grid
from support.checks import full, outcome, recorder_cells, verify
from support.data import normal_batch
from support.tiny_models import MLP, MLPStack, mlp_stack
from support.train_both import against_ddp, average_grads

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)


def _shard_stack(model, **kw):
    for m in model:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


@cell("after_forward_registration[reshard]", worlds=(2, 4), reshard=True)
@cell("after_forward_registration[keep]", worlds=(2, 4), reshard=False)
def after_forward_registration(rank, world, ck, reshard):
    model = mlp_stack()
    ref = copy.deepcopy(model)
    _shard_stack(model, reshard_after_forward=reshard)
    for grad in (False, True):  # an eval-style forward, then one whose backward comes later
        x = normal_batch(int(grad), rank, (4, 8))
        with torch.set_grad_enabled(grad):
            out = model(x)
        kinds = {n: type(p).__name__ for n, p in model.named_parameters()}
        if reshard:
            ck.true(f"grad={grad}: every parameter is its sharded DTensor after the forward",
                    all(isinstance(p, DTensor) for p in model.parameters()), str(kinds))
        else:
            ck.true(f"grad={grad}: every parameter is a full plain Parameter after the forward (kept gathered)",
                    all(type(p) is nn.Parameter for p in model.parameters()), str(kinds))
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            ck.close(f"grad={grad}: {n} read after the forward", full(p), q)
        sd = model.state_dict()
        ck.true(f"grad={grad}: the state dict holds DTensors", all(isinstance(v, DTensor) for v in sd.values()),
                str({k: type(v).__name__ for k, v in sd.items()}))
    ref_out = ref(x)
    ck.close("the forward's output", out, ref_out)
    out.sum().backward()
    ref_out.sum().backward()
    average_grads(ref, world)
    ck.grads("the backward after the state dict", model, ref)
    ck.true("every parameter is a DTensor after the backward",
            all(isinstance(p, DTensor) for p in model.parameters()))


def _count_hooks(model):
    calls = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    return calls


@cell("post_acc_grad_hook_runs", worlds=(2,))
def post_acc_grad_hook_runs(rank, world, ck):
    model = _shard_stack(mlp_stack())
    names = sorted(n for n, _ in model.named_parameters())
    calls = _count_hooks(model)
    seen = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.__setitem__(name, isinstance(p, DTensor) and p.grad is not None))
    x = normal_batch(0, rank, (4, 8))
    model(x).sum().backward()
    ck.equal("each hook once after the first backward", sorted(calls.items()), [(n, 1) for n in names])
    ck.true("each hook got its DTensor parameter with its .grad set", sorted(seen) == names and all(seen.values()),
            str(seen))
    model.set_requires_gradient_sync(False)
    model(x).sum().backward()
    ck.equal("no hook with gradient sync off", sorted(calls.items()), [(n, 1) for n in names])
    model.set_requires_gradient_sync(True)
    model(x).sum().backward()
    ck.equal("each hook once more when the sync is on again", sorted(calls.items()), [(n, 2) for n in names])


@cell("post_acc_grad_hook_optim_parity", worlds=(2, 4))
def post_acc_grad_hook_optim_parity(rank, world, ck):
    """torchtune's optimizer in backward: an optimizer per parameter, stepped (and zeroed) in the
    parameter's post-accumulate-grad hook."""
    model = mlp_stack()
    ref = copy.deepcopy(model)
    _shard_stack(model)
    optims = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}
    scheds = {p: torch.optim.lr_scheduler.StepLR(o, step_size=2) for p, o in optims.items()}

    def step_in_backward(p):
        optims[p].step()
        optims[p].zero_grad()
        scheds[p].step()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_optim, step_size=2)
    for step in range(4):
        x = normal_batch(step, rank, (4, 8))
        ref_loss = ref(x).sum()
        ref_loss.backward()
        average_grads(ref, world)
        ref_optim.step()
        ref_optim.zero_grad()
        ref_sched.step()
        loss = model(x).sum()
        loss.backward()
        ck.close(f"step {step}: loss", loss, ref_loss)
        ck.params(f"step {step}", model, ref)
        ck.true(f"step {step}: the hooks' zero_grad left no gradient", all(p.grad is None for p in model.parameters()))


@cell("child_first[forward]", worlds=(2, 4), how="forward")
@cell("child_first[unshard]", worlds=(2, 4), how="unshard")
def child_first(rank, world, ck, how):
    """The first forward (or unshard()) of a sharded child, not the root, initialises the whole
    model through its root, as FSDP2's lazy init does (test_train_shared_params_uneven_shard
    unshard()s the embedding first); unshard() registers the gathered Parameter until reshard()."""
    model = mlp_stack()
    ref = copy.deepcopy(model)
    _shard_stack(model)
    x = normal_batch(9, rank, (4, 8))
    if how == "forward":
        with torch.no_grad():
            ck.close("the child's first forward", model[1](x), ref[1](x))
    else:
        model[1].unshard()
        w = model[1].up.weight
        ck.true("unshard() registers the gathered Parameter",
                type(w) is nn.Parameter and w.shape == ref[1].up.weight.shape, f"{type(w).__name__} {tuple(w.shape)}")
        ck.close("its value", w, ref[1].up.weight)
        ck.true("a group not unsharded keeps its DTensors", isinstance(model[0].up.weight, DTensor))
        model[1].reshard()
        ck.true("reshard() registers the DTensor again", isinstance(model[1].up.weight, DTensor))
    against_ddp(ck, rank, world, model, ref, lambda s, r: normal_batch(s, r, (4, 8)))


class WeightNorm(nn.Module):
    """torch's test_reset_sharded_param_in_lazy_init model."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self):
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)

    def forward(self, x):
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


def _values(model):
    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters()}


@cell("reset_param_in_lazy_init", worlds=(2, 4))
def reset_param_in_lazy_init(rank, world, ck):
    """A parameter replaced after fully_shard and before the first forward (here after to_empty,
    a DTensor computed from the sharded weights) is the group's from the lazy init on."""
    with torch.device("meta"):
        model = WeightNorm().double()
    ref = WeightNorm().double()
    values = _values(ref)
    ref.load_state_dict(values)
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        for name in ("layer1.weight", "layer2.weight"):
            p = model.get_parameter(name)
            p.copy_(distribute_tensor(values[name], p.device_mesh, p.placements))
    model.init_weight_norm()
    ref.init_weight_norm()
    against_ddp(ck, rank, world, model, ref, lambda s, r: normal_batch(s, r, (3, 3)), loss=lambda m, x: m(x))


class TiedStack(nn.Module):
    """Its input and output projections share their weight (as a language model's embedding and
    output do): load_state_dict(assign=True) assigns each of the two keys its own parameter."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16, bias=False)
        self.stack = mlp_stack(dim=16)
        self.down = nn.Linear(16, 8, bias=False)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(self.down(self.stack(self.inp(x))))


def _reshard_all(model):
    """Every group's sharded parameters registered (an optimizer is built on them, as under FSDP2)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@cell("load_assign_on_meta[untied]", worlds=(2, 4), tied=False)
@cell("load_assign_on_meta[tied]", worlds=(2,), tied=True)
def load_assign_on_meta(rank, world, ck, tied):
    """load_state_dict(sharded_sd, assign=True) on a meta-device model: the assigned DTensors are
    the parameters from the lazy init on (test_rank0_broadcast_meta_device_init); a tied weight
    stays tied (its first place's assigned parameter)."""
    torch.manual_seed(42)
    make = TiedStack if tied else mlp_stack
    ref = make().double()
    with torch.device("meta"):
        model = make().double()
    if tied:
        for m in model.stack:
            fully_shard(m)
        fully_shard(model)
    else:
        _shard_stack(model)
    meta_sd = model.state_dict()
    sharded = {k: nn.Parameter(distribute_tensor(ref.state_dict()[k], v.device_mesh, v.placements))
               for k, v in meta_sd.items()}
    model.load_state_dict(sharded, assign=True)
    ck.true("the assigned DTensors are the parameters",
            all(p is sharded[n] for n, p in model.named_parameters()))
    if tied:  # the first forward ties them again
        with torch.no_grad():
            model(normal_batch(9, rank, (4, 8)))
        ck.true("the tied weight is one parameter again", model.out.weight is model.inp.weight)
        ck.equal("the names of the parameters, as the reference's", [n for n, _ in model.named_parameters()],
                 [n for n, _ in ref.named_parameters()])
        _reshard_all(model)
    against_ddp(ck, rank, world, model, ref, lambda s, r: normal_batch(s, r, (4, 8)))
    if not tied:
        ck.true("still the assigned DTensors after training",
                all(p is sharded[n] for n, p in model.named_parameters()))


@cell("to_after_first_forward", worlds=(2,))
def to_after_first_forward(rank, world, ck):
    """.to(dtype) after the first forward (FSDP2 re-reads its sharded parameters; ours hand them
    back from the engine and initialise a new one at the next forward): the parameters keep their
    identity (the optimizer keeps working) and train on as the reference does."""
    torch.manual_seed(42)
    model = MLPStack(*[MLP(8) for _ in range(3)])  # float32
    ref = copy.deepcopy(model).double()
    _shard_stack(model)
    with torch.no_grad():
        model(normal_batch(0, rank, (4, 8), torch.float32))
    before = list(model.parameters())
    model.to(torch.float64)
    ck.true("the same DTensor parameters, now float64 with float64 shards",
            all(p is q for p, q in zip(model.parameters(), before))
            and all(isinstance(p, DTensor) and p.dtype == torch.float64 and p.to_local().dtype == torch.float64
                    for p in model.parameters()))
    data = lambda s, r: normal_batch(s, r, (4, 8))  # noqa: E731
    pair = against_ddp(ck, rank, world, model, ref, data, steps=2)  # its zero_grad comes at a step's start
    # .to() with the last step's gradients attached (FSDP2's .grad is a DTensor Module._apply
    # converts): they are carried into the new engine, and the next backward accumulates onto them
    before = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    model.to(torch.float64)  # the same dtype: the engine is re-made from the same shards
    ck.true("after .to(), each parameter still holds its gradient",
            all(p.grad is not None for p in model.parameters()))
    for n, p in model.named_parameters():
        ck.close(f"after .to(): {n}.grad as before", p.grad, before[n], 0, 0)
    pair.run(1, lambda step, mb: data(step, rank), first=2)  # no zero_grad first: accumulates on both sides
    pair.run(1, lambda step, mb: data(step, rank), first=3)
    pair.check_params("after .to() between steps, gradients attached")
    # a dtype change converts the attached gradients too, as under FSDP2
    for m in (model, pair.ref_run):
        m(normal_batch(4, rank, (4, 8))).sum().backward()
    model.float()
    ck.true("after .float(), the gradients are float32 DTensors",
            all(isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32 for p in model.parameters()))
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        ck.close(f"after .float(): {n}.grad", p.grad, refs[n].grad.float())


class _Scaled(nn.Module):
    """An MLP times a 0-d parameter (replicated: its gradient is all-reduced, not reduce-scattered)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(8)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.mlp(x) * self.scale


@cell("to_with_replicated_grad", worlds=(2,))
def to_with_replicated_grad(rank, world, ck):
    """.to() while a replicated (0-d) parameter holds its gradient: the new engine could not start
    from it (its all-reduce would count it again), so the call raises and names the fix, and
    nothing was released: the model trains on after zero_grad + .to() as the reference does."""
    torch.manual_seed(42)
    model = _Scaled().double()
    ref = copy.deepcopy(model)
    fully_shard(model)
    model(normal_batch(0, rank, (4, 8))).sum().backward()
    said = outcome(lambda: model.to(torch.float64))
    ck.true(".to() with a replicated gradient attached raises at the call, naming zero_grad",
            said.startswith("RuntimeError") and "zero_grad(set_to_none=True)" in said and "scale" in said, said)
    model.zero_grad(set_to_none=True)
    model.to(torch.float64)
    against_ddp(ck, rank, world, model, ref, lambda s, r: normal_batch(s, r, (4, 8)), steps=2)


@cell("no_warmup_jvp[keep]", worlds=(2,), reshard=False)
@cell("no_warmup_jvp[reshard]", worlds=(2,), reshard=True)
def no_warmup_jvp(rank, world, ck, reshard):
    """Meta-device init, to_empty and initial values, then the first forward inside
    torch.func.jvp (no warm-up forward): the lazy init runs outside the transform."""
    ref = mlp_stack()
    with torch.device("meta"):
        model = mlp_stack()
    _shard_stack(model, reshard_after_forward=reshard)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(ref.get_parameter(name).detach(), p.device_mesh, p.placements))
    x, t = normal_batch(0, rank, (4, 8)), normal_batch(1, rank, (4, 8))
    out, tangent = torch.func.jvp(lambda inp: model(inp), (x,), (t,))
    ref_out, ref_tangent = torch.func.jvp(lambda inp: ref(inp), (x,), (t,))
    ck.close("jvp: the output", out, ref_out)
    ck.close("jvp: the tangent", tangent, ref_tangent)
    kept = [type(p) is nn.Parameter for p in model.parameters()]
    ck.true("after the jvp, the groups kept gathered hold their full parameters, the others their DTensors",
            all(kept) if not reshard else not any(kept), str(kept))
    _reshard_all(model)
    against_ddp(ck, rank, world, model, ref, lambda s, r: normal_batch(s, r, (4, 8)), steps=2)


@cell("compiled[reshard]", worlds=(2,), reshard=True)
@cell("compiled[keep]", worlds=(2,), reshard=False)
def compiled(rank, world, ck, reshard):
    """torch.compile of the model (the eager backend traces as inductor would): the hooks that
    register each group's parameters run eagerly between its graphs ([Note: compile] in
    _hooks.py), and it trains as the reference."""
    import torch._dynamo as dynamo
    model = mlp_stack()
    ref = copy.deepcopy(model)
    _shard_stack(model, reshard_after_forward=reshard)
    dynamo.reset()
    run = torch.compile(model, backend="eager")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        x = normal_batch(step, rank, (4, 8))
        loss, ref_loss = run(x).sum(), ref(x).sum()
        loss.backward()
        ref_loss.backward()
        average_grads(ref, world)
        ck.close(f"step {step}: loss", loss, ref_loss)
        ck.grads(f"step {step}", model, ref)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    ck.params("after training", model, ref)


KNOWN_GAPS = {  # cell -> how megatron_fsdp_c differs from FSDP2 there (strict xfails)
}


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys(), KNOWN_GAPS))
def test_lifecycle_behaviour(name, world):
    verify(CELLS, name, world)
