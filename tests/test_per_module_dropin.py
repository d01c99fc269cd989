"""The per-module API as frameworks see torch's FSDP2: our sharded modules are instances of torch's
FSDPModule (the gate torchtitan, Lightning, accelerate and torch.distributed.pipelining use), with
every public method of it; torch's own register_fsdp_forward_method and fully_shard.state() reach
our state (torch 2.13's fully_shard signature: test_per_module_signature.py).

Cells at world 2 (rank_grid), float64 against torch's FSDP2 on the same script (rtol 1e-9), or
against a single-process reference with averaged gradients.
"""
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from megatron_fsdp_c.per_module import FSDPModule, UnshardHandle

from support import rank_grid
from support.checks import RTOL

# Each public method of torch's FSDPModule and what ours does with it (docs/per_module.md: the per-method list).
NO_EFFECT = ["set_is_last_backward", "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params",
             "set_reduce_scatter_max_input_buffers", "set_separate_reduce_scatter_group", "set_unshard_in_backward"]
REFUSED = ["set_custom_all_gather", "set_custom_reduce_scatter", "set_symm_mem_for_comm"]


def test_every_public_method_of_torchs_fsdpmodule_is_ours():
    """Fails when torch adds a public method to FSDPModule that we do not override (it would fall
    through to torch's internals, which look for an FSDPState we do not have)."""
    assert issubclass(FSDPModule, TorchFSDPModule) and issubclass(UnshardHandle, torch.distributed.fsdp.UnshardHandle)
    names = {n for n in dir(TorchFSDPModule) if not n.startswith("__") and callable(getattr(TorchFSDPModule, n))}
    torch_own = {n for n in names if any(n in vars(k) for k in TorchFSDPModule.__mro__ if k is not object)}
    missing = sorted(n for n in torch_own if n not in vars(FSDPModule) and not n.startswith("__"))
    assert not missing, f"torch's FSDPModule methods not overridden by ours: {missing}"
    assert {"_get_fsdp_state", "_apply", "_set_unshard_async_op", "reset_iter_state"} <= set(vars(FSDPModule))


def mlp(d=8, n=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n)], nn.Linear(d, 2)).double()


def data(step, rank, d=8):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, d, generator=g, dtype=torch.float64)


def shard(model, impl, **kw):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from megatron_fsdp_c.per_module import fully_shard
    for block in model[:-1]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def full_grads(model):
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}


def full_params(model):
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


# -- the cells (run at world 2) --------------------------------------------------------------------

def isinstance_gate(rank, world):
    """torchtitan's disable_fsdp_gradient_division and Lightning/accelerate/pipelining's checks:
    isinstance of torch's FSDPModule; containers index back to their own class; UnshardHandle."""
    model = shard(mlp(), "ours")
    sharded = [m for m in model.modules() if isinstance(m, TorchFSDPModule)]
    handle = model[0].unshard(async_op=True)
    handle.wait()
    model[0].reshard()
    return dict(sharded=len(sharded), classes=sorted({type(m).__name__ for m in sharded}),
                sliced=type(model[0:2]).__name__, handle=isinstance(handle, torch.distributed.fsdp.UnshardHandle),
                mro_original=type(model).__mro__[type(model)._orig_cls_mro_index] is nn.Sequential)


def summed_loss(rank, world, impl):
    """torchtitan's loss: summed over the global tokens, gradient division switched off on every
    module the isinstance gate finds (set_gradient_divide_factor(1.0)): FSDP2's gradients, not half."""
    model = shard(mlp(), impl)
    for m in model.modules():
        if isinstance(m, TorchFSDPModule):
            m.set_gradient_divide_factor(1.0)
    out = {}
    for step in range(2):
        model(data(step, rank)).sum().backward()
        out[step] = full_grads(model)
        model.zero_grad()
    return out


def state_lookup(rank, world):
    """torch's composable state lookup (fully_shard.state, used by pipelining) and _get_fsdp_state
    find our TorchState; torch's fully_shard refuses a module ours sharded."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    model = shard(mlp(), "ours")
    state = torch_fully_shard.state(model)
    out = dict(found=type(state).__name__, same=state is model._get_fsdp_state(),
               groups=len(state._state_ctx.all_states))
    model(data(0, rank)).sum().backward()
    out["groups_after_init"] = len(torch_fully_shard.state(model)._state_ctx.all_states)
    try:
        torch_fully_shard(model[0])
        out["torch_again"] = "accepted"
    except AssertionError as e:
        out["torch_again"] = str(e)
    return out


class Generator(nn.Module):
    """A module with a method other than forward that runs it several times (generate-like)."""

    def __init__(self):
        super().__init__()
        self.body = mlp(n=2)

    def forward(self, x):
        return self.body(x)

    def generate(self, x, steps=3):
        outs = []
        for _ in range(steps):
            x = self(x)[:, :2].repeat(1, 4)
            outs.append(x)
        return torch.stack(outs)


def forward_method(rank, world, impl, register):
    """register_fsdp_forward_method (torch's, or ours) on a generate-like method, with grad and
    under no_grad; the same numbers as torch's FSDP2 running the same script."""
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register
    from megatron_fsdp_c.per_module import register_fsdp_forward_method as our_register
    torch.manual_seed(0)
    model = Generator()
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from megatron_fsdp_c.per_module import fully_shard
    for block in model.body[:-1]:
        fully_shard(block)
    fully_shard(model)
    (torch_register if register == "torch" else our_register)(model, "generate")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for step in range(2):
        y = model.generate(data(step, rank))
        y.square().sum().backward()
        opt.step()
        opt.zero_grad()
        out[f"y{step}"] = y.detach().clone()
    with torch.no_grad():
        out["no_grad"] = model.generate(data(5, rank))
    out["params"] = full_params(model)
    return out


def all_reduce_hook(rank, world, impl, with_stream=False):
    """set_all_reduce_hook on every sharded module: the hook doubles the reduced gradient shard in
    place; .grad follows, as in torch's FSDP2 (one syncing backward per step). with_stream: the
    hook is given a stream of the device (torch.cpu.Stream here: torch's test_custom_hook_custom_stream)
    and must run with it current."""
    model = shard(mlp(), impl)
    calls, on_stream = [], []
    stream = torch.get_device_module("cpu").Stream() if with_stream else None

    def hook(t):
        calls.append(t.numel())
        on_stream.append(torch.get_device_module("cpu").current_stream() is stream)
        t.mul_(2.0)
    for m in model.modules():
        if isinstance(m, TorchFSDPModule):
            m.set_all_reduce_hook(hook, stream=stream)
    model(data(0, rank)).sum().backward()
    return dict(grads=full_grads(model), calls=len(calls), on_stream=all(on_stream) if with_stream else None)


def accepted_and_refused(rank, world):
    """The methods with no effect here train the same; those naming mechanisms we lack raise."""
    model = shard(mlp(), "ours")
    ref = shard(mlp(), "ours")
    for name in NO_EFFECT:
        args = (2,) if name == "set_reduce_scatter_max_input_buffers" else (True,)
        getattr(model, name)(*args)
    model._set_unshard_async_op(True)
    model.set_allocate_memory_from_process_group_for_comm(False)
    out = {"refused": {}}
    for name in REFUSED + ["set_allocate_memory_from_process_group_for_comm"]:
        try:
            getattr(model, name)(True) if name.startswith("set_allocate") else getattr(model, name)(None)
            out["refused"][name] = "accepted"
        except NotImplementedError as e:
            out["refused"][name] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(2.0)
        ref.set_gradient_divide_factor(2.0)
    out["deprecated_warns"] = any("set_gradient_divide_factor" in str(w.message) for w in caught)
    for m in (model, ref):
        m(data(0, rank)).sum().backward()
    out["same"] = all(torch.equal(a, b) for a, b in zip(full_grads(model).values(), full_grads(ref).values()))
    return out


class Flaky(nn.Module):
    """Raises in forward, or in backward, when told (on every rank, as a user error would)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail = None

    def forward(self, x):
        if self.fail == "forward":
            raise ValueError("forward failed")
        y = self.lin(x)
        return _FailBackward.apply(y) if self.fail == "backward" else y


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("backward failed")


def reset_iter_state(rank, world):
    """After a forward or a backward raised on every rank, reset_iter_state on the root and the
    next step's gradients are a clean step's (against a model that never failed)."""
    from megatron_fsdp_c.per_module import fully_shard

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), Flaky(), nn.Linear(8, 2)).double()
        fully_shard(m[1])
        fully_shard(m)
        return m

    model, clean = build(), build()
    clean(data(0, rank)).sum().backward()
    clean.zero_grad()
    model(data(0, rank)).sum().backward()
    model.zero_grad()
    out = {}
    for where in ("forward", "backward"):
        model[1].fail = where
        try:
            model(data(1, rank)).sum().backward()
            out[where] = "no error"
        except ValueError as e:
            out[where] = str(e)
        model[1].fail = None
        model.reset_iter_state()
    try:
        model[1].reset_iter_state()
        out["non_root"] = "accepted"
    except RuntimeError as e:
        out["non_root"] = str(e)
    for m in (model, clean):
        m(data(2, rank)).sum().backward()
    out["grads"], out["clean"] = full_grads(model), full_grads(clean)
    return out


def after_a_failed_backward(rank, world, api, compiled=False):
    """[Note: a backward that raised] in megatron_fsdp_c/_hooks.py: a backward raises on every rank
    part way (the last layer's gradient delivered), the script catches it and goes on -- a
    microbatch with gradient sync off, then a synced one and optimizer steps -- with no
    reset_iter_state or zero_grad. Ours trains on, bit for bit with the same script that never
    failed: the failed step's gradients are dropped, none reaches a step. (torch's FSDP2 is no reference here: after a raising backward its modules keep
    their unsharded parameters and stop training, the losses flat from then on, on torch 2.13.)
    compiled: the same through torch.compile (AOTAutograd's graphs, backend aot_eager): the user
    sees the backward's own exception, not an engine error of the next call (on torch 2.11 the
    per-module API once answered inductor's failing float64 backward with "gradient sync cannot
    change inside a backward pass")."""
    import megatron_fsdp_c as mf
    from megatron_fsdp_c.per_module import fully_shard

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), Flaky(), Flaky(), nn.Linear(8, 2)).double()
        if api == "per_module":
            for block in (m[1], m[2]):
                fully_shard(block)
            fully_shard(m)
            return m, m, torch.optim.AdamW(m.parameters(), lr=1e-2)
        wrapped, opt = mf.fully_shard(m, torch.optim.AdamW(m.parameters(), lr=1e-2), fsdp_unit_modules=[Flaky])
        return wrapped, m, opt

    out = {}
    for which in ("failed", "clean"):
        model, inner, opt = build()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        seen = []
        if which == "failed":
            inner[2].fail = "backward"
            try:
                run(data(0, rank)).sum().backward()
                out["error"] = "no error"
            except ValueError as e:
                out["error"] = str(e)
            inner[2].fail = None
        for step in range(1, 4):
            if api == "per_module":  # a microbatch accumulated locally, then a synced one
                model.set_requires_gradient_sync(False)
                run(data(step, rank)).sum().backward()
                model.set_requires_gradient_sync(True)
            else:
                with model.no_sync():
                    run(data(step, rank)).sum().backward()
            run(data(10 + step, rank)).sum().backward()
            opt.step()
            opt.zero_grad()
            seen.append({n: p.full_tensor().clone() for n, p in model.named_parameters()})
        out[which] = seen
    return out


def failed_backward_that_stepped(rank, world):
    """A backward raises after FusedAdamW(step_in_backward=True) stepped a bucket in it: the next
    call (the forward) says so, once, and training goes on (the optimizer steps every parameter
    afresh at its next step)."""
    import megatron_fsdp_c as mf
    from megatron_fsdp_c.per_module import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), Flaky(), Flaky(), Flaky(), nn.Linear(8, 2)).double()
    for block in m[1:4]:
        fully_shard(block)
    fully_shard(m)
    opt = mf.FusedAdamW(m.parameters(), lr=1e-2, step_in_backward=True)
    out = {}
    m[1].fail = "backward"  # the third unit's backward raises: the last one's bucket was stepped by then
    try:
        m(data(0, rank)).sum().backward()
    except ValueError as e:
        out["error"] = str(e)
    m[1].fail = None
    try:
        m(data(1, rank))
        out["next"] = "no error"
    except RuntimeError as e:
        out["next"] = str(e)
    before = {n: p.full_tensor().clone() for n, p in m.named_parameters()}
    for step in range(2, 4):
        m(data(step, rank)).sum().backward()
        opt.step()
        opt.zero_grad()
    out["moved"] = all(not torch.equal(p.full_tensor(), before[n]) for n, p in m.named_parameters())
    return out


def _register():
    add = CELLS.add
    add("gate", isinstance_gate, tests=["test_isinstance_gate"])
    add("lookup", state_lookup, tests=["test_torch_state_lookup_finds_ours"])
    add("accepted", accepted_and_refused, tests=["test_methods_without_effect_and_refused_ones"])
    add("reset", reset_iter_state, tests=["test_reset_iter_state_after_a_failed_forward_or_backward"])
    add("failed_stepped", failed_backward_that_stepped, tests=["test_a_failed_backward_that_stepped_says_so"])
    for api in ("per_module", "megatron"):
        for compiled in (False, True):
            add(("failed_backward", api, compiled), after_a_failed_backward, api, compiled,
                tests=["test_training_goes_on_after_a_failed_backward"], match=dict(api=api, compiled=compiled))
    for impl in ("torch", "ours"):
        add(("summed", impl), summed_loss, impl, tests=["test_summed_loss_gets_fsdp2s_gradients"])
        add(("hook", impl), all_reduce_hook, impl, tests=["test_all_reduce_hook_matches_fsdp2"])
        add(("hook_stream", impl), all_reduce_hook, impl, True, tests=["test_all_reduce_hook_on_a_given_stream"])
        for register in ("torch", "ours"):
            if impl == "ours" or register == "torch":
                # torch's run is every `register` parameter's reference
                add(("method", impl, register), forward_method, impl, register,
                    tests=["test_forward_method_like_generate"], match={} if impl == "torch" else {"register": register})


CELLS = rank_grid.Cells(__name__)
_register()


def _cell(key):
    return CELLS.result(key, 2)


def close_dicts(a, b, what, rtol=RTOL):
    assert set(a) == set(b), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=0, msg=lambda m: f"{what} {k}: {m}")


def test_isinstance_gate():
    for r in _cell("gate"):
        assert r["sharded"] == 4 and r["classes"] == ["FSDPSequential"], r
        assert r["sliced"] == "Sequential" and r["handle"] and r["mro_original"], r


def test_summed_loss_gets_fsdp2s_gradients():
    """torchtitan's set_gradient_divide_factor(1.0) through the isinstance gate reaches us."""
    for theirs, ours in zip(_cell(("summed", "torch")), _cell(("summed", "ours"))):
        for step in theirs:
            close_dicts(ours[step], theirs[step], f"step {step} grads")


def test_torch_state_lookup_finds_ours():
    """Fails if torch changes its composable-state lookup (pipelining's fully_shard.state)."""
    for r in _cell("lookup"):
        assert r["found"] == "TorchState" and r["same"], r
        assert r["groups"] == 1 and r["groups_after_init"] == 4, r
        assert "can only be applied to a module once" in r["torch_again"], r


@pytest.mark.parametrize("register", ["torch", "ours"])
def test_forward_method_like_generate(register):
    for theirs, ours in zip(_cell(("method", "torch", "torch")), _cell(("method", "ours", register))):
        close_dicts({k: v for k, v in ours.items() if k != "params"}, {k: v for k, v in theirs.items() if k != "params"},
               "outputs")
        close_dicts(ours["params"], theirs["params"], "params")


def test_all_reduce_hook_matches_fsdp2():
    for theirs, ours in zip(_cell(("hook", "torch")), _cell(("hook", "ours"))):
        close_dicts(ours["grads"], theirs["grads"], "grads")
        assert ours["calls"] == theirs["calls"] == 4, (ours["calls"], theirs["calls"])


def test_all_reduce_hook_on_a_given_stream():
    for theirs, ours in zip(_cell(("hook_stream", "torch")), _cell(("hook_stream", "ours"))):
        close_dicts(ours["grads"], theirs["grads"], "grads")
        assert ours["calls"] == theirs["calls"] == 4, (ours["calls"], theirs["calls"])
        assert ours["on_stream"] and theirs["on_stream"], (ours["on_stream"], theirs["on_stream"])


def test_methods_without_effect_and_refused_ones():
    for r in _cell("accepted"):
        assert r["same"] and r["deprecated_warns"], r
        for name, message in r["refused"].items():
            assert message != "accepted" and name in message, (name, message)


def test_reset_iter_state_after_a_failed_forward_or_backward():
    for r in _cell("reset"):
        assert r["forward"] == "forward failed" and r["backward"] == "backward failed", r
        assert "must be called on the root" in r["non_root"], r
        close_dicts(r["grads"], r["clean"], "grads after reset")


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("api", ["per_module", "megatron"])
def test_training_goes_on_after_a_failed_backward(api, compiled):
    for r in _cell(("failed_backward", api, compiled)):
        assert r["error"] == "backward failed", r["error"]
        for step, (failed, clean) in enumerate(zip(r["failed"], r["clean"])):
            assert set(failed) == set(clean)
            for k in failed:
                assert torch.equal(failed[k], clean[k]), f"step {step + 1} {k}"
        last = [k for k in r["clean"][0] if k.endswith("3.weight")][0]
        assert not torch.equal(r["clean"][0][last], r["clean"][-1][last])  # it trains


def test_a_failed_backward_that_stepped_says_so():
    for r in _cell("failed_stepped"):
        assert r["error"] == "backward failed", r
        assert "already stepped 1 bucket(s)" in r["next"] and "cannot be taken back" in r["next"], r["next"]
        assert r["moved"], r
