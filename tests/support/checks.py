"""What multi-rank cells record and how their tests assert it (cells run in spawned ranks, the
assertions in the pytest process: see [Note: one spawn per world size] in rank_grid.py).

Two forms. A `Checks` recorder: a cell calls ck.close / ck.equal / ck.true / ck.raised / ck.grads /
ck.params on every rank and returns `ck.items`; the test calls `assert_recorded(per_rank)`. Or a
dict of named checks {name: (ok, message)} built with check_values / check_params; the test
calls `assert_named(per_rank)`. Either way a failure names the check, the rank and the numbers.

Tolerances: float64 where exactness matters (RTOL 1e-9: a wrong algorithm is off by ~1e-3,
reduction-order rounding by ~1e-14; see [Note: reduction order] in test_parity.py), or bit for
bit (rtol = atol = 0) where the sums run in the same order.
"""
from __future__ import annotations

import builtins
import math
from typing import Callable, Dict, List, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

RTOL, ATOL = 1e-9, 1e-12


def full(t):
    """A DTensor's full value (collective: every rank calls it for the same tensors)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def to_full(t):
    """A plain copy of a DTensor (collective) or a tensor: full_tensor() of a replicated DTensor is
    its local tensor itself, which the next backward overwrites."""
    return full(t).detach().clone()


def strip(name: str) -> str:
    """A parameter name without the wrappers' prefixes."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


# ------------------------------------------------------------------------------------------
# the recorder


def _snapshot(t):
    if isinstance(t, torch.Tensor):
        return full(t).detach().cpu().clone()
    if isinstance(t, (list, tuple)) and t and all(isinstance(v, (int, float)) for v in t):
        return torch.tensor(t, dtype=torch.float64)
    return t


class Checks:
    """What a cell asserts, recorded on every rank and asserted in the pytest process."""

    def __init__(self):
        self.items: List[tuple] = []

    def close(self, label: str, ours, ref, rtol: float = RTOL, atol: float = ATOL) -> None:
        self.items.append(("close", label, _snapshot(ours), _snapshot(ref), rtol, atol))

    def equal(self, label: str, ours, ref) -> None:
        self.items.append(("equal", label, _snapshot(ours), _snapshot(ref), 0.0, 0.0))

    def true(self, label: str, cond: bool, detail: str = "") -> None:
        self.items.append(("true", label, bool(cond), detail, 0.0, 0.0))

    def raised(self, label: str, fn: Callable) -> None:
        """Runs fn and records what it raised (its type's name and message), for pytest.raises
        in the parent (see reraise)."""
        try:
            fn()
            self.items.append(("raised", label, "no error", "", 0.0, 0.0))
        except Exception as e:  # noqa: BLE001 - what the user sees
            self.items.append(("raised", label, type(e).__name__, str(e), 0.0, 0.0))

    def grads(self, label: str, model: nn.Module, ref: nn.Module, rtol: float = RTOL, atol: float = ATOL,
              ref_scale: float = 1.0) -> None:
        """Every parameter's gradient (gathered) against the reference's by name; None where the
        reference has None."""
        refs = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            r = refs[name]
            if r.grad is None or p.grad is None:
                self.true(f"{label}: {name}.grad is None in both", r.grad is None and p.grad is None,
                          f"ours {'None' if p.grad is None else 'set'}, reference {'None' if r.grad is None else 'set'}")
            else:
                self.close(f"{label}: {name}.grad", p.grad, r.grad * ref_scale, rtol, atol)

    def params(self, label: str, model: nn.Module, ref: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
        refs = dict(ref.named_parameters())
        names = [n for n, _ in model.named_parameters()]
        self.equal(f"{label}: parameter names", sorted(names), sorted(refs))
        for name, p in model.named_parameters():
            if name in refs:
                self.close(f"{label}: {name}", p, refs[name], rtol, atol)


# torch 2.12+ can move a storage's memory (UntypedStorage._swap_data_ptr_): [Note: local shards keep
# their storage] in megatron_fsdp_c/_common.py; torch 2.11 cannot.
TORCH_MOVES_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def cached_alias(ck: Checks, label: str, cached, param) -> None:
    """A DTensor taken (in a state dict) before the per-module API's engine was built, checked
    against the parameter now: on torch 2.12+ it aliases the parameter and holds its values; on
    torch 2.11 its storage was released with a message, so using it raises, naming the cause
    (local ops only there: ranks whose shard is empty have nothing to raise, and a collective
    would pair some ranks' errors with others' calls)."""
    local = cached.to_local()
    if TORCH_MOVES_STORAGE:
        ck.true(f"{label}: aliases the parameter", local.numel() == 0 or local.data_ptr() == param.to_local().data_ptr())
        ck.equal(f"{label}: holds the parameter's values", cached, param)
        return
    try:
        local.sum()
        got = "no error"
    except RuntimeError as e:
        got = str(e)
    ck.true(f"{label}: using it raises, naming the cause (torch {torch.__version__})",
            local.numel() == 0 or ("stale alias" in got and "after the first forward" in got), got)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} {value.flatten()[:6].tolist()}"
    return repr(value)


def failures_of(items) -> List[str]:
    out = []
    for kind, label, ours, ref, rtol, atol in items:
        if kind == "raised":
            continue  # asserted by the cell's test (see raised_by)
        if kind == "true":
            if not ours:
                out.append(f"{label}{': ' + ref if ref else ''}")
            continue
        if isinstance(ours, torch.Tensor) and isinstance(ref, torch.Tensor):
            if kind == "equal":
                if ours.shape != ref.shape or ours.dtype != ref.dtype or not torch.equal(ours, ref):
                    out.append(f"{label}: not bit-identical: ours {_describe(ours)} vs reference {_describe(ref)}")
                continue
            try:
                torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol, check_dtype=True)
            except AssertionError as e:
                out.append(f"{label} (rtol {rtol}, atol {atol}): {str(e).strip()}")
        elif ours != ref:
            out.append(f"{label}: ours {ours!r} != reference {ref!r}")
    return out


def assert_recorded(per_rank: List[list], what: str = "") -> None:
    """Every rank's recorded checks hold (the first 24 failures are listed)."""
    problems = [f"rank {rank}: {f}" for rank, items in enumerate(per_rank) for f in failures_of(items)]
    if problems:
        raise AssertionError(f"{what}:\n" + "\n".join(problems[:24])
                             + (f"\n... and {len(problems) - 24} more" if len(problems) > 24 else ""))


def outcome(fn: Callable) -> str:
    """What calling fn gives a user: "accepted", or the exception's type name and message."""
    try:
        fn()
        return "accepted"
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"


def raised_by(per_rank: List[list], label: str) -> List[Tuple[str, str]]:
    """(exception type name, message) that each rank recorded under `label` with Checks.raised."""
    out = []
    for items in per_rank:
        found = [(i[2], i[3]) for i in items if i[0] == "raised" and i[1] == label]
        assert found, f"{label}: not recorded"
        out.append(found[0])
    return out


def reraise(kind: str, message: str):
    """Raises the exception a rank reported (for pytest.raises in the parent)."""
    exc = getattr(builtins, kind, None)
    if not (isinstance(exc, type) and issubclass(exc, BaseException)):
        raise AssertionError(f"expected an exception, got {kind}: {message}")
    raise exc(message)


# ------------------------------------------------------------------------------------------
# named checks


def rel_excess(a: torch.Tensor, b: torch.Tensor, rtol=RTOL, atol=ATOL):
    """(worst |a-b| / (atol + rtol |b|), max |a-b|): > 1 means outside the tolerance."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a.shape != b.shape:
        return math.inf, math.inf
    if a.numel() == 0:
        return 0.0, 0.0
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = (a - b).abs().masked_fill(both_inf | both_nan, 0.0)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    excess = diff / (atol + rtol * b.abs().masked_fill(~torch.isfinite(b), 0.0))
    excess = excess.masked_fill(diff == 0, 0.0)  # also when rtol = atol = 0 (exact equality)
    return excess.max().item(), diff.max().item()


def check_values(name: str, ours: Sequence[float], ref: Sequence[float], rtol=RTOL, atol=ATOL):
    """A check entry: (ok, message) comparing two sequences of numbers."""
    a = torch.tensor([float(v) for v in ours], dtype=torch.float64)
    b = torch.tensor([float(v) for v in ref], dtype=torch.float64)
    if a.shape != b.shape:
        return False, f"{len(ours)} values vs DDP's {len(ref)}"
    excess, diff = rel_excess(a, b, rtol, atol)
    if excess <= 1:
        return True, f"max |diff| {diff:.3g}"
    return False, (f"{name} differ from DDP's by up to {diff:.3g} (rtol {rtol:g}): "
                   f"ours {[f'{v:.12g}' for v in a.tolist()]} vs DDP {[f'{v:.12g}' for v in b.tolist()]}")


def check_params(ours: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], rtol=RTOL, atol=ATOL):
    """A check entry comparing {name: tensor} dicts (names without the 'module.' prefix)."""
    ours = {strip(n): t for n, t in ours.items()}
    ref = {strip(n): t for n, t in ref.items()}
    if set(ours) != set(ref):
        return False, (f"parameter names differ: only ours {sorted(set(ours) - set(ref))[:5]}, "
                       f"only DDP's {sorted(set(ref) - set(ours))[:5]}")
    bad = []
    worst = 0.0
    for n in ref:
        excess, diff = rel_excess(ours[n], ref[n], rtol, atol)
        worst = max(worst, diff)
        if excess > 1:
            bad.append((diff, n))
    if not bad:
        return True, f"max |diff| {worst:.3g}"
    bad.sort(reverse=True)
    listed = ", ".join(f"{n} (max |diff| {d:.3g})" for d, n in bad[:4])
    return False, f"{len(bad)} of {len(ref)} parameters differ from DDP's: {listed}{' ...' if len(bad) > 4 else ''}"


def assert_named(per_rank: List[dict]) -> None:
    """Every rank's named checks passed; the message lists each failed check once (first rank
    that saw it)."""
    failed, short = {}, {}
    for rank, checks in enumerate(per_rank):
        for name, (ok, message) in checks.items():
            if not ok and name not in failed:
                failed[name] = f"[rank {rank}] {name}: {message}"
                first = message.splitlines()[0] if message else ""
                short[name] = f"{name} ({first[:100]}{'...' if len(first) > 100 else ''})"
    if failed:
        pytest.fail(f"{len(failed)} check(s) failed: {'; '.join(short.values())}\n\n" + "\n".join(failed.values()),
                    pytrace=False)


# ------------------------------------------------------------------------------------------
# cells that record


def recorder_cells(cells, tests=None):
    """A decorator registering recording cells in `cells` (a rank_grid.Cells):
    `@cell("name", worlds=(2, 4), **kwargs)` on fn(rank, world, ck, **kwargs) registers a cell
    that returns what fn recorded in ck, read by the tests `tests` (default: all of the module's)
    parametrized with name and world (see rank_grid.params)."""
    def cell(name, worlds=(2,), **kwargs):
        kwargs.setdefault("tests", tests)

        def register(fn):
            def run(rank, world, **kw):
                ck = Checks()
                fn(rank, world, ck, **kw)
                return ck.items
            cells.add(name, run, worlds=worlds, match=dict(name=name), **kwargs)
            return fn
        return register
    return cell


def verify(cells, name, world) -> None:
    """The recording cell `name` at `world`: every check held on every rank."""
    assert_recorded(cells.result(name, world), f"{name} at world {world}")
