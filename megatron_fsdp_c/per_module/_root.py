"""The root state of the per-module API: at the first forward of a root, one engine for every
group under it (the lazy init, see [Note: per-module groups] in _fully_shard.py); the owner its
HookManager sees, with the DTensor compute parameters of dp_mesh_dims ([Note: SPMD compute
parameters]) and the Registration of what each group's modules hold (_registration.py); the
engine handed back for a .to() ([Note: re-initialisation]); the step ends outside a backward
(pipelining, finalize_backward, reset_iter_state); and the forward hooks fully_shard registers on
every sharded module. One object: the step ends and the hand-back read and write a dozen of the
root's fields (groups, held units, pass state, engine), so an object of their own would only hold
the root again.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.distributed.tensor import DTensor, Replicate

from .. import _C
from .._common import ShardingStrategy, in_backward, move_storage, weak_call
from .._extensions import ExtensionGathers, ExtensionParam, check_local_shard, is_extension, plan_inputs, shard_mesh
from .._owner import EngineOwner
from ..mixed_precision import MixedPrecisionPolicy as OurPolicy
from .._param_buffer import ParamBuffer, ParamRecord, UnitConfig
from ._group import ShardGroup, check_extension_use, check_origins, group_of, refresh_places
from ._lazy_init import check_materialised, check_meshes, groups_under, post_order
from ._policy import cast_floats, compute_dtype, engine_policy, is_cpu_offload, is_torch_policy
from ._registration import Registration, to_sharded_hook
from ._stepped import watch_optimizer_steps

__all__ = ["RootState", "build_states", "post_forward", "pre_forward", "state_of", "to_sharded_hook"]


class RootState(EngineOwner):
    """The engine of one root's groups (see [Note: per-module groups] in _fully_shard.py); the
    HookOwner (_hooks.py) of its HookManager."""

    overlap_param_gather = True

    def owners(self) -> tuple:
        """Every engine owner of this state's model (one RootState per mesh, [Note: a mesh per
        group]), in the one order every rank drives them, as MegatronFSDP.owners()."""
        return self._owners

    def __init__(self, root: nn.Module, groups: List[ShardGroup]):
        self.root = root
        self.groups = groups  # this engine's: the groups under the root on one mesh ([Note: a mesh per group])
        self._owners = (self,)  # every root state of the model, this one among them (build_states)
        for g in groups:  # FSDP2's default (None): reshard after forward, except the root
            if g.reshard_after_forward is None:
                g.reshard_after_forward = g is not getattr(root, "_mfsdp_group", None)
        self.methods_running = 0  # registered forward methods running (_torch_state.py)
        self.reduce_requested = False  # a post_backward() asked for the held gradients' reduction
        self.held_units = set()  # indices of groups whose backwards held gradients back, not reduced yet
        self.dist_ctx = ctx = groups[0].ctx
        names = {id(mod): name for name, mod in root.named_modules(remove_duplicate=False)}
        fqn = lambda mod, attr: f"{names[id(mod)]}.{attr}" if names.get(id(mod)) else attr  # noqa: E731
        for g in groups:  # parameters replaced since fully_shard are the groups' now (FSDP2's reset_sharded_param)
            refresh_places(g)
        check_origins([(fqn(mod, attr), dp) for g in groups for mod, attr, dp in g.places], self)
        check_materialised(groups, fqn)
        ends = {}  # group index -> position of its (last) module in post-order: backward order
        for k, mod in enumerate(post_order(root)):
            g = getattr(mod, "_mfsdp_group", None)
            if g is not None and g in groups:  # (groups on another mesh are another engine's)
                ends[groups.index(g)] = k
        records, spmd_specs, exts = [], {}, []
        policies = [{} for _ in groups]  # per group: compute dtype -> engine policy (each UnitConfig's, whole)
        sites = {}  # id(dp) -> every (module, attribute) holding it, in group order: one record each
        for g in groups:
            for mod, attr, dp in g.places:
                sites.setdefault(id(dp), []).append((mod, attr))
        made = set()
        for u, g in enumerate(groups):
            for (mod, attr, dp), tp in zip(g.places, g.tp_specs):
                name = fqn(mod, attr)
                if id(dp) in made:  # an alias: the record made at its first place has it
                    continue
                made.add(id(dp))
                # hooks set on the local shard after fully_shard (FSDP2 finds them there)
                check_local_shard(dp._local_tensor, f"the local shard of parameter '{name}'")
                mp = g.param_policies.get((id(mod), attr), g.mp_policy)  # torch 2.15: per parameter
                compute, policy = engine_policy(mp, compute_dtype(
                    mp, g.compute_dtypes.get((id(mod), attr)), dp.dtype, f"parameter '{name}'"), dp)
                add_unit_policy(policies[u], compute, policy, name)
                # the compute parameter: pointed at the full weights by load_locals; a TP
                # parameter's is a DTensor on the TP mesh over its gathered TP shard
                empty = torch.empty(0, dtype=compute, device=ctx.device)
                placeholder = nn.Parameter(empty, requires_grad=dp.requires_grad) if tp is None \
                    else tp.compute_param(empty, dp.requires_grad)
                # the shard dim is the data-parallel mesh's last (a TP placement follows it)
                replicated = isinstance(dp.placements[ctx.mesh.ndim - 1], Replicate)
                shard_dim = 0 if replicated else dp.placements[ctx.mesh.ndim - 1].dim
                extension = is_extension(dp._local_tensor)  # [Note: extension parameters] in ../_extensions.py
                if extension:
                    check_extension_use(f"parameter '{name}'", ctx, tp, (id(mod), attr) in g.spmd_specs,
                                        None if replicated else shard_dim, g.quant_policy)
                # FSDP2 keeps every sharded parameter in its own dtype, frozen or not: main weights
                # planned so, any floating one can start training (trains_later; [Note: changing
                # requires_grad]; _bucket_dtypes.bucket_dtypes ignores the others)
                r = ParamRecord(
                    len(records), name, placeholder, dp.shape if tp is None else tp.local_shape, u, sites[id(dp)],
                    replicated=replicated, shard_dim=shard_dim, dist_param=dp, tp=tp, extension=extension,
                    trains_later=True, aliases=[fqn(m, a) for m, a in sites[id(dp)]])
                if extension:
                    exts.append(ExtensionParam(r, mod, mp, getattr(mp, "param_dtype", None) or dp.dtype, []))
                records.append(r)
                if (id(mod), attr) in g.spmd_specs:
                    spmd_specs[r.index] = g.spmd_specs[(id(mod), attr)]
        # what the buffer builds each group with
        units = [UnitConfig(g.strategy, g.quant_policy, None, policies[u], is_cpu_offload(g.offload_policy))
                 for u, g in enumerate(groups)]
        # outside every group: nothing but the model's plan (sharded) and the payloads' policy
        outside = UnitConfig(ShardingStrategy.OPTIM_GRADS_PARAMS, None, OurPolicy())
        if exts:  # every rank's all-gather inputs, planned once ([Note: extension parameters])
            plan_inputs(exts, shard_mesh(ctx), ctx.group, ctx.world, ctx.rank)
        buf = ParamBuffer(records, ctx, units, outside, bucket_cap=0,
                          reduce_queue_bytes=None, grad_prescale=1.0 / ctx.dp_world, reduce_op="sum",
                          payloads=[(e.record.unit, i) for e in exts for i in e.inputs],
                          pin_host=any(getattr(g.offload_policy, "pin_memory", False) for g in groups))
        buf.load_locals()
        buf.build_dist_params(self, existing=True)
        self._setup_host_heap(ctx.device)
        self._start(buf, [g.modules[0] for g in groups],  # [Note: owner start-up] in ../_owner.py
                    post_order=sorted(range(len(groups)), key=lambda u: ends.get(u, -1)), register_module_hooks=False)
        self.extension_gathers = ExtensionGathers(buf, exts, shard_mesh(ctx), self.hooks) if exts else None
        self.adopt_grads()  # gradients carried through a .to() ([Note: re-initialisation])
        self._seen = [r.dist_param._version for r in records]
        self._optimizer_stepped = False  # [Note: stepped parameters] in _stepped.py
        watch_optimizer_steps()
        self.report_nan_in_param_grad = False
        self.pass_root = None
        for u, g in enumerate(groups):
            g.owner, g.unit_state = self, self.hooks.unit_states[u]
            g.unit_state.members = g.unit_state.members_left = len(g.modules)
            if len(g.modules) > 1:
                self.hooks.grouped.append(g.unit_state)
        for g in groups:  # prefetch targets name other groups' units: all of them set first
            self.configure(g)
        self._spmd_hooked = set()  # indices of SPMD compute parameters with their gradient hook
        spmd_params = {i: self._spmd_param(records[i], *spec) for i, spec in spmd_specs.items()}
        unit_records = [[] for _ in groups]
        for r in records:
            unit_records[r.unit].append(r)
        self.registration = Registration(unit_records, spmd_params)  # [Note: per-group registration]

    # -- compute parameters on the SPMD mesh of dp_mesh_dims ----------------------------------------
    def _spmd_param(self, r, mesh, placements) -> nn.Parameter:
        """[Note: SPMD compute parameters]
        With dp_mesh_dims, parameters that came as DTensors replicated over the full SPMD mesh
        (torchtitan's full_dtensor backend: parameters, buffers and inputs all DTensors there)
        compute as DTensors with that mesh and those placements, as FSDP2's unsharded parameters
        do (torch's _fsdp_param.py wraps the all-gather output in the parameter's original spec):
        a plain compute parameter would meet DTensor activations ("mixed torch.Tensor and
        DTensor"). This DTensor Parameter's local tensor is the plain compute parameter's storage
        (the engine's full weights; Registration.register in _registration.py re-aims it if that
        moved). Its gradient keeps the placements autograd gave it over the data-parallel dims
        (Partial: this rank's contribution), and its local tensor goes to the engine through the
        hooks' gradient hook,
        as torch reduce-scatters the local tensor of the Partial gradient; the other dims have
        size 1 (model-parallel dims > 1 are refused by _mesh.py's dp_mesh_of), so nothing needs
        redistributing. Parameters that came plain (torchtitan's spmd_types backend, which torch
        2.13's FSDP2 refuses) compute plain."""
        sp = nn.Parameter(DTensor.from_local(r.param.detach(), mesh, placements, run_check=False),
                          requires_grad=r.param.requires_grad)
        if sp.requires_grad:
            self._hook_spmd(r, sp)
        return sp

    def _hook_spmd(self, r, sp) -> None:
        self._spmd_hooked.add(r.index)
        sp.register_post_accumulate_grad_hook(weak_call(self.hooks, "grad_hook", r.index, r.bucket, r.item,
                                                        to_local=_local_of))  # [Note: hooks hold their owner weakly]

    # -- per-group settings, applied to the engine ------------------------------------------------
    def buckets_of(self, g: ShardGroup) -> List[int]:
        return list(self.param_buffer.buckets_of_unit(self.groups.index(g)))

    def configure(self, g: ShardGroup) -> None:
        unit_state, engine = g.unit_state, self.param_buffer.engine
        unit_state.reshard_after_forward = g.reshard_after_forward
        unit_state.reshard_after_backward = g.reshard_after_backward
        unit_state.forward_prefetch = None if g.forward_prefetch is None else [
            group_of(m).unit_state.pos for m in g.forward_prefetch if group_of(m).unit_state.pos >= 0]
        unit_state.backward_prefetch = None if g.backward_prefetch is None else [
            group_of(m).unit_state.bpos for m in g.backward_prefetch if group_of(m).unit_state.bpos >= 0]
        engine.set_keep_weights(self.buckets_of(g), g.keep_unsharded_storage)  # [Note: kept full weights]
        # every bucket that can train, also while frozen ([Note: changing requires_grad] in ../_trainable.py)
        grads = [b for b in self.buckets_of(g) if self.param_buffer.specs[b]["trainable_mode"] != _C.GRAD_NONE]
        if grads:
            engine.set_hold(grads, g.hold)
            if self.dist_ctx.outer_world > 1:
                engine.set_outer_hold(grads, g.outer_hold)
            # [Note: expert gradient scaling]
            # A group's gradients are summed over its mesh's data-parallel ranks after dividing by
            # its divide factor: by default the mesh's data-parallel size (FSDP2's default, so an
            # FSDP2 script gives FSDP2's numbers), else set_gradient_divide_factor's. For experts
            # under expert parallelism the default is not the average: an expert's gradient on a
            # rank already holds the contributions of every ep peer's tokens (the all-to-all's
            # backward brings them), so summing over its dp_mod_ep mesh sums over all dp ranks,
            # and the average over the data (each rank's loss a mean over its own batch) needs the
            # full data-parallel degree as divisor. torchtitan sets exactly that
            # (moe.experts.set_gradient_divide_factor(parallel_dims.fsdp_gradient_divide_factor)),
            # and so does Megatron-LM (expert_gradient_scaling_factor = 1 / the data-parallel
            # size, not the expert data-parallel size). With FSDP2 a script must call it too;
            # we keep FSDP2's default for drop-in parity ([Note: a mesh per group]). The
            # Megatron-style API's expt_device_mesh applies Megatron-LM's factor itself ([Note:
            # expert data-parallel mesh] in ../_megatron_experts.py).
            factor = g.divide_factor if g.divide_factor is not None else self.dist_ctx.dp_world
            engine.set_prescale(grads, 1.0 / factor)

    def _trainable_changed(self) -> None:
        records = self.param_buffer.records
        for i, sp in self.registration.spmd_params.items():  # they follow their plain compute parameters
            on = bool(self._trainable[i])
            if sp.requires_grad != on:
                sp.requires_grad_(on)
            if on and i not in self._spmd_hooked:
                self._hook_spmd(records[i], sp)
        for g in self.groups:  # backward prefetch targets name positions in the backward order
            self.configure(g)

    # -- what the hooks call ----------------------------------------------------------------------
    def root_pre_forward(self, module) -> None:
        self.hooks.end_abandoned_backward()  # first: it may raise ([Note: a backward that raised] in ../_hooks.py)
        self.pass_root = module
        self._sync_requires_grad()
        for g in self.groups:  # set_post_optim_event: the current stream waits on it once
            if g.post_optim_event is not None:
                g.post_optim_event.wait()
                g.post_optim_event = None
        self.hooks.backward_steps.join()  # the shards it refreshes: [Note: stepping in backward]
        self._refresh_changed_weights()
        self.hooks.root_pre_forward()

    def root_post_forward(self, output):
        self.pass_root = None
        return self.hooks.root_post_forward(output)  # each group registered by its own flags

    def _note_optimizer_step(self) -> None:
        self._optimizer_stepped = True

    def _refresh_changed_weights(self) -> None:
        """An optimizer (or a load) changed some local shards in place since the last forward:
        spread them to what the engine keeps gathered or cast (see [Note: per-module groups] in
        _fully_shard.py)."""
        changed, self._optimizer_stepped = self._optimizer_stepped, False  # [Note: stepped parameters]
        for r in self.param_buffer.records:
            v = r.dist_param._version
            if v != self._seen[r.index]:
                self._seen[r.index] = v
                changed = True
        if changed:
            self.param_buffer.engine.install_main_weights(True)

    def _should_sync(self) -> bool:
        return True  # per group: a group with gradient sync off is on hold in the engine

    def _before_backward(self) -> None:
        """Gradients the user set to None (optimizer.zero_grad()) start again from zero."""
        stale = [r for r in self.param_buffer.records if self._has_grad[r.index] and r.dist_param.grad is None]
        by_bucket = {}
        for r in stale:
            by_bucket.setdefault(r.bucket, []).append(r.item)
            self._has_grad[r.index] = 0
            self._used[r.index] = 0
        for b, items in by_bucket.items():
            self.param_buffer.engine.zero_item_grads(b, items)

    def _drop_grads(self) -> None:
        super()._drop_grads()
        self.held_units.clear()  # the engine dropped what they held

    def _after_backward(self, synced: bool) -> None:
        if synced:  # the optimizer's gradients of their own, filled (offloaded no_shard/ZeRO-1: [Note: CPU offload])
            self.param_buffer.engine.sync_grads()
        synced_units = {u for u, g in enumerate(self.groups) if not g.hold}
        self.held_units = {u for u in self.held_units if u not in synced_units}
        self.held_units |= {u for u, g in enumerate(self.groups) if u not in synced_units and g.unit_state.grad_buckets}
        self._attach_grads([r for r in self.param_buffer.records if r.unit in synced_units])
        for u in sorted(synced_units):
            if self.groups[u].all_reduce_hook is not None:
                self._run_all_reduce_hook(self.groups[u])
        self._run_post_accumulate_grad_hooks(synced_units)
        self._trim_host_heap()

    def _run_all_reduce_hook(self, g: ShardGroup) -> None:
        """set_all_reduce_hook's hook on each of the group's reduced gradient shards: this rank's
        rows of the bucket in the buffer the parameters' .grad views."""
        hook, stream = g.all_reduce_hook
        buf = self.param_buffer
        shards = []
        for b in g.unit_state.grad_buckets:
            pieces = [buf.engine.local_piece(b, r.item, _C.BUF_OPT_GRAD) for r in buf.records if r.bucket == b]
            where = pieces[0][0]
            lo, hi = min(o for _, o, _ in pieces), max(o + n for _, o, n in pieces)
            shards.append(torch.from_dlpack(buf.engine.tensor(b, where)).narrow(0, lo, hi - lo))
        if stream is None:
            for t in shards:
                hook(t)
            return
        # the device's module (torch.cuda, or torch.cpu whose streams only stand in for them, as
        # FSDP2 runs the hook with torch.get_device_module(device))
        device_module = torch.get_device_module(self.dist_ctx.device.type)
        current = device_module.current_stream()
        stream.wait_stream(current)
        with device_module.stream(stream):
            for t in shards:
                hook(t)
        current.wait_stream(stream)

    # -- [Note: per-group registration] in _registration.py: the hooks' calls ----------------------
    def _unit_gathering(self, unit_state) -> None:  # HookOwner (_hooks.py)
        if self.extension_gathers is not None:
            self.extension_gathers.gathering(unit_state.index)

    def _unit_unsharded(self, unit_state) -> None:  # HookOwner (_hooks.py)
        if self.extension_gathers is not None:  # [Note: extension parameters] in ../_extensions.py
            self.extension_gathers.unsharded(unit_state.index, self.registration.unsharded[unit_state.index])
        self.registration.register(unit_state.index, True)

    def _unit_resharded(self, unit_state) -> None:  # HookOwner (_hooks.py)
        if self.extension_gathers is not None:
            self.extension_gathers.resharded(unit_state.index)
        self.registration.register(unit_state.index, False)

    def reshard_group(self, g: ShardGroup) -> None:
        """FSDPModule.reshard(): releases the group's gathered weights (ZeRO-3) and registers
        its sharded parameters."""
        if g.unit_state.releasable:
            self.param_buffer.engine.reshard(list(g.unit_state.releasable))
        self._unit_resharded(g.unit_state)

    # -- handing the engine back for a .to() ----------------------------------------------------
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
        self.registration.register_all(False)
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

    # -- step ends outside a backward: pipelining, finalize_backward, reset_iter_state -----------
    def reduce_held(self) -> None:
        """[Note: reductions outside a backward]
        torch.distributed.pipelining runs every microbatch's backward with gradient sync off, then
        asks for the reduction itself, outside any backward (stage.perform_reduce_grad: through
        torch's state key before torch 2.15, see _torch_state.py; FSDPModule.finalize_backward
        from 2.15). The engine reduces in a backward only, so this runs one without autograd: the
        buckets of the groups that held gradients back (and whose sync is on again) are sealed,
        all others put on hold meanwhile so that they send nothing, and end_backward reduces them
        in the shared order; then the releases and .grad follow as in a backward's final
        callback. Every rank of the data-parallel group calls it at the same point (pipelining
        does), so the collectives match."""
        self.reduce_requested = False
        held = [u for u in sorted(self.held_units) if not self.groups[u].hold]
        if not held:
            return
        if self.hooks.pass_state.in_backward:
            raise RuntimeError("the reduction of held gradients was requested inside a backward pass")
        engine = self.param_buffer.engine
        sealed = [b for u in held for b in self.groups[u].unit_state.grad_buckets]
        others = [b for b in self.param_buffer.grad_buckets() if b not in sealed]
        if others:
            engine.set_hold(others, True)
        try:
            engine.begin_backward(True)
            engine.seal(sealed)
            engine.end_backward()
        finally:
            for g in self.groups:  # each bucket's own hold back
                self.configure(g)
        self.release_after_backward()
        self._after_backward(True)

    def release_after_backward(self) -> None:
        """Releases the gathered weights of the groups set to reshard after backward, and registers
        their sharded parameters, as a backward's final callback does."""
        release = [b for s in self.hooks.unit_states if s.reshard_after_backward for b in s.releasable]
        if release:
            self.param_buffer.engine.reshard(release)
        for s in self.hooks.unit_states:  # (s: a unit state)
            if s.reshard_after_backward:
                self.registration.register(s.index, False)

    def finalize_backward(self) -> None:
        """[Note: manual backward finalization]
        torch 2.15's FSDPModule.finalize_backward on the root: after the backwards of one logical
        step (run with gradient sync off, then sync turned back on), reduce what they held and
        reshard by the groups' current settings (2.15's pipelining stage does exactly this in
        perform_reduce_grad). FSDP2 in manual mode skips a backward's own final callback and
        leaves that work here; ours always runs it at each backward's end, and this completes
        whatever the backwards left: held gradients (reduce_held) and gathered weights. So the
        gradients are reduced, and the weights released, by the time finalize_backward returns
        (earlier than FSDP2 where a backward synced), which is what its contract lets a caller
        rely on. Every rank calls it at the same point."""
        if self.hooks.pass_state.in_backward or in_backward():
            raise RuntimeError("finalize_backward was called inside a backward pass: call it after the backward "
                               "passes of the step, before reading or clearing gradients")
        self.reduce_held()
        self.release_after_backward()

    def reset_iter_state(self) -> None:
        """FSDPModule.reset_iter_state on the root: a forward or backward raised part way. An
        interrupted backward is ended (its collectives run: every rank calls this), the step's
        gradients are discarded, every gathered bucket is released and the sharded parameters
        are put back; the hooks' per-pass positions start again."""
        engine, hooks = self.param_buffer.engine, self.hooks
        try:
            if hooks.pass_state.in_backward:
                engine.end_backward()
        finally:
            hooks.reset_pass()
        self._drop_grads()
        if hooks.all_sharded:
            engine.reshard(list(hooks.all_sharded))
        self.pass_root, self.methods_running, self.reduce_requested = None, 0, False
        self.registration.register_all(False)

    # -- hooks after the reduction ---------------------------------------------------------------
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


def add_unit_policy(policies: dict, compute: torch.dtype, policy, name: str) -> None:
    """Adds the engine policy of a group's parameters that compute in `compute` to the group's
    `policies` (compute dtype -> policy, its UnitConfig's once whole): one per group and compute
    dtype (a bucket holds one group's parameters of one compute dtype). Parameters that would need
    two (different storage or gradient dtypes under one param_dtype) are refused, as FSDP2 refuses
    non-uniform dtypes in a group."""
    known = policies.setdefault(compute, policy)
    if known != policy:
        raise ValueError(f"parameter '{name}' computes in {compute} like other parameters of its fully_shard group, "
                         f"but needs other main weights or gradient reduction ({policy}) than they do ({known}): a "
                         "group's parameters must share their dtype (and grad_dtype), as FSDP2 requires. Convert them "
                         "to one dtype before fully_shard, or shard them in separate groups")


def build_states(root: nn.Module) -> List[RootState]:
    """[Note: a mesh per group]
    Expert parallelism shards a model over two meshes (torchtitan: the dense blocks over every
    data-parallel rank, `fully_shard(block.moe.experts, mesh=dp_mod_ep_mesh)` over the ranks that
    hold the same experts), and any fully_shard call may name its own mesh, as in FSDP2. The lazy
    init builds one engine (a RootState: its buckets, communicators, hooks and collective
    orders) per distinct mesh under the root (meshes compare by their ranks and dim names,
    _group.py's _mesh_and_context), each over the groups on that mesh; the first engine is the
    root group's. Each group gathers and reduces on its own mesh's communicators.
    Why rank-divergent graphs still cannot deadlock: each engine keeps the invariants of one
    ([Note: gather order] in ../_hooks.py, [Note: collective order] in csrc/comm/reduce.c) over
    its own communicators, so every rank of a communicator issues that engine's collectives in
    one order; each engine gathers on a communicator of its own (made per mesh), and reduces on
    its mesh's process group. A pass starts and ends on every engine at once (the root's pre-
    and post-forward call every sibling, in this list's order, the same on every rank), so every
    engine settles the groups its rank skipped and queues its backward's final callback from the
    root's outputs in the same order on every rank. Not covered: two meshes over the same ranks
    whose dims torch backs with one process group (a dim over every rank reuses the default
    group), where the two engines' reductions share it: they follow the model's order, the same
    on every rank only while the ranks' graphs agree.
    Checked the same way on every rank, so that every rank raises the same error instead of
    hanging: when fully_shard first meets a mesh over some of the ranks, before its process
    groups are made (_lazy_init.py's check_sub_mesh: one all_gather_object over all ranks), that
    the ranks' meshes partition them (each contains its rank, one size dividing the world, the
    same set on every rank it names: torchtitan's dp_mod_ep meshes {0,2} and {1,3}); at the
    lazy init of a model on several meshes (check_meshes: one all_gather_object over the root
    mesh's data-parallel ranks), that every rank has the same number of meshes, each within the
    root mesh's ranks with a size dividing their number, and that no parameter is registered in
    groups on two meshes.
    Gradient scaling per mesh: [Note: expert gradient scaling] (RootState.configure)."""
    groups = groups_under(root)
    parts = {}  # id(ctx) -> the groups on that mesh, in module order (the root's first)
    for g in groups:
        parts.setdefault(id(g.ctx), []).append(g)
    parts = list(parts.values())
    if len(parts) > 1:
        check_meshes(root, parts)
    states = [RootState(root, part) for part in parts]
    for s in states:
        s._owners = tuple(states)
    return states


def _local_of(grad):
    """The local tensor of an SPMD compute parameter's gradient ([Note: SPMD compute parameters])."""
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def root_of(g: ShardGroup) -> nn.Module:
    """The module whose first forward (or unshard()) initialises `g`'s engine: the outermost
    sharded module above g (FSDP2's root: the model), found through the groups' parents."""
    while g.parent is not None:
        g = g.parent
    return g.modules[0]


def state_of(module) -> RootState:
    """The root state of `module`'s group. The first call for any group of a model is the lazy
    init, through the model's root (root_of): a first forward or unshard() of a
    child initialises every group under the root, as the root's first forward would."""
    g = group_of(module)
    if g.owner is None:
        # A first forward inside a functorch transform (torch.func.jvp, vmap, grad): the tensors
        # made there would be the transform's wrappers (no storage for the engine to adopt, and
        # DTensor.from_local refused): the engine is built outside the transforms, as the
        # weights are plain tensors outside them.
        with temporarily_clear_interpreter_stack():
            build_states(root_of(g))
    return g.owner


@torch.compiler.disable(recursive=True)
def pre_forward(module, args, kwargs):
    """fully_shard's forward pre-hook on each module of a group: the root's pre-forward when a pass
    starts here ([Note: pass lifecycle] in ../_hooks.py), the input cast, the unit's pre-forward."""
    g = module._mfsdp_group
    state = state_of(module)
    if state.pass_root is None and not in_backward():
        for s in state.owners():  # every engine of the model ([Note: a mesh per group])
            s.root_pre_forward(module)
    mp = g.mp_policy
    if is_torch_policy(mp) and mp.cast_forward_inputs and mp.param_dtype is not None:
        args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
    return state.hooks.pre_forward(g.unit_state, module, args, kwargs)


@torch.compiler.disable(recursive=True)
def post_forward(module, args, output):
    """fully_shard's forward hook on each module of a group: the unit's post-forward, the output
    cast, and the root's post-forward when the pass started at this module."""
    g = module._mfsdp_group
    state = g.owner
    output = state.hooks.post_forward(g.unit_state, module, args, output)
    mp = g.mp_policy
    if is_torch_policy(mp) and mp.output_dtype is not None:
        output = cast_floats(output, mp.output_dtype)
    if state.pass_root is module and not state.methods_running:  # a registered method's end, not its inner forwards
        for s in state.owners():
            output = s.root_post_forward(output)
    return output

