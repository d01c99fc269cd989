"""Forward and backward hooks: they say *when* to gather, release and reduce; the C engine
decides *how*. Every hook is a few dictionary lookups and one call into the engine.

[Note: pass lifecycle]
  root pre-forward   swap compute params in (MegatronFSDP); gather the buckets outside every unit
  unit pre-forward   gather the unit (+ prefetch the next unit in the shared order); wait; the
                     owner's _unit_unsharded (the per-module API registers the unit's compute params)
  unit post-forward  reshard the unit (ZeRO-3: release; the owner's _unit_resharded); hook the
                     outputs for the pre-backward
  root post-forward  gathers the shared order still owes (units this rank skipped); list groups
                     only some of whose modules ran end their forward here
  pre-backward       (first one also starts the backward: engine.begin_backward, final callback,
                     seal the buckets of units that did not run) gather the unit again
                     (+ prefetch the previous unit); wait; _unit_unsharded
  param grad hook    hand the gradient to the engine (packs it; reduces in the shared order)
  post-backward      identity autograd.Function on the unit's inputs: reshard the unit; a stepping
                     optimizer steps the buckets of the unit before it ([Note: stepping in backward])
  final callback     engine.end_backward (leftovers, wait reductions), release everything,
                     _unit_resharded, sync gradients if this backward syncs, swap the distributed
                     params back (MegatronFSDP); a stepping optimizer steps the buckets left
Activation recomputation re-runs a unit's forward inside backward: then there is no prefetch
and no release in the post-forward (the backward that follows needs the weights).

[Note: gather order]
An all-gather needs every rank, so every rank must gather the same units in the same order,
also when its graph differs (LayerDrop skips a block on one rank, an early exit, a data-
dependent branch around a unit). The order is the units' registration order (`fsdp_unit_modules`
found in `model.modules()` order), which is the execution order of nearly every model. In a
forward, reaching unit k first gathers, then releases, every unit before k in that order that
this rank skipped (its peers may need it), and the root post-forward settles the units after
the last one that ran. The backward does the same in reverse over the trainable ZeRO-3 units,
and its final callback settles the rest. Prefetching always takes the next unit in the shared
order, so it is the same on every rank. A unit used out of that order (twice in one forward,
or registered in another order than it runs) is gathered where it is used: still correct when
every rank runs the same graph, at the cost of an extra gather (logged once). Not supported: a
wholly frozen ZeRO-3 unit whose inputs require grad and that runs on some ranks only (its
backward gathers are issued on demand). A model sharded over several meshes (expert
parallelism) has one engine, so one such order, per mesh ([Note: a mesh per group] in
per_module/_root.py, [Note: expert data-parallel mesh] in _megatron_experts.py).

[Note: compile]
The hooks talk to the C engine and keep Python state, neither of which Dynamo can trace; they
are wrapped in torch.compiler.disable (as FSDP2's are), so a compiled model runs them eagerly
between its graphs instead of breaking its trace at every engine call. The root's work runs in
disabled forward hooks of the wrapper itself, so its forward is the module's alone.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, List, Protocol

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._common import grad_tensors, in_backward, logger, weak_call
from ._extensions import plain_grad
from ._backward_step import BackwardSteps
from ._pass_state import PassState, UnitState

if TYPE_CHECKING:
    from ._param_buffer import ParamBuffer

__all__ = ["HookManager", "HookOwner"]


class HookOwner(Protocol):
    """What HookManager needs from the object that owns the engine: MegatronFSDP (the Megatron-FSDP
    API), the engine of its experts (_megatron_experts.py's ExpertOwner, which passes the backward's
    calls on to the wrapper) and the per-module API's root state (per_module/_root.py) are the
    owners. The manager never calls anything else on it.

    `param_buffer`           the model's buckets: read once, when the manager is built (the engine,
                             the bucket ids of each unit, which buckets are sharded, trainable,
                             gatherable, the records whose gradients the manager hooks).
    `overlap_param_gather`   read at every unit's pre-forward and pre-backward: True prefetches the
                             next unit in the shared order ([Note: gather order]).
    `_used`                  a byte per record (by ParamRecord.index), taken once when the manager
                             is built: the gradient hook sets a record's byte to 1 when its gradient
                             arrives; the owner clears bytes in place and never replaces the
                             bytearray ([Note: unused parameters] in _owner.py).
    `_trainable`             a byte per record, taken once: 1 while the record trains (the owner
                             changes it in place, then calls hook_grads and retrain, [Note:
                             changing requires_grad] in _trainable.py); read by the gradient hook.
    `_before_backward()`     called once at the start of each backward, before the owner is asked
                             whether it syncs and before engine.begin_backward.
    `_should_sync()`         right after: does this backward sync (reduce and attach gradients)?
                             The answer is passed to engine.begin_backward.
    `_after_backward(synced)` called from the backward's final callback, after engine.end_backward
                             and the releases, with the answer `_should_sync()` gave.
    `_unit_unsharded(unit_state)`, `_unit_resharded(unit_state)` (optional, looked up once): a unit's full
                             weights are ready for its compute (pre-forward, pre-backward, after the
                             wait), and a unit is resharded (after forward or backward, by its
                             flags, whether or not its buckets are released: a unit whose weights
                             persist is resharded too). The per-module API registers the compute or
                             the sharded parameters there ([Note: per-group registration] in
                             per_module/_registration.py); MegatronFSDP swaps every parameter per pass.
    `_drop_grads()`          after ending a backward that raised: every gradient of the step gone.
    `_unit_gathering(unit_state)`  (optional, looked up once): before each gather of a unit is started,
                             whatever its buckets' state ([Note: extension parameters] in _extensions.py).
    """

    param_buffer: "ParamBuffer"
    overlap_param_gather: bool
    _used: bytearray
    _trainable: bytearray

    def _before_backward(self) -> None: ...

    def _should_sync(self) -> bool: ...

    def _after_backward(self, synced: bool) -> None: ...

    def _drop_grads(self) -> None: ...


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, manager, unit_state, *inputs):
        ctx.manager, ctx.unit_state = manager, unit_state
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.manager.post_backward(ctx.unit_state)
        return (None, None) + grads


class HookManager:
    """`unit_modules` in forward (registration) order; `post_order`: unit indices in the order
    their forwards end (children before the unit that contains them; default: as given).
    `register_module_hooks=False`: the caller calls pre_forward/post_forward itself (the
    per-module API, whose own hooks also initialise it)."""

    def __init__(self, owner: HookOwner, unit_modules: List[nn.Module], *, post_order=None,
                 register_module_hooks: bool = True):
        self.owner = owner
        self.engine = owner.param_buffer.engine
        buf = owner.param_buffer
        sharded = set(buf.weight_sharded_buckets())
        gatherable = set(buf.gatherable_buckets())
        self.unit_states: List[UnitState] = []
        for u, module in enumerate(unit_modules):
            ids = buf.buckets_of_unit(u)
            self.unit_states.append(UnitState(u, module, tuple(b for b in ids if b in gatherable),
                                    tuple(b for b in ids if b in sharded), ()))
        root_ids = buf.buckets_of_unit(-1)
        self.root_buckets = tuple(b for b in root_ids if b in gatherable)
        self.all_sharded = tuple(sorted(sharded))
        self.bucket_unit = buf.bucket_units
        # [Note: gather order]: the forward order over gathered units, the backward order over
        # trainable ZeRO-3 units; positions before *_done are settled (ran or released), gathers
        # are issued up to *_next.
        self.fwd_seq = [s for s in self.unit_states if s.buckets]
        self.ends = {u: k for k, u in enumerate(post_order if post_order is not None else range(len(self.unit_states)))}
        for pos, unit_state in enumerate(self.fwd_seq):
            unit_state.pos = pos
        self.pass_state = PassState(0)
        self.retrain()
        self.warned_order = False
        self.used = owner._used  # see [Note: unused parameters] in _owner.py
        self.trainable = owner._trainable
        self.handles = []
        self.hooked = set()  # records with a gradient hook
        self.on_gathering = getattr(owner, "_unit_gathering", None)
        self.on_unsharded = getattr(owner, "_unit_unsharded", None)
        self.on_resharded = getattr(owner, "_unit_resharded", None)
        self.backward_steps = BackwardSteps(owner)  # [Note: stepping in backward] in _backward_step.py
        self.grouped: List[UnitState] = []  # units of several modules (members > 1): completed at the root post-forward
        self.engine.set_reduce_order(buf.reduce_order())
        self.register_module_hooks = register_module_hooks
        self._register()

    def reset_pass(self) -> None:
        """Forgets a pass an error interrupted (FSDPModule.reset_iter_state): the next forward
        starts the gather orders from the top, every unit's modules still to run."""
        self.pass_state = PassState(len(self.bwd_seq))
        for unit_state in self.unit_states:
            unit_state.members_left = unit_state.members

    def retrain(self) -> None:
        """The units' trainable buckets and the backward gather order over the trainable ZeRO-3
        units, from the buckets that train now ([Note: changing requires_grad] in _trainable.py).
        Called outside passes only."""
        trainable = set(self.owner.param_buffer.grad_buckets())
        for unit_state in self.unit_states:
            buckets = self.owner.param_buffer.buckets_of_unit(unit_state.index)
            unit_state.grad_buckets = tuple(b for b in buckets if b in trainable)
            unit_state.bpos = -1
        self.bwd_seq = sorted((s for s in self.fwd_seq if s.releasable and s.grad_buckets),
                              key=lambda s: self.ends[s.index])  # (s: a unit state)
        for pos, unit_state in enumerate(self.bwd_seq):
            unit_state.bpos = pos
        self.pass_state.bwd_next = self.pass_state.bwd_done = len(self.bwd_seq)

    # -- registration ---------------------------------------------------------------------
    def _register(self) -> None:
        if self.fwd_seq and self.register_module_hooks:  # see [Note: compile]
            pre_forward = torch.compiler.disable(self.pre_forward, recursive=True)
            post_forward = torch.compiler.disable(self.post_forward, recursive=True)
        for unit_state in self.fwd_seq if self.register_module_hooks else ():
            self.handles.append(unit_state.module.register_forward_pre_hook(
                functools.partial(pre_forward, unit_state), prepend=True, with_kwargs=True))
            self.handles.append(unit_state.module.register_forward_hook(
                functools.partial(post_forward, unit_state), always_call=False))
        self.hook_grads([rec for rec in self.owner.param_buffer.records if self.trainable[rec.index]])

    def hook_grads(self, records) -> None:
        """Gradient hooks on the compute parameters of `records` (trainable now), once each."""
        for rec in records:
            if rec.index not in self.hooked:
                self.hooked.add(rec.index)
                # a TP parameter's gradient: its TP shard ([Note: tensor parallelism] in _tensor_parallel.py);
                # an extension parameter's: a plain tensor ([Note: extension parameters] in _extensions.py)
                to_local = rec.tp.local_grad if rec.tp is not None else plain_grad if rec.extension else None
                # held weakly: [Note: hooks hold their owner weakly] in _common.py
                self.handles.append(rec.param.register_post_accumulate_grad_hook(
                    weak_call(self, "grad_hook", rec.index, rec.bucket, rec.item, to_local=to_local)))

    def rehook(self, rec) -> None:
        """`rec`'s compute parameter was replaced ([Note: extension parameters] in _extensions.py)."""
        self.hooked.discard(rec.index)
        if self.trainable[rec.index]:
            self.hook_grads([rec])

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.hooked.clear()

    # -- the shared gather order ------------------------------------------------------------
    def gather(self, unit_state: UnitState) -> None:
        """Starts `unit_state`'s gathers (every one goes through here, after the owner's `_unit_gathering`
        and the steps in flight: [Note: stepping in backward] in _backward_step.py)."""
        self.backward_steps.join(unit_state.buckets)
        if self.on_gathering is not None:
            self.on_gathering(unit_state)
        self.engine.unshard(unit_state.buckets)

    def _out_of_order(self, unit_state: UnitState, behind: bool) -> None:
        """`unit_state` is used again after the shared order passed it; `behind`: not right after its
        previous use (so it is not simply a unit run twice in a row)."""
        if behind and not self.warned_order:
            self.warned_order = True
            logger.warning("megatron_fsdp_c: FSDP unit #%d (%s) ran out of the units' registration order; it is "
                           "gathered again where it runs (an extra all-gather). Register units in the order they "
                           "execute, or see [Note: gather order] in megatron_fsdp_c/_hooks.py",
                           unit_state.index, type(unit_state.module).__name__)
        self.gather(unit_state)

    def _settle(self, seq, positions, issued_before, forward: bool) -> None:
        """Units of `seq` at `positions` did not run here: gather those not yet gathered (a peer
        may need them), and release them where their peers will (so that the next pass finds the
        same state on every rank)."""
        for q in positions:
            skipped = seq[q]
            if issued_before(q):
                self.gather(skipped)
            if skipped.reshard_after_forward if forward else skipped.reshard_after_backward:
                self._reshard(skipped)

    def _reshard(self, unit_state: UnitState) -> None:
        """Releases a unit (its ZeRO-3 buckets) and tells the owner."""
        if unit_state.releasable:
            self.engine.reshard(unit_state.releasable)
        if self.on_resharded is not None:
            self.on_resharded(unit_state)

    def _forward_reach(self, unit_state: UnitState) -> None:
        """Gathers for `unit_state` in the shared forward order (see [Note: gather order])."""
        pos = unit_state.pos
        if pos < self.pass_state.fwd_done:
            self._out_of_order(unit_state, pos < self.pass_state.fwd_done - 1)
            return
        self._settle(self.fwd_seq, range(self.pass_state.fwd_done, pos), lambda q: q >= self.pass_state.fwd_next, True)
        if pos >= self.pass_state.fwd_next:
            self.gather(unit_state)
            self.pass_state.fwd_next = pos + 1
        self.pass_state.fwd_done = pos + 1

    def _backward_reach(self, unit_state: UnitState) -> None:
        """Gathers for a trainable ZeRO-3 `unit_state` in the shared backward order."""
        pos = unit_state.bpos
        if pos >= self.pass_state.bwd_done:
            self._out_of_order(unit_state, pos > self.pass_state.bwd_done)
            return
        now = self.pass_state
        self._settle(self.bwd_seq, range(now.bwd_done - 1, pos, -1), lambda q: q < now.bwd_next, False)
        if pos < self.pass_state.bwd_next:
            self.gather(unit_state)
            self.pass_state.bwd_next = pos
        self.pass_state.bwd_done = pos

    # -- forward --------------------------------------------------------------------------
    def root_pre_forward(self) -> None:
        # the owner ended a backward that raised before this ([Note: a backward that raised])
        self.backward_steps.before_forward()
        if not in_backward():
            self.pass_state.fwd_next = self.pass_state.fwd_done = 0
        if self.root_buckets:
            self.engine.unshard(self.root_buckets)
            self.engine.wait_unshard(self.root_buckets)

    def root_post_forward(self, output):
        if not in_backward():
            for unit_state in self.grouped:  # a group only some of whose modules ran: its forward ends here
                if 0 < unit_state.members_left < unit_state.members:
                    unit_state.members_left = 0
                    if unit_state.reshard_after_forward:
                        self._reshard(unit_state)
            n = len(self.fwd_seq)
            now = self.pass_state
            self._settle(self.fwd_seq, range(now.fwd_done, n), lambda q: q >= now.fwd_next, True)
            self.pass_state.fwd_next = self.pass_state.fwd_done = n
        if torch.is_grad_enabled():
            tensors = grad_tensors(output)
            if tensors:
                register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        return output

    def pre_forward(self, unit_state: UnitState, module, args, kwargs):
        if not in_backward():
            if unit_state.index not in self.pass_state.ran:
                self.pass_state.ran.add(unit_state.index)
                unit_state.members_left = unit_state.members
            if unit_state.pos >= 0:
                self._forward_reach(unit_state)
                if self.owner.overlap_param_gather:
                    self._prefetch_forward(unit_state)
        elif unit_state.bpos >= 0:  # activation recomputation inside backward
            self.start_backward()
            self._backward_reach(unit_state)
        else:
            self.gather(unit_state)
        if unit_state.buckets:
            self.engine.wait_unshard(unit_state.buckets)
        if self.on_unsharded is not None:
            self.on_unsharded(unit_state)
        if (unit_state.releasable or self.backward_steps.may_step(unit_state)) and torch.is_grad_enabled():
            flat, spec = tree_flatten((args, kwargs))
            positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if positions:
                wrapped = _PostBackward.apply(self, unit_state, *(flat[i] for i in positions))
                if len(positions) == 1:
                    wrapped = (wrapped,)
                for i, t in zip(positions, wrapped):
                    flat[i] = t
                args, kwargs = tree_unflatten(flat, spec)
        return args, kwargs

    def _prefetch_forward(self, unit_state: UnitState) -> None:
        """Gathers ahead in the shared order: through the next unit, or through the furthest of
        the units named by set_modules_to_forward_prefetch (every unit between in order too)."""
        named = unit_state.forward_prefetch
        through = unit_state.pos + 1 if named is None else max(named, default=-1)
        while self.pass_state.fwd_next <= min(through, len(self.fwd_seq) - 1):
            self.gather(self.fwd_seq[self.pass_state.fwd_next])
            self.pass_state.fwd_next += 1

    def post_forward(self, unit_state: UnitState, module, args, output):
        if not in_backward() and unit_state.reshard_after_forward:
            unit_state.members_left -= 1
            if unit_state.members_left <= 0:  # the last of the unit's modules to run in this forward
                self._reshard(unit_state)
        if torch.is_grad_enabled():
            tensors = grad_tensors(output)
            if tensors:
                register_multi_grad_hook(tensors, functools.partial(self._pre_backward, unit_state), mode="any")
        return output

    # -- backward -------------------------------------------------------------------------
    def start_backward(self) -> None:
        if self.pass_state.in_backward:
            return
        owner, now = self.owner, self.pass_state
        owner._before_backward()
        sync = owner._should_sync()
        self.backward_steps.begin(sync)  # may refuse the backward: before anything starts
        now.in_backward, now.sync = True, sync
        self.engine.begin_backward(sync)
        now.bwd_next = now.bwd_done = len(self.bwd_seq)
        if now.ran:  # units that ran in no forward since the last backward get no gradient: they may
            skipped = [b for s in self.fwd_seq if s.index not in now.ran for b in s.grad_buckets]  # reduce in turn
            now.ran = set()
            if skipped:
                self.engine.seal(skipped)
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def _root_pre_backward(self, grads):
        self.start_backward()

    def _pre_backward(self, unit_state: UnitState, grads):
        self.start_backward()
        if unit_state.bpos >= 0:
            self._backward_reach(unit_state)
            if self.owner.overlap_param_gather:
                self._prefetch_backward(unit_state)
        else:
            self.gather(unit_state)
        self.engine.wait_unshard(unit_state.buckets)
        if self.on_unsharded is not None:
            self.on_unsharded(unit_state)

    def _prefetch_backward(self, unit_state: UnitState) -> None:
        """Gathers ahead in the shared backward order: the unit before, or down through the
        furthest of the units named by set_modules_to_backward_prefetch."""
        named = unit_state.backward_prefetch
        through = unit_state.bpos - 1 if named is None else min(named, default=unit_state.bpos)
        through = max(through, 0)
        while self.pass_state.bwd_next > through:
            self.pass_state.bwd_next -= 1
            self.gather(self.bwd_seq[self.pass_state.bwd_next])

    def post_backward(self, unit_state: UnitState) -> None:
        if unit_state.releasable and unit_state.reshard_after_backward:
            self._reshard(unit_state)
        self.backward_steps.unit_done(unit_state)

    def grad_hook(self, index: int, bucket: int, item: int, param: torch.Tensor, *, to_local=None) -> None:
        self.start_backward()
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if not self.trainable[index]:
            rec = self.owner.param_buffer.records[index]
            raise RuntimeError(
                f"parameter '{rec.name}' got a gradient but was frozen when this pass began: requires_grad was set "
                "during a forward or backward. Change requires_grad between steps; it is read at each forward "
                "([Note: changing requires_grad] in megatron_fsdp_c/_trainable.py)")
        if to_local is not None:
            grad = to_local(grad)
        self.used[index] = 1
        self.engine.grad_ready(bucket, item, grad if grad.is_contiguous() else grad.contiguous())

    def end_abandoned_backward(self) -> None:
        """[Note: a backward that raised]
        When autograd raises inside a backward (a node's error, a compile error in a compiled
        backward), its final callback, our end_backward, never runs: the engine would stay in
        that backward, and every later call would fail on that state (gradient sync cannot
        change inside a backward pass...) instead of the user's error or the training going on.
        So the next call that needs the pass over -- the root's next forward, a gradient-sync
        setting, zeroing or syncing gradients -- ends it first, as its final callback would have:
        its reductions run (what its nodes delivered, zeros for the rest: every rank ends the same
        backward at the same point, so the collectives match), then the step's gradients are
        dropped, as FSDPModule.reset_iter_state drops them: which of its gradients a raising
        backward delivered is unknown, so none reaches an optimizer step, and the microbatches
        accumulated before it go too (the step is to be redone). Nothing more is stepped
        (step_in_backward); where buckets were stepped before the error, that call raises once,
        saying so (a step cannot be taken back), and training goes on from there. A backward still
        running (this thread inside autograd) is not ended.
        (torch's FSDP2, on torch 2.13, keeps the unsharded parameters registered after such a
        backward and stops training: its losses stay flat.)"""
        if not self.pass_state.in_backward or in_backward():
            return
        stepped = self.backward_steps.abandon()
        self.end_backward()
        self.owner._drop_grads()
        if stepped:
            raise RuntimeError(
                f"a backward that raised had already stepped {stepped} bucket(s) of parameters (FusedAdam("
                "step_in_backward=True)): those parameters have taken that step, the others have not, and a step "
                "cannot be taken back. Restore the model and optimizer from a checkpoint to redo it exactly (training "
                "goes on from here otherwise), or make the optimizer with step_in_backward=False where a backward "
                "may raise")

    def end_backward(self) -> None:
        try:
            now = self.pass_state
            self._settle(self.bwd_seq, range(now.bwd_done - 1, -1, -1), lambda q: q < now.bwd_next, False)
            self.pass_state.bwd_next = self.pass_state.bwd_done = 0
            self.engine.end_backward()
            release = [b for s in self.unit_states if s.reshard_after_backward for b in s.releasable]
            release += [b for b in self.all_sharded if self.bucket_unit[b] < 0]
            if release:
                self.engine.reshard(release)
            if self.on_resharded is not None:
                for unit_state in self.unit_states:
                    if unit_state.reshard_after_backward:
                        self.on_resharded(unit_state)
        finally:
            self.pass_state.in_backward = False
        self.owner._after_backward(self.pass_state.sync)
        self.backward_steps.backward_done()
