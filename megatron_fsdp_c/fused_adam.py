"""FusedAdam and FusedAdamW: torch's Adam and AdamW as one C pass per parameter group on the CPU.

[Note: the fused optimizer]
An ordinary torch.optim.Optimizer: param groups, LR schedulers (each step reads
`group["lr"]`), step hooks, `state_dict()`/`load_state_dict()` and torch's optimizer state-dict
APIs behave as torch's AdamW's, with the same group keys and the same state ("step" a scalar
float tensor, "exp_avg", "exp_avg_sq" and with amsgrad "max_exp_avg_sq", each like its
parameter), so a checkpoint moves between it and torch.optim.AdamW both ways. The arithmetic is
[Note: fused Adam] in csrc/core/mfsdp_adam.h: torch's single-tensor order, elementwise, on
`threads` threads (default: torch.get_num_threads()).

It steps host memory only: float32 or float64 parameters (float32 with bf16/fp16 gradients
too). Under megatron_fsdp_c's fully_shard it steps the local shards ([Note: local-shard step]
in optimizer.py), so it runs in every strategy; a DTensor parameter of anything else is
stepped through its local tensor, as every Adam update is elementwise. With
`step_in_backward=True` it steps each bucket of a megatron_fsdp_c model inside the backward, as
the bucket's gradients land ([Note: stepping in backward] in _backward_step.py).
"""
from __future__ import annotations

import concurrent.futures
import math
from typing import Optional

import torch
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor

from . import _C
from ._backward_step import register_stepper
from ._extensions import values_of
from ._jitter import pause

__all__ = ["FusedAdam", "FusedAdamW"]


def _local(t):
    """The plain tensor the step writes: a DTensor's local tensor, or the values of an extension
    subclass (torchao's float8 and int8 training weights: [Note: extension parameters])."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t if type(t) in _PLAIN else values_of(t)  # (plain ones first: a step reads hundreds)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")


def _hyper(group) -> tuple:
    """A group's step hyperparameters, as the step reads them."""
    return tuple(float(group["lr"]) if k == "lr" else tuple(float(b) for b in group[k]) if k == "betas" else group[k]
                 for k in _HYPER)


def _fingerprint(grad: torch.Tensor) -> float:
    """A gradient's fingerprint: its norm, in its own precision (float32 for half types: a float64
    norm of float32 values costs 20x a float32 one). Version counters cannot tell (a DTensor's
    foreach ops, as torch's clip_grad_norm_ runs, bump no version of the local tensors)."""
    wide = torch.float32 if grad.dtype in (torch.bfloat16, torch.float16) else None
    return float(torch.linalg.vector_norm(grad, dtype=wide))


def _same_fingerprint(now: float, seen: float, dtype: torch.dtype) -> bool:
    """Equal up to a sum's rounding in another order (a thread count changed between): a change
    this small (a clipping coefficient this close to 1) changes no step beyond that rounding."""
    return math.isclose(now, seen, rel_tol=1e-12 if dtype == torch.float64 else 1e-6, abs_tol=0.0)


def _scalar_dtype():
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class FusedAdam(torch.optim.Optimizer):
    """torch.optim.Adam's arguments and semantics (decoupled_weight_decay=True is AdamW),
    stepped by the C kernel of [Note: fused Adam]. `threads`: threads of each step (None:
    torch.get_num_threads() at the step). `step_in_backward`: step each bucket of a megatron_fsdp_c
    model inside the backward, as its gradients land ([Note: stepping in backward] in
    _backward_step.py); optimizer.step() then steps the rest."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
                 threads: Optional[int] = None, step_in_backward: bool = False):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("FusedAdam: a tensor lr must have one element")
        if not 0.0 <= float(lr):
            raise ValueError(f"FusedAdam: invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"FusedAdam: invalid epsilon {eps}")
        if not (0.0 <= float(betas[0]) < 1.0 and 0.0 <= float(betas[1]) < 1.0):
            raise ValueError(f"FusedAdam: invalid betas {betas}: each must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"FusedAdam: invalid weight_decay {weight_decay}")
        if capturable or differentiable:
            raise ValueError("FusedAdam: capturable=True and differentiable=True are not supported (it steps host "
                             "memory in C); use torch.optim.AdamW for those")
        if threads is not None and threads < 1:
            raise ValueError(f"FusedAdam: threads must be >= 1 or None, got {threads}")
        if not isinstance(step_in_backward, bool):
            raise TypeError(f"FusedAdam: step_in_backward must be True or False, got {step_in_backward!r}")
        self.threads = threads
        self.step_in_backward = step_in_backward
        self._worker = None  # the thread of the steps taken in a backward, made at the first
        self._pending = []  # their futures, joined before anything reads what they write
        self._sealer = None  # the thread that fingerprints their gradients as they land, made with _worker
        self._sealing = []  # its futures, waited for at the backward's end (_seal)
        self._stepped = {}  # id(local gradient) -> [local gradient, its fingerprint, group hyperparameters]
        # torch's AdamW group keys, so that state dicts move between the two either way (foreach and
        # fused are accepted as torch's arguments and kept; the step is fused either way)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=False, differentiable=False, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        if step_in_backward:
            register_stepper(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("step_in_backward", False)
        self.__dict__.setdefault("_worker", None)
        self.__dict__.setdefault("_pending", [])
        self.__dict__.setdefault("_sealer", None)
        self.__dict__.setdefault("_sealing", [])
        self.__dict__.setdefault("_stepped", {})
        for group in self.param_groups:
            for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None), ("capturable", False),
                               ("differentiable", False), ("fused", None),
                               ("decoupled_weight_decay", isinstance(self, FusedAdamW))):
                group.setdefault(key, value)

    def _tensors(self, group, pairs):
        """The stepping tensors (local shards) of `pairs` (parameter, gradient) of `group` and their
        states (made on first use), step counters included; None when there are none."""
        stepping = []
        for p, g in pairs:  # every check before any state changes
            if g.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients; use torch.optim.SparseAdam")
            if p.is_complex():
                raise RuntimeError("FusedAdam does not step complex parameters; use torch.optim.AdamW")
            local = _local(p)
            if local.device.type != "cpu":
                raise RuntimeError(
                    f"FusedAdam steps host memory, but a parameter of shape {tuple(p.shape)} is on {local.device}; "
                    "use torch.optim.AdamW(fused=True) on a GPU")
            if local.dtype not in (torch.float32, torch.float64):
                raise RuntimeError(
                    f"FusedAdam steps float32 and float64 parameters, but one of shape {tuple(p.shape)} is "
                    f"{local.dtype}; keep float32 main weights (megatron_fsdp_c's MixedPrecisionPolicy does) or use "
                    "torch.optim.AdamW")
            if not local.is_contiguous():
                raise RuntimeError(f"FusedAdam needs contiguous parameters; one of shape {tuple(p.shape)} is not")
            if g.dtype != local.dtype and not (local.dtype == torch.float32 and g.dtype in (torch.bfloat16, torch.float16)):
                raise RuntimeError(
                    f"FusedAdam: a {local.dtype} parameter of shape {tuple(p.shape)} has a {g.dtype} gradient; it takes "
                    "gradients of the parameter's dtype (or bf16/fp16 ones for float32 parameters)")
            stepping.append((p, local, g))
        params, grads, avgs, sqs, maxs, step_ts = [], [], [], [], [] if group["amsgrad"] else None, []
        for p, local, g in stepping:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if maxs is not None and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(local)
            grads.append(_local(g).contiguous())
            avgs.append(_local(state["exp_avg"]))
            sqs.append(_local(state["exp_avg_sq"]))
            if maxs is not None:
                maxs.append(_local(state["max_exp_avg_sq"]))
            step_ts.append(state["step"])
        if not step_ts:
            return None
        # the counters advance in the C step, once it succeeded (reading them here cost more than the
        # step of a small tensor)
        return [p for p, _, _ in stepping], params, grads, avgs, sqs, maxs, [_local(t) for t in step_ts]

    def _update(self, group, tensors, recheck: bool = False):
        """The C step of `tensors` (from _tensors) with the group's hyperparameters, as a call;
        `recheck`: off the autograd thread, beside the engine ([Note: memory under the step] in
        csrc/python/optim.c)."""
        stepped, params, grads, avgs, sqs, maxs, steps = tensors
        lr, (beta1, beta2), eps, weight_decay, amsgrad, maximize, decoupled = _hyper(group)
        # written in place from C: bump the version counters an in-place op would (the per-module
        # API finds updated shards by them, [Note: per-module groups] in per_module/_fully_shard.py)
        increment_version(stepped + params + avgs + sqs + (maxs or []))
        threads = self.threads or torch.get_num_threads()
        return lambda: _C.adam_step_(params, grads, avgs, sqs, maxs, steps, lr, beta1, beta2, eps, weight_decay,
                                     bool(amsgrad), bool(maximize), bool(decoupled), threads, None, recheck)

    def _step_in_backward(self, group_index: int, pairs, landed) -> None:
        """Steps (parameter, gradient DTensor) pairs of one group from a backward ([Note: stepping
        in backward] in _backward_step.py), on two threads: the sealer waits for the gradients to
        land in host memory (`landed()`) and takes each one's fingerprint, which optimizer.step()
        compares; the worker steps once they are sealed. The backward's end waits for the sealer
        alone (`_seal`), so no code after the backward reaches a gradient before its fingerprint,
        while the steps go on."""
        group = self.param_groups[group_index]
        tensors = self._tensors(group, pairs)
        if tensors is None:
            return
        grads, update = tensors[2], self._update(group, tensors, recheck=True)
        hyper = _hyper(group)  # once: every entry of the group shares it
        entries = [[grad, None, hyper] for grad in grads]
        for e in entries:
            self._stepped[id(e[0])] = e

        def seal():  # pause: [Note: jitter at the hand-offs] in _jitter.py
            pause("seal")
            landed()
            pause("landed")
            for e in entries:
                e[1] = _fingerprint(e[0])

        def job():
            pause("step")
            sealed.result()
            pause("update")
            update()

        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsdp-adam")
            self._sealer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsdp-seal")
        sealed = self._sealer.submit(seal)
        self._sealing.append(sealed)
        self._pending.append(self._worker.submit(job))
        pause("submit")

    def _seal(self) -> None:
        """Waits until every gradient stepped in this backward has its fingerprint (re-raising the
        sealer's first error): at the backward's end."""
        sealing, self._sealing = self._sealing, []
        for f in sealing:
            f.result()

    def _stepped_in_backward(self, grad) -> bool:
        """Whether a backward stepped the parameter of gradient `grad` since the last step()."""
        return id(_local(grad)) in self._stepped

    def _join(self) -> None:
        """Waits for the steps taken in backward (re-raising the first error)."""
        if self._pending:
            pause("join")
        self._seal()
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def _forget_backward_steps(self) -> None:
        """After a backward that raised (joined first): the parameters it stepped stay stepped, and
        the next optimizer.step() steps every parameter afresh ([Note: a backward that raised] in
        _hooks.py)."""
        self._stepped.clear()

    def _stepped_already(self, group_index, group, p, g) -> bool:
        """Whether a backward stepped `p` since the last optimizer.step(), checking that nothing
        the step read has changed since ([Note: stepping in backward] in _backward_step.py)."""
        done = self._stepped.pop(id(_local(g)), None)
        if done is None:
            return False
        local, seen, hyper = done
        now = _fingerprint(local)
        if not _same_fingerprint(now, seen, local.dtype):
            raise RuntimeError(
                f"FusedAdam(step_in_backward=True): the gradient of a parameter of shape {tuple(p.shape)} changed "
                f"(its norm from {seen!r} to {now!r}) between the backward, which already stepped it, and "
                "optimizer.step() (gradient clipping, GradScaler.unscale_ or a hook writing gradients?). Make the "
                "optimizer with step_in_backward=False to change gradients before the step")
        if _hyper(group) != hyper:
            raise RuntimeError(
                f"FusedAdam(step_in_backward=True): parameter group {group_index}'s hyperparameters changed between "
                f"the backward, which already stepped with {dict(zip(_HYPER, hyper))}, and optimizer.step(). Set "
                "them before the backward (LR schedulers step after optimizer.step()), or make the optimizer with "
                "step_in_backward=False")
        return True

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every parameter with a gradient (torch's Adam, see [Note: fused Adam]),
        but those a backward stepped already ([Note: stepping in backward] in _backward_step.py)."""
        self._join()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            for gi, group in enumerate(self.param_groups):
                if group.get("capturable") or group.get("differentiable"):
                    raise RuntimeError("FusedAdam: capturable and differentiable steps are not supported")
                pairs = [(p, p.grad) for p in group["params"] if p.grad is not None]
                if self._stepped:
                    pairs = [(p, g) for p, g in pairs if not self._stepped_already(gi, group, p, g)]
                tensors = self._tensors(group, pairs)
                if tensors is not None:
                    self._update(group, tensors)()
        finally:
            self._stepped.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._join()
        super().zero_grad(set_to_none)

    def state_dict(self):
        self._join()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._join()
        super().load_state_dict(state_dict)


class FusedAdamW(FusedAdam):
    """torch.optim.AdamW's arguments and semantics (decoupled weight decay, default 1e-2),
    stepped by the C kernel of [Note: fused Adam]."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, threads: Optional[int] = None,
                 step_in_backward: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, threads=threads, step_in_backward=step_in_backward)
