"""Stepping each bucket inside the backward, as its gradients land (the engine side).

[Note: stepping in backward]
`FusedAdam(..., step_in_backward=True)` steps a bucket's parameters as soon as the bucket's
gradient shard is final on the host, while the backward of earlier layers still runs: ZeRO-
Offload's overlap, which makes an offloaded host step cost little when the GPU computes. The step
runs on the optimizer's worker thread (the C step releases the GIL), so the autograd thread
goes on with the backward meanwhile. Each bucket is finished one unit late (after the next
unit's backward), so its reduction overlaps that unit's backward as before. It is the step
`optimizer.step()` would take, exactly:
- Only a syncing backward steps (the last microbatch), so accumulation with sync off (no_sync,
  set_requires_gradient_sync(False)) waits for the last microbatch. A second syncing backward
  before `optimizer.step()` raises: its parameters were stepped already.
- Only buckets the engine calls final before the sync step there ([Note: a bucket's gradients
  before the sync] in csrc/comm/backward.c: ZeRO-2/3 without replicas), and only parameters with
  host main weights; every other parameter is stepped by `optimizer.step()` as usual. HSDP and
  no_shard/ZeRO-1 therefore step after the backward (their gradients are final only at the sync).
- A parameter is stepped when the sync will give it a gradient: the used flags its bucket's
  reduction carried ([Note: unused parameters] in _owner.py), or a gradient kept since.
- Hyperparameters (the LR a scheduler set) are read when the bucket steps. `optimizer.step()`
  then waits for those steps and steps the rest. It raises when a stepped parameter's gradient
  changed since the backward (gradient clipping, GradScaler.unscale_, a hook writing it: each
  gradient's fingerprint is taken as it lands, on a thread of its own, and the backward's end waits
  until all are taken, so nothing after it can change one first), or its group's
  hyperparameters did: clipping needs the global norm before any step, so it takes
  step_in_backward=False (stepping after the backward), as does anything else that edits
  gradients between backward and step.
- The stepped weights are the worker's until it is joined: every gather of the engine, the
  root's pre-forward, `optimizer.step()`, `zero_grad()` and the optimizer's state dicts join
  first (a gather only when it reads a bucket still being stepped: never in the backward that
  stepped it, whose gathers are of buckets not yet final). A `.to()`/`.double()` of the model
  (which hands the engine's buffers back, [Note: re-initialisation] in per_module/_root.py)
  joins too, and is refused until `optimizer.step()` when the backward stepped parameters (a forward
  or unshard() in between changes nothing): the
  worker would otherwise write buffers already handed back (memory freed under a running step),
  and the step would step the parameters again.
Runs where main weights are host memory: CPU meshes, and offloaded buckets on a GPU. There the
kernels that add the reduced slice into the host gradient shard may still be queued when
`finish_grads` returns: the worker waits for that bucket's mark (`engine.wait_grads`, an event
behind those kernels) before it reads the gradient. (At more than one rank the autograd thread
still reads each stepped bucket's reduced used-flags, one synchronous copy: `_grads_due`.)
"""
from __future__ import annotations

import functools
import weakref
from typing import Dict, List, Optional

__all__ = ["BackwardSteps", "register_stepper"]

# The optimizers made with step_in_backward=True (weakly: an optimizer dropped stops stepping).
# A registry, not a link made with the optimizer: a per-module model's optimizer is made before
# its lazy init, when its parameters lead to no engine yet; each root's pre-forward looks here for
# the optimizers holding its parameters (BackwardSteps.before_forward).
_STEPPERS: "weakref.WeakSet" = weakref.WeakSet()


def register_stepper(optimizer) -> None:
    _STEPPERS.add(optimizer)


class BackwardSteps:
    """One per HookManager: the buckets of this backward that optimizers step as they land.
    The optimizer's side is `_step_in_backward(group_index, [(param, grad DTensor)], landed)` and
    `_join()` (megatron_fsdp_c/fused_adam.py)."""

    def __init__(self, owner):  # an EngineOwner (_owner.py)
        self.owner = owner
        self.plan: Optional[Dict[int, list]] = None  # bucket -> [(record, optimizer, group index)] still to step
        self.waiting: List[int] = []  # the buckets of the unit whose backward ended last
        self.busy: list = []  # optimizers with steps submitted in this pass
        self.stepping: set = set()  # their buckets, until joined
        self.held: Dict[int, tuple] = {}  # id(dist param) -> (stepping optimizer, group index), at the last forward
        # buckets stepped in the last syncing backward: while it ran, and at its end; gathers that
        # waited for a step, and that went on while steps ran
        self.counts = {"during": 0, "at_end": 0, "waits": 0, "passed": 0}

    def before_forward(self) -> None:
        """At the root's pre-forward: joins every step (the forward reads the weights), and notes
        which of this owner's parameters an optimizer that steps in backward holds (the pass's
        backward plans from it). Per owner, not "any stepper alive": another model's optimizer,
        alive until the collector takes it, must not change what this model's backward does."""
        self.join()
        self.held = {}
        if not _STEPPERS:
            return
        where = {}
        for opt in list(_STEPPERS):
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    where[id(p)] = (opt, gi)
        for r in self.owner.param_buffer.records:
            hit = where.get(id(r.dist_param))
            if hit is not None:
                self.held[id(r.dist_param)] = hit

    def may_step(self, unit_state) -> bool:
        """At a unit's forward: whether its backward's end may step a bucket (so it must be told,
        even where nothing reshards the unit after its backward: ZeRO-2)."""
        return bool(self.held) and bool(unit_state.grad_buckets)

    def begin(self, sync: bool) -> None:
        """At the start of a backward, before the engine's: which buckets' parameters a stepping
        optimizer holds (as the forward found, before_forward). Raises (nothing launched yet) when
        one of them was stepped in an earlier backward and optimizer.step() has not come since."""
        self.plan, self.waiting = None, []
        if sync:
            self.counts = {"during": 0, "at_end": 0, "waits": 0, "passed": 0}
        if not sync or not self.held:
            return
        plan: Dict[int, list] = {}
        trainable = self.owner._trainable
        for r in self.owner.param_buffer.records:
            hit = self.held.get(id(r.dist_param))
            if hit is None or r.grad_dtensor is None or not trainable[r.index]:
                continue
            if r.dist_param._local_tensor.device.type != "cpu":  # the fused step refuses it at optimizer.step()
                continue
            plan.setdefault(r.bucket, []).append((r,) + hit)
        for entries in plan.values():
            for r, opt, _ in entries:
                if opt._stepped_in_backward(r.grad_dtensor):
                    raise RuntimeError(
                        "FusedAdam(step_in_backward=True): a second backward that syncs gradients came before "
                        "optimizer.step(), but the first one already stepped its parameters. Accumulate gradients "
                        "with sync off on all microbatches but the last (no_sync(), or "
                        "set_requires_gradient_sync(False)), call optimizer.step() after each syncing backward, or "
                        "make the optimizer with step_in_backward=False")
        self.plan = plan or None

    def unit_done(self, unit_state) -> None:
        """After a unit's backward: step the buckets of the unit before it (one unit late, so a
        reduction overlaps the next unit's backward) whose gradients are final."""
        if self.plan is None:
            return
        self._finish(self.waiting, "during")
        self.waiting = [b for b in unit_state.grad_buckets if b in self.plan]

    def backward_done(self) -> None:
        """At the end of the backward (every reduction in): step what is left."""
        if self.plan is None:
            return
        try:
            self._finish(list(self.plan), "at_end")
        finally:
            self.plan, self.waiting = None, []
            for opt in self.busy:  # every stepped gradient fingerprinted before the user's code runs
                opt._seal()

    def abandon(self) -> int:
        """A backward that raised ([Note: a backward that raised] in _hooks.py): no more steps in
        it; waits for those submitted (re-raising a step's error) and makes their optimizers forget
        them. Returns how many buckets were stepped in it."""
        self.plan, self.waiting = None, []
        stepped, busy = len(self.stepping), list(self.busy)
        self.join()  # each optimizer's _join seals first
        for opt in busy:
            opt._forget_backward_steps()
        return stepped

    def join(self, buckets=None) -> None:
        """Waits for every step submitted in this pass (re-raising a step's error); with
        `buckets`, only when one of them is being stepped (a gather in the backward reads no
        bucket stepped there, so the steps go on under the backward)."""
        if buckets is not None and self.busy:
            self.counts["waits" if not self.stepping.isdisjoint(buckets) else "passed"] += 1
        if buckets is not None and self.stepping.isdisjoint(buckets):
            return
        busy, self.busy = self.busy, []
        self.stepping.clear()
        first = None
        for opt in busy:  # every optimizer's worker is waited for, also after one raised
            try:
                opt._join()
            except Exception as e:  # noqa: BLE001 - re-raised below, once all are joined
                first = first or e
        if first is not None:
            raise first

    def settle(self) -> bool:
        """Waits for every step of this pass; whether a parameter of this owner that a backward
        stepped still waits for its optimizer.step() (which is to skip it). Asks each optimizer
        that holds the owner's parameters (`held`), not only this pass's `busy`: a forward or an
        unshard() since the backward joined its steps and emptied `busy`, and the step is still due."""
        self.join()
        for r in self.owner.param_buffer.records:
            hit = self.held.get(id(r.dist_param))
            if hit is not None and r.grad_dtensor is not None and hit[0]._stepped_in_backward(r.grad_dtensor):
                return True
        return False

    def _finish(self, buckets, when: str) -> None:
        engine = self.owner.param_buffer.engine
        for b in buckets:
            entries = self.plan.get(b)
            if not entries or not engine.finish_grads(b):
                continue  # not final yet (or only at the sync): stepped later, or by optimizer.step()
            del self.plan[b]
            self.counts[when] += 1
            self.stepping.add(b)
            due = self.owner._grads_due([r for r, _, _ in entries])
            if due is None:
                continue  # the bucket's flags travel at the sync: optimizer.step() steps it
            steps: Dict[tuple, list] = {}
            for r, opt, gi in entries:
                if due[r.index]:
                    steps.setdefault((id(opt), gi), [opt, gi, []])[2].append((r.dist_param, r.grad_dtensor))
            landed = functools.partial(engine.wait_grads, b)
            for opt, gi, pairs in steps.values():
                opt._step_in_backward(gi, pairs, landed)
                if opt not in self.busy:
                    self.busy.append(opt)
