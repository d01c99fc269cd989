"""megatron_fsdp_c.FusedAdam/FusedAdamW on one process: torch's AdamW's numbers, schedules, param
groups and state dicts ([Note: the fused optimizer] in megatron_fsdp_c/fused_adam.py). Every
strategy at worlds 1, 2 and 4 is in test_parity.py ("fused_adamw")."""
import itertools
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C


def two_layer(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(67, 33), nn.Tanh(), nn.Linear(33, 5)).to(dtype)


def groups_of(model):
    """Two groups with their own lr, weight decay and betas."""
    return [dict(params=model[0].parameters(), lr=1e-2, weight_decay=0.1),
            dict(params=model[2].parameters(), lr=3e-3, weight_decay=0.0, betas=(0.8, 0.99))]


def train(model, opt, steps, start=0):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # reads group["lr"] at each step
    for _ in range(start):
        sched.step()
    for s in range(start, start + steps):
        x = torch.randn(8, 67, dtype=next(model.parameters()).dtype, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        sched.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rel(a, b):
    return ((a - b).abs() / b.abs().clamp_min(1e-300)).max().item()


VARIANTS = [dict(), dict(amsgrad=True), dict(maximize=True)]


@pytest.mark.parametrize("kw", VARIANTS, ids=["adamw", "amsgrad", "maximize"])
@pytest.mark.parametrize("ref_kw", [dict(foreach=False), dict(fused=True)], ids=["default", "fused"])
def test_float64_matches_torch(kw, ref_kw):
    """20 steps, an LR schedule, weight decay, two param groups: within 1e-12 of torch's AdamW."""
    ours = train(m := two_layer(torch.float64), mf.FusedAdamW(groups_of(m), **kw), 20)
    ref = train(m := two_layer(torch.float64), torch.optim.AdamW(groups_of(m), **kw, **ref_kw), 20)
    assert rel(ours, ref) < 1e-12


def test_adam_with_coupled_weight_decay():
    ours = train(m := two_layer(torch.float64), mf.FusedAdam(groups_of(m)), 20)
    ref = train(m := two_layer(torch.float64), torch.optim.Adam(groups_of(m), foreach=False), 20)
    assert rel(ours, ref) < 1e-12


def test_float32_within_rounding():
    """The same gradients each step (so the runs cannot drift apart through the model): the
    moments equal torch's, the parameters differ where torch's MKL sqrt rounds otherwise ([Note:
    fused Adam]), by a few float32 ulps after 20 steps."""
    torch.manual_seed(0)
    p0 = torch.randn(10_007)
    grads = [torch.randn(10_007) for _ in range(20)]
    out = []
    for make in (lambda ps: mf.FusedAdamW(ps, lr=1e-2, weight_decay=0.1),
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)):
        p = nn.Parameter(p0.clone())
        opt = make([p])
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out.append((p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))
    (p, m, v), (rp, rm, rv) = out
    torch.testing.assert_close(m, rm, rtol=2 ** -23, atol=0)
    torch.testing.assert_close(v, rv, rtol=2 ** -23, atol=0)
    # in float32 ulps of the parameter, or of 0.1 (ten steps of lr) where it is near zero; measured
    # on torch 2.13: 2 (1.2e-7 at 0.97), in 334 of 10007 elements
    ulps = ((p - rp).abs() / torch.finfo(torch.float32).eps / rp.abs().clamp_min(0.1)).max().item()
    assert ulps <= 4, ulps


def _three_amsgrad_steps(threads):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(70_001))  # two threads split from 2 * 32768 elements on
    opt = mf.FusedAdamW([p], lr=1e-2, amsgrad=True, threads=threads)
    for _ in range(3):
        p.grad = torch.randn(70_001)
        opt.step()
    return p.detach()


def test_threads_and_simd_paths_give_the_same_bits(tmp_path):
    """Elementwise work: 1 or 2 threads, the widest SIMD path here or the portable loop (another
    process: the path is chosen once), the same bits."""
    one, two = _three_amsgrad_steps(1), _three_amsgrad_steps(2)
    script = ("import sys, torch; sys.path.insert(0, sys.argv[2]); from test_fused_adam import _three_amsgrad_steps\n"
              "from megatron_fsdp_c import _C; assert _C.adam_isa() == 'portable'\n"
              "torch.save(_three_amsgrad_steps(2), sys.argv[1])\n")
    path = str(tmp_path / "portable.pt")
    subprocess.run([sys.executable, "-c", script, path, os.path.dirname(__file__)], check=True,
                   env=dict(os.environ, MFSDP_ADAM_ISA="portable"))
    assert torch.equal(one, two) and torch.equal(one, torch.load(path))


def test_the_step_runs_on_torchs_openmp_runtime():
    """[Note: the step's threads] in csrc/core/adam_cpu.c: one libgomp in the process, and where
    torch runs on OpenMP it is torch's own, so the step's threads are torch's team, not a second
    pool fighting it for the cores."""
    # A thread that never ran torch's work: its step's second thread is a team member that
    # outlives the step (an OpenMP team), not a thread made and joined for it.
    n = 4 * 32768
    p, g, m, v = (torch.rand(n) for _ in range(4))
    step = torch.zeros(1)
    seen = {}

    def fresh():
        before = len(os.listdir("/proc/self/task"))
        _C.adam_step_([p], [g], [m], [v], None, [step], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False, True, 2)
        seen["team"] = len(os.listdir("/proc/self/task")) - before

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    assert step.item() == 1 and seen["team"] == 1, seen
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    assert len(gomp) == 1, f"the process maps {len(gomp)} OpenMP runtimes: {sorted(gomp)}"
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
        (path,) = gomp
        assert os.path.dirname(os.path.realpath(path)) == torch_lib, (path, torch_lib)


def test_bf16_gradients_and_the_compute_copy():
    """bf16 gradients are read upcast; the compute copy is the updated parameter rounded to bf16."""
    torch.manual_seed(0)
    p, g = torch.randn(1001), torch.randn(1001).bfloat16()
    a, b = p.clone(), p.clone()
    states = [[torch.zeros(1001) for _ in range(2)] for _ in range(2)]
    copy = torch.empty(1001, dtype=torch.bfloat16)
    _C.adam_step_([a], [g], [states[0][0]], [states[0][1]], None, [torch.tensor(0.0)], 1e-2, 0.9, 0.999, 1e-8, 0.1, False, False,
                  True, 1, [copy])
    _C.adam_step_([b], [g.float()], [states[1][0]], [states[1][1]], None, [torch.tensor(0.0)], 1e-2, 0.9, 0.999, 1e-8, 0.1, False,
                  False, True, 1)
    assert torch.equal(a, b) and torch.equal(copy, b.bfloat16())


@pytest.mark.parametrize("first", ["ours", "torch"])
def test_state_dict_moves_between_it_and_torch(first):
    """Five steps with one, its state_dict loaded into the other, five more: as ten with one."""
    make = {"ours": mf.FusedAdamW, "torch": lambda g: torch.optim.AdamW(g, foreach=False)}
    second = "torch" if first == "ours" else "ours"
    m = two_layer(torch.float64)
    opt = make[first](groups_of(m))
    train(m, opt, 5)
    sd = opt.state_dict()
    torch_keys = set(torch.optim.AdamW(groups_of(two_layer(torch.float64))).param_groups[0]) | {"initial_lr"}
    assert set(sd["param_groups"][0]) == torch_keys
    moved = make[second](groups_of(m))
    moved.load_state_dict(sd)
    assert set(moved.state[m[0].weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert moved.state[m[0].weight]["step"].item() == 5
    after_move = train(m, moved, 5, start=5)
    m2 = two_layer(torch.float64)
    straight = train(m2, make[first](groups_of(m2)), 10)
    assert rel(after_move, straight) < 1e-12


def test_torch_state_dict_apis_and_dcp(tmp_path):
    """get/set_optimizer_state_dict and a DCP save/load, on a plain (unsharded) model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    m = two_layer(torch.float64)
    opt = mf.FusedAdamW(groups_of(m))
    train(m, opt, 3)
    sd = get_optimizer_state_dict(m, opt)
    dcp.save({"optim": sd}, checkpoint_id=str(tmp_path))
    fresh = mf.FusedAdamW(groups_of(m))
    m.zero_grad(set_to_none=True)
    target = {"optim": get_optimizer_state_dict(m, fresh)}  # torch makes the states with a zero-lr step
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(m, fresh, target["optim"])
    for p in m.parameters():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[p][k], opt.state[p][k])


def test_refusals_name_the_problem():
    p = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    p.grad = torch.randn(4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 and float64 parameters"):
        mf.FusedAdamW([p]).step()
    q = nn.Parameter(torch.randn(4, 4).t())
    q.grad = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        mf.FusedAdamW([q]).step()
    with pytest.raises(ValueError, match="betas"):
        mf.FusedAdamW([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="threads"):
        mf.FusedAdamW([p], threads=0)
    with pytest.raises(ValueError, match="capturable"):
        mf.FusedAdamW([p], capturable=True)
    mf.FusedAdamW([p], fused=True, foreach=False)  # torch's arguments a script may pass along
    if hasattr(nn.Parameter(torch.randn(1)), "grad_dtype"):  # torch >= 2.13 lets a gradient's dtype differ
        w = nn.Parameter(torch.randn(4, dtype=torch.float64))
        w.grad_dtype = None
        w.grad = torch.randn(4)
        with pytest.raises(RuntimeError, match="float32 gradient"):
            mf.FusedAdamW([w]).step()
    e = nn.Embedding(10, 3, sparse=True)
    e(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        mf.FusedAdamW(e.parameters()).step()
    # a refused group changes no state: the next step starts from step 1
    r = nn.Parameter(torch.randn(4))
    opt = mf.FusedAdamW([{"params": [r]}, {"params": [p]}])
    r.grad = torch.randn(4)
    with pytest.raises(RuntimeError):
        opt.step()
    assert opt.state[r]["step"].item() == 1 and p not in opt.state
    with pytest.raises(ValueError, match="elements"):
        _C.adam_step_([torch.zeros(3)], [torch.zeros(4)], [torch.zeros(3)], [torch.zeros(3)], None, [torch.tensor(0.0)],
                      1e-3, 0.9, 0.999, 1e-8, 0.0, False, False, True, 1)
    # the step counters: state["step"] tensors, advanced by the C step only when it succeeded
    count = torch.tensor(4.0)
    with pytest.raises(_C.EngineError, match="out of range"):
        _C.adam_step_([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], None, [count], -1.0,
                      0.9, 0.999, 1e-8, 0.0, False, False, True, 1)
    assert count.item() == 4.0
    for bad, error, match in ((1, TypeError, "steps: expected a torch.Tensor, got int"),
                              (torch.zeros(2), ValueError, "one-element float32 or float64 host tensor"),
                              (torch.tensor(2.5), ValueError, "holds 2.5, not a step count")):
        with pytest.raises(error, match=match):
            _C.adam_step_([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], None, [bad], 1e-3,
                          0.9, 0.999, 1e-8, 0.0, False, False, True, 1)
    _C.adam_step_([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], None, [count], 1e-3, 0.9,
                  0.999, 1e-8, 0.0, False, False, True, 1)
    assert count.item() == 5.0


def test_version_counters_move():
    """Written from C, but in place as far as autograd and the per-module API can tell."""
    p = nn.Parameter(torch.randn(8))
    p.grad = torch.randn(8)
    opt = mf.FusedAdamW([p])
    before = p._version
    opt.step()
    assert p._version > before


def test_jitter_switch():
    """[Note: jitter at the hand-offs]: without MFSDP_TEST_JITTER_MS the pauses are a no-op; with it
    they sleep up to that many milliseconds, the same draws for the same seed."""
    import subprocess
    import sys

    code = ("import time; from megatron_fsdp_c import _jitter as j; print(j.ENABLED_MS, j.pause.__name__); "
            "j.seed(3); t = time.perf_counter(); [j.pause('s') for _ in range(20)]; "
            "print(time.perf_counter() - t)")
    env = {k: v for k, v in os.environ.items() if k != "MFSDP_TEST_JITTER_MS"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    on = subprocess.run([sys.executable, "-c", code], env=dict(env, MFSDP_TEST_JITTER_MS="5"), capture_output=True,
                        text=True, check=True).stdout.split()
    assert off[:2] == ["0.0", "_nothing"]
    assert on[:2] == ["5.0", "_sleep"] and 0.01 < float(on[2]) < 5.0  # 20 draws of up to 5 ms (mean 50 ms)


def test_memory_replaced_under_the_step_raises():
    """[Note: memory under the step] in csrc/python/optim.c: the step lets the GIL go for its
    arithmetic; a tensor given other memory meanwhile (here set_: its old storage kept alive by
    `old`, so the step writes live memory) makes the step raise, naming the tensor, and leaves the
    step count as it was."""
    n = 1 << 23  # ~10-30 ms a step on one thread: the swap lands inside it
    grad, avg, sq, count = torch.ones(n), torch.zeros(n), torch.zeros(n), torch.tensor(0.0)
    inside = 0
    for _ in range(5):  # a try whose swap missed the step (a slow thread start) says nothing: again
        param, other = torch.zeros(n), torch.zeros(n)
        old = param.untyped_storage()
        started, times, errors = threading.Event(), {}, []

        def step():
            started.set()
            try:
                _C.adam_step_([param], [grad], [avg], [sq], None, [count], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, False,
                              True, 1, None, True)
            except RuntimeError as e:
                errors.append(str(e))
            times["end"] = time.perf_counter()

        before = count.item()
        worker = threading.Thread(target=step)
        worker.start()
        started.wait()
        time.sleep(0.002)
        param.set_(other)
        times["swap"] = time.perf_counter()
        worker.join()
        if times["swap"] + 0.002 >= times["end"]:  # not surely before the step's check
            continue
        inside += 1
        assert errors and "memory of params 0 was freed or replaced while the step ran" in errors[0], errors
        assert count.item() == before  # not advanced: the step did not succeed
        assert old.size() == 4 * n and param.abs().sum().item() == 0  # it wrote the old memory, not the new
    assert inside > 0, "no swap landed inside a step"
