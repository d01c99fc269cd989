"""The engine refuses misuse from Python with exceptions, never a crash: bad arguments and calls
out of order, the engine closed while a call's arguments convert, and any call while one runs
([Note: engine calls] in csrc/python/engine.c)."""
import sys

import pytest
import torch

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.testing import GPT, Block, batch

from support import rank_grid
from test_reliability import CFG

CELLS = rank_grid.Cells(__name__)


# -- the engine refuses misuse with exceptions, never a crash ------------------------------------

@CELLS.cell("misuse", tests=["test_engine_misuse_raises"])
def misuse_worker(rank, world):
    torch.manual_seed(0)
    fsdp, _ = mf.fully_shard(GPT(CFG), fsdp_unit_modules=[Block])
    engine = fsdp.param_buffer.engine
    seen = {}

    def attempt(name, fn):
        try:
            fn()
            seen[name] = "no error"
        except Exception as e:  # noqa: BLE001
            seen[name] = f"{type(e).__name__}: {e}"

    attempt("grad outside backward", lambda: engine.grad_ready(0, 0, torch.zeros(4)))
    engine.begin_backward(False)
    attempt("grad not a tensor", lambda: engine.grad_ready(0, 0, "grad"))
    attempt("grad wrong size", lambda: engine.grad_ready(0, 0, torch.zeros(3)))
    attempt("grad non-contiguous", lambda: engine.grad_ready(0, 0, torch.zeros(4, 4).t()))
    attempt("grad complex", lambda: engine.grad_ready(0, 0, torch.zeros(4, dtype=torch.complex64)))
    attempt("bucket out of range", lambda: engine.grad_ready(10_000, 0, torch.zeros(4)))
    attempt("begin twice", lambda: engine.begin_backward(True))
    engine.end_backward()
    attempt("unshard garbage", lambda: engine.unshard(["x"]))
    attempt("tensor kind out of range", lambda: engine.tensor(0, 99))
    attempt("wait_grads bucket out of range", lambda: engine.wait_grads(10_000))
    attempt("engine built by hand, bad spec", lambda: _C.Engine([{"shards": 1}], 1, 0, 1.0, "sum", 1, torch.device("cpu"),
                                                              fsdp.dist_ctx.transport))
    attempt("engine with a bad transport", lambda: _C.Engine([], 1, 0, 1.0, "sum", 1, torch.device("cpu"), object()))
    attempt("unknown reduce op", lambda: _C.Engine([], 1, 0, 1.0, "max", 1, torch.device("cpu"),
                                                   fsdp.dist_ctx.transport))
    attempt("still trains", lambda: fsdp(*batch(CFG, 2, seed=rank)).backward())
    return seen


EXPECTED = {
    "grad outside backward": "outside a backward",
    "grad not a tensor": "TypeError",
    "grad wrong size": "elements",
    "grad non-contiguous": "contiguous",
    "grad complex": "not supported",
    "bucket out of range": "out of range",
    "begin twice": "inside a backward",
    "unshard garbage": "TypeError",
    "tensor kind out of range": "IndexError",
    "wait_grads bucket out of range": "IndexError: bucket 10000",
    "engine built by hand, bad spec": "missing",
    "engine with a bad transport": "TorchTransport",
    "unknown reduce op": "'sum' or 'avg'",
    "still trains": "no error",
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_engine_misuse_raises(case):
    seen = CELLS.result("misuse", 2)[0]
    assert EXPECTED[case] in seen[case], seen[case]


# -- [Note: engine calls] in csrc/python/engine.c: the engine is checked right before each pipeline
# call, after its arguments are converted, and refuses every call while one is running ----------

class _ClosesEngine:
    """An id or flag whose conversion closes the engine first, as any Python code that runs while
    an argument is converted (__index__, __bool__) may."""

    def __init__(self, engine):
        self.engine = engine

    def __index__(self):
        self.engine.close()
        return 0

    def __bool__(self):
        self.engine.close()
        return True


CLOSED_WHILE_CONVERTING = {
    "unshard": lambda e, c: e.unshard([c]),
    "wait_unshard": lambda e, c: e.wait_unshard([c]),
    "reshard": lambda e, c: e.reshard([c]),
    "seal": lambda e, c: e.seal([c]),
    "set_reduce_order": lambda e, c: e.set_reduce_order([c]),
    "begin_backward": lambda e, c: e.begin_backward(c),
    "install_main_weights": lambda e, c: e.install_main_weights(c),
    "grad_ready": lambda e, c: e.grad_ready(c, 0, torch.zeros(4)),
    "init_begin": lambda e, c: e.init_begin(c),
    "init_end": lambda e, c: e.init_end(c),
    "set_item": lambda e, c: e.set_item(c, 0, torch.zeros(4)),
    "set_local": lambda e, c: e.set_local(c, 0, torch.zeros(4)),
    "zero_item_grads": lambda e, c: e.zero_item_grads(0, [c]),
    "wait_grads": lambda e, c: e.wait_grads(c),
    "finish_grads": lambda e, c: e.finish_grads(c),
    "set_hold": lambda e, c: e.set_hold([c], True),
    "set_outer_hold": lambda e, c: e.set_outer_hold([c], True),
    "set_prescale": lambda e, c: e.set_prescale([c], 1.0),
    "set_trainable": lambda e, c: e.set_trainable(0, [0], c),
    "release_grads": lambda e, c: e.release_grads([c]),
    "count_nonfinite_grad": lambda e, c: e.count_nonfinite_grad(c, 0),
    "tensor": lambda e, c: e.tensor(c, _C.BUF_WEIGHT),
    "local_piece": lambda e, c: e.local_piece(c, 0, _C.BUF_MAIN_SHARD),
    "weight_state": lambda e, c: e.weight_state(c),
    "grad_state": lambda e, c: e.grad_state(c),
    "stats": lambda e, c: e.stats(c),
}

# Every method with valid arguments, called while the engine's own call is running.
WHILE_A_CALL_RUNS = {
    "unshard": lambda e: e.unshard([0]),
    "wait_unshard": lambda e: e.wait_unshard([0]),
    "reshard": lambda e: e.reshard([0]),
    "seal": lambda e: e.seal([0]),
    "set_reduce_order": lambda e: e.set_reduce_order([0]),
    "begin_backward": lambda e: e.begin_backward(True),
    "end_backward": lambda e: e.end_backward(),
    "sync_grads": lambda e: e.sync_grads(),
    "zero_grads": lambda e: e.zero_grads(),
    "drain": lambda e: e.drain(),
    "install_main_weights": lambda e: e.install_main_weights(),
    "grad_ready": lambda e: e.grad_ready(0, 0, torch.zeros(4)),
    "init_begin": lambda e: e.init_begin(0),
    "init_end": lambda e: e.init_end(0),
    "set_item": lambda e: e.set_item(0, 0, torch.zeros(4)),
    "set_local": lambda e: e.set_local(0, 0, torch.zeros(4)),
    "set_comm_dtype": lambda e: e.set_comm_dtype(None),
    "zero_item_grads": lambda e: e.zero_item_grads(0, [0]),
    "finish_grads": lambda e: e.finish_grads(0),
    "wait_grads": lambda e: e.wait_grads(0),  # by design beside a running call (an optimizer's worker)
    "set_hold": lambda e: e.set_hold([0], True),
    "set_outer_hold": lambda e: e.set_outer_hold([0], True),
    "set_prescale": lambda e: e.set_prescale([0], 0.5),
    "set_trainable": lambda e: e.set_trainable(0, [0], True),
    "release_grads": lambda e: e.release_grads([0]),
    "count_nonfinite_grad": lambda e: e.count_nonfinite_grad(0, 0),
    "tensor": lambda e: e.tensor(0, _C.BUF_WEIGHT),
    "local_piece": lambda e: e.local_piece(0, 0, _C.BUF_MAIN_SHARD),
    "weight_state": lambda e: e.weight_state(0),
    "grad_state": lambda e: e.grad_state(0),
    "stats": lambda e: e.stats(),
    "close": lambda e: e.close(),
    "broken": lambda e: e.broken,
    "num_buckets": lambda e: e.num_buckets,
}


def _outcome(fn):
    try:
        return f"ok: {fn()!r}"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


@CELLS.cell("engine calls", worlds=(1,), tests=["test_engine_closed_while_arguments_convert_raises",
                                               "test_engine_refuses_calls_while_a_call_runs"])
def engine_calls_worker(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD

    def engine():
        # one float32 parameter of 4 elements, ZeRO-3; force_comm: collectives at world 1 too
        spec = _C.plan([(4, 1, 0, 0, True, False)], 1, 0, 0, 16)[0]
        spec.update(param_dtype=0, main_dtype=0, grad_dtype=0, comm_dtype=0, weights_sharded=1, weights_regather=0,
                    grad_mode=_C.GRAD_SCATTER_ACCUMULATE)
        e = _C.Engine([spec], 1, 0, 1.0, "sum", 1 << 20, torch.device("cpu"), _C.TorchTransport(group, group), True)
        e.init_begin(0)
        e.set_item(0, 0, torch.arange(4.0))
        e.init_end(0)
        return e

    closed = {}
    for name, call in CLOSED_WHILE_CONVERTING.items():
        e = engine()
        closed[name] = _outcome(lambda: call(e, _ClosesEngine(e)))

    # The torch transport calls torch.distributed's Python collectives from inside the pipeline
    # call; a profile hook (as a profiler or tracer installs) runs there, with the call running.
    e = engine()
    during = {}

    def hook(frame, event, arg):
        if event == "call" and not during:
            sys.setprofile(None)
            for name, call in WHILE_A_CALL_RUNS.items():
                during[name] = _outcome(lambda: call(e))

    sys.setprofile(hook)
    try:
        e.unshard([0])
    finally:
        sys.setprofile(None)
    e.wait_unshard([0])
    after = (e.weight_state(0), e.tensor(0, _C.BUF_WEIGHT).tolist())
    return closed, during, after


@pytest.mark.parametrize("method", list(CLOSED_WHILE_CONVERTING))
def test_engine_closed_while_arguments_convert_raises(method):
    closed, _, _ = CELLS.result("engine calls", 1)[0]
    assert closed[method] == "RuntimeError: Engine is not initialised or was closed", closed[method]


@pytest.mark.parametrize("method", list(WHILE_A_CALL_RUNS))
def test_engine_refuses_calls_while_a_call_runs(method):
    _, during, after = CELLS.result("engine calls", 1)[0]
    expected = {"close": "RuntimeError: Engine.close() while another call is running",
                "broken": "ok: None", "num_buckets": "ok: 1", "wait_grads": "ok: None"}
    assert during[method] == expected.get(
        method, "RuntimeError: Engine re-entered from another thread or a callback; calls must not overlap")
    assert after == ("ready", [0.0, 1.0, 2.0, 3.0])  # the running call finished, unharmed
