"""How the per-module API's root state registers each group's parameters on its modules, as FSDP2
does ([Note: per-group registration]), hands them back from the engine for a .to() after the
first forward ([Note: re-initialisation]), and runs the post-accumulate-grad hooks of the sharded
parameters ([Note: post-accumulate-grad hooks]): a base class of RootState (_root.py), which
owns the engine, the records and the hooks these read.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .. import _C
from .._common import move_storage
from ._group import ShardGroup

__all__ = ["Registration", "to_sharded_hook"]


class Registration:
    """RootState's parameter registration (see the module docstring). RootState sets
    `_unit_records` (the records of each unit), `_unsharded` (a flag per unit: the compute
    parameters are registered) and `_spmd_params` in its __init__."""

    # -- [Note: per-group registration] ------------------------------------------------------
    def register(self, u: int, unsharded: bool) -> None:
        """[Note: per-group registration]
        As FSDP2 does, each group's modules hold its compute (unsharded) parameters only while
        the group is gathered for its compute, and its sharded DTensor parameters otherwise:
        the compute ones from the group's pre-forward (and pre-backward, and an explicit
        unshard()) on, the sharded ones again when the group reshards -- after its forward if
        reshard_after_forward, after its backward if reshard_after_backward, at reshard(), and
        when a state dict is taken or loaded (FSDP2's state-dict pre-hooks; the gathered
        weights stay, the group's next pre-backward registers the compute ones again). So a
        forward without its backward leaves the resharding groups' DTensors on the modules (a
        released compute parameter is never left registered), and a group that keeps its
        weights (reshard_after_forward=False) holds plain tensors until it reshards, as under
        FSDP2. The same applies to groups whose weights persist (ZeRO-1/2, one rank): they
        reshard by the same flags, without releasing anything. Gradients do not depend on it:
        autograd keeps the compute parameters it used, and the gradient hooks are on them."""
        if self._unsharded[u] == unsharded:
            return
        self._unsharded[u] = unsharded
        for r in self._unit_records[u]:
            p = r.param if unsharded else r.dist_param
            sp = self._spmd_params.get(r.index) if unsharded else None
            if sp is not None:  # [Note: SPMD compute parameters]
                if sp._local_tensor.data_ptr() != r.param.data_ptr():
                    sp._local_tensor = r.param.detach()  # the compute parameter was pointed elsewhere
                p = sp
            for mod, attr in r.places:
                mod._parameters[attr] = p

    def _unit_gathering(self, unit) -> None:  # HookOwner (_hooks.py)
        if self.extension_gathers is not None:
            self.extension_gathers.gathering(unit.index)

    def _unit_unsharded(self, unit) -> None:  # HookOwner (_hooks.py)
        if self.extension_gathers is not None:  # [Note: extension parameters] in ../_extensions.py
            self.extension_gathers.unsharded(unit.index, self._unsharded[unit.index])
        self.register(unit.index, True)

    def _unit_resharded(self, unit) -> None:  # HookOwner (_hooks.py)
        if self.extension_gathers is not None:
            self.extension_gathers.resharded(unit.index)
        self.register(unit.index, False)

    def reshard_group(self, g: ShardGroup) -> None:
        """FSDPModule.reshard(): releases the group's gathered weights (ZeRO-3) and registers
        its sharded parameters."""
        if g.unit_state.releasable:
            self.param_buffer.engine.reshard(list(g.unit_state.releasable))
        self._unit_resharded(g.unit_state)

    def release_engine(self, why: str) -> None:
        """[Note: re-initialisation]
        FSDP2 lets .to(dtype)/.float()/.to(device) run on a sharded model after its first
        forward (its sharded parameters are plain DTensors it re-reads). Ours live in the
        engine's buffers, planned for their dtype and device, so such a call first hands them
        back: every group's sharded DTensor parameters are registered, their local shards are
        copied out of the engine into the storage they had (the same Parameter objects and
        local tensors, so optimizers and state dicts taken of them keep working, [Note: local
        shards keep their storage] in ../_common.py), the gradient hooks are removed and every
        group under the root forgets the engine; the next forward (or unshard()) initialises a
        new one from the converted parameters, as the first did. An attached .grad is copied out
        of the engine too (the same DTensor object), so .to() converts it as torch's
        Module._apply converts any gradient, and the new engine starts from it (adopt_grads: the
        next backward accumulates onto it, as FSDP2's onto its sharded .grad). Refused inside a forward or backward, and
        while gradients are held back by set_requires_gradient_sync(False): those live in the
        engine's unreduced buffers, in no .grad, so nothing could carry them."""
        if self.hooks.pass_state.in_backward or self.pass_root is not None or self.methods_running:
            raise RuntimeError(f"{why} inside a forward or backward pass: call it between training steps")
        # the optimizer's worker writes the engine's buffers until joined; the buffers are handed
        # back below ([Note: stepping in backward] in ../_backward_step.py)
        if self.hooks.backward_steps.settle():
            raise RuntimeError(f"{why} between a backward that stepped parameters (FusedAdam(step_in_backward=True)) "
                               "and optimizer.step(): call optimizer.step() first")
        if self.extension_gathers is not None:
            raise NotImplementedError(f"{why} after the first forward of a model with tensor-subclass parameters (FSDP2's "
                                      "all-gather extensions) is not supported by megatron_fsdp_c yet: convert the "
                                      "model before its first forward")
        if self.held_units:
            raise RuntimeError(f"{why} while gradients are held back by set_requires_gradient_sync(False): finish the "
                               "accumulation with a backward that syncs (and the optimizer step) first")
        stuck = [r.name for r in self.param_buffer.records if r.dist_param.grad is not None and r.grad_dtensor is not None
                 and not self._adoptable(r)]
        if stuck:  # refused here, at the call, rather than at the next forward's adopt_grads
            raise RuntimeError(f"{why} while parameters hold gradients the new engine could not start from "
                               f"({', '.join(stuck[:4])}{', ...' if len(stuck) > 4 else ''}: replicated or HSDP "
                               "gradients); call optimizer.zero_grad(set_to_none=True) (or model.zero_grad()) first")
        for u in range(len(self.groups)):
            self.register(u, False)
        self.hooks.remove()
        moved = set()
        with torch.no_grad():
            for r in self.param_buffer.records:
                dp = r.dist_param
                out = dp._local_tensor.detach().clone()  # out of the engine's buffer, into the same storage
                if not move_storage(dp._local_tensor, out, moved):  # ([Note: local shards keep their storage])
                    dp._local_tensor = out
                if isinstance(dp.grad, DTensor):  # the gradient DTensor views the engine's buffer too
                    dp.grad._local_tensor = dp.grad._local_tensor.detach().clone()
                origin = getattr(dp, "_mfsdp_origin", None)
                if origin is not None:
                    origin.owner = None
        for g in self.groups:
            g.owner = g.unit_state = None

    def _adoptable(self, r) -> bool:
        """Only a sharded gradient the engine accumulates into, reduced over one level, can start
        from a value: a full gradient buffer (replicated parameters) or an all-reduce across
        replicas (HSDP) would reduce the adopted value again, counting it several times."""
        return (self.param_buffer.specs[r.bucket]["grad_mode"] == _C.GRAD_SCATTER_ACCUMULATE
                and self.dist_ctx.outer_world == 1)

    def adopt_grads(self) -> None:
        """At the engine's initialisation: a .grad the sharded parameters already hold (carried
        through a .to() from an earlier engine, [Note: re-initialisation], or set by the user
        before the first forward) is copied into the engine's gradient shard and attached as
        before, so the next backward accumulates onto it as FSDP2's does. A gradient of another
        layout than the parameter's is refused here rather than dropped."""
        for r in self.param_buffer.records:
            g = r.dist_param.grad
            if g is None or r.grad_dtensor is None:  # a frozen parameter's .grad is left to the user
                continue
            if not isinstance(g, DTensor) or g.placements != r.grad_dtensor.placements or g.shape != r.dist_param.shape:
                raise RuntimeError(f"parameter '{r.name}' holds a .grad that is not a DTensor laid out as the parameter "
                                   f"({type(g).__name__} {tuple(g.shape)}): set it to None (zero_grad(set_to_none=True)) "
                                   "or to a DTensor with the parameter's mesh and placements before the forward")
            spec = self.param_buffer.specs[r.bucket]
            if not self._adoptable(r):
                raise RuntimeError(f"parameter '{r.name}' holds a .grad from before the engine was (re-)initialised "
                                   "(e.g. .to() after a backward); its engine reduces it as a replicated or HSDP "
                                   "gradient, which cannot start from a value: call "
                                   "optimizer.zero_grad(set_to_none=True) (or model.zero_grad()) before the .to()")
            with torch.no_grad():
                if spec["main_dtype"] != spec["grad_dtype"]:  # .grad is a copy: the engine accumulates in GRAD_SHARD
                    self.param_buffer.local_view(r, _C.BUF_GRAD_SHARD).copy_(g._local_tensor)
                r.grad_dtensor._local_tensor.copy_(g._local_tensor)
            self._has_grad[r.index] = 1
            r.dist_param.grad = r.grad_dtensor

    def _run_post_accumulate_grad_hooks(self, units) -> None:
        """[Note: post-accumulate-grad hooks]
        A hook the user registered on a sharded (DTensor) parameter with
        register_post_accumulate_grad_hook never fires by itself: autograd accumulates into the
        compute parameter, never into the DTensor. FSDP2 calls those hooks itself, once per
        parameter, after the group's reduce-scatter set the sharded .grad (foreach_reduce);
        this calls them once per parameter that has a gradient, after the reduction of every
        synced group is done (so an optimizer step inside a hook, torchtune's optimizer in
        backward, changes no weight another group still computes with: the next forward picks
        the new shards up, _refresh_changed_weights), groups in backward order (the last group
        first), parameters in registration order. A backward with gradient sync off reduces
        nothing and calls none, as FSDP2."""
        pending = [r for r in self.param_buffer.records
                   if r.unit in units and getattr(r.dist_param, "_post_accumulate_grad_hooks", None)]
        for r in sorted(pending, key=lambda r: (-r.unit, r.index)):
            dp = r.dist_param
            if dp.grad is not None:
                for hook in tuple(dp._post_accumulate_grad_hooks.values()):
                    hook(dp)


def to_sharded_hook(group: ShardGroup, *args, **kwargs) -> None:
    """The state-dict (save and load) pre-hook fully_shard puts on each module holding a
    parameter of `group`: its sharded parameters are registered, so a state dict taken or
    loaded between a forward and its backward sees the DTensors ([Note: per-group
    registration]; FSDP2's to_sharded_hook)."""
    if group.owner is not None:
        group.owner.register(group.unit_state.index, False)
