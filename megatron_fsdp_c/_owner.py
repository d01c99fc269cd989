"""EngineOwner: what a sharded model's state does with the engine it owns, shared by the
Megatron-FSDP style wrapper (megatron_fsdp.py), the engine of its expert parameters
(_megatron_experts.py's ExpertOwner, with expt_device_mesh) and the per-module API's root state
(per_module/_root.py): the CPU heap, swapping compute and distributed parameters, the
unused-parameter flags, attaching gradients, introspection. Each is also the HookOwner
(_hooks.py) of its HookManager.

[Note: unused parameters]
At each sync every rank learns which parameters some rank used since their gradients were last
zeroed, and a parameter becomes "has a gradient" then (`_has_grad`), losing it only when
zero_grad(set_to_none=True) clears it: exactly torch's own `.grad` life cycle, also when graphs
differ across ranks. The flags ride in the gradient reductions the backward issues anyway ([Note:
used-flag tail] in csrc/comm/reduce.c: each bucket's reduction carries its items' flags in the
tail of every shard, `_reduced_flags` reads them), so a synced backward issues exactly FSDP2's
collectives; the same tail carries the check that every rank trains the same parameters
([Note: changing requires_grad] in _trainable.py). A backward that reduces nothing (every group's
sync off) reduces no flags either: they wait in the engine for the next reduction. Where a bucket
carries no flags (no_shard/ZeRO-1 gradients crossing the wire quantized, see the Note in
reduce.c), one small all-reduce per sync does it instead (MAX over the gradient hooks' local bytes,
`_used`, cleared when the optimizer zeroes them, and a digest of the trainable set:
`_used_anywhere`). Parameters used on some ranks only still get the others' zeros in the
reduction (see [Note: collective order] in csrc/comm/reduce.c).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch

from . import _C
from ._common import grad_tensors, in_backward
from ._hooks import HookManager
from ._trainable import RequiresGradTracker

if TYPE_CHECKING:
    from ._distributed import DistContext
    from ._param_buffer import ParamBuffer

__all__ = ["EngineOwner", "clip_grad_norm", "host_trim_bytes"]


def host_trim_bytes() -> int:
    """The bound of the CPU heap trim, from MFSDP_HOST_TRIM_BYTES (0: never trim)."""
    raw = os.environ.get("MFSDP_HOST_TRIM_BYTES", str(64 << 20))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"MFSDP_HOST_TRIM_BYTES={raw!r}: give a byte count (e.g. 67108864), or 0 to never "
                         "trim the CPU heap")
    return value


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch's clip_grad_norm_ for DTensor parameters on several meshes (torch refuses to stack
    norms of different meshes): each rank adds its local gradient pieces, each divided by how many
    ranks hold a copy (the product of its mesh's Replicate dims), and one all-reduce over every
    rank gives the exact norm; then the local pieces are scaled in place as torch does (coefficient
    max_norm / (norm + 1e-6), clamped to 1). Assumes the meshes together cover the default group
    (no pipeline stages outside them). Offloaded gradients live in host memory beside the device's:
    each piece's sum is moved to the device of the all-reduce. Returns the total norm (float64 on
    that device)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = _reduce_device(grads)
    total = torch.zeros((), dtype=torch.float64, device=device)
    inf = norm_type == float("inf")
    for g in grads:
        local = g._local_tensor if hasattr(g, "_local_tensor") else g
        if local.numel() == 0:
            continue
        if inf:
            total = torch.maximum(total, local.detach().abs().max().to(device, torch.float64))
            continue
        copies = 1
        for dim, placement in enumerate(getattr(g, "placements", ())):
            if placement.is_replicate():
                copies *= g.device_mesh.size(dim)
        total += (local.detach().to(torch.float64).abs().pow(norm_type).sum() / copies).to(device)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX if inf else torch.distributed.ReduceOp.SUM)
    norm = total if inf else total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local = g._local_tensor if hasattr(g, "_local_tensor") else g
        local.mul_(coef.to(local.device, local.dtype))
    return norm


def _reduce_device(grads) -> torch.device:
    """Where clip_grad_norm's all-reduce runs: a device gradient's device, else (every gradient in
    host memory, or none here) the GPU an NCCL-only default group needs, else the host."""
    for g in grads:
        if g.device.type != "cpu":
            return g.device
    if torch.distributed.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class EngineOwner:
    """A base class: the subclass builds and loads its ParamBuffer, then calls `_start` ([Note:
    owner start-up]); `_holds_dist_params` says which parameters the modules hold now."""

    param_buffer: "ParamBuffer"
    dist_ctx: "DistContext"
    hooks: "HookManager"
    _used: bytearray
    _has_grad: bytearray
    _trainable: bytearray  # a byte per record: requires_grad as applied ([Note: changing requires_grad])
    _trainable_tracker: RequiresGradTracker
    _holds_dist_params: bool
    _host_trim_bytes: int

    # -- the host heap (CPU) ----------------------------------------------------------------
    def _setup_host_heap(self, device) -> None:
        """CPU only: keep freed buffers for reuse, and trim the heap after a backward once resident
        memory grew by more than MFSDP_HOST_TRIM_BYTES (0: neither; see [Note: host heap trim]
        in csrc/python/host_heap.c)."""
        self._host_trim_bytes = host_trim_bytes() if device.type == "cpu" else 0
        if self._host_trim_bytes > 0:
            _C.keep_host_heap()

    def _trim_host_heap(self) -> None:
        if self._host_trim_bytes > 0:
            _C.trim_host_heap(self._host_trim_bytes)

    def _start(self, param_buffer: "ParamBuffer", unit_modules, **hook_options) -> None:
        """[Note: owner start-up]
        The one start-up of every owner (MegatronFSDP, ExpertOwner, RootState), once its buffer
        holds the weights and the distributed parameters exist: a byte per record for use
        (`_used`, `_has_grad`: [Note: unused parameters]) and for requires_grad as applied
        (`_trainable`), then the HookManager over `unit_modules` (it takes those bytearrays once:
        they are only ever changed in place), then the requires_grad tracker (which reads the
        hooks' orders, [Note: changing requires_grad] in _trainable.py)."""
        self.param_buffer = param_buffer
        records = param_buffer.records
        self._used = bytearray(len(records))      # used locally since the last zero (the gradient hooks)
        self._has_grad = bytearray(len(records))  # what torch would say: .grad is not None
        self._trainable = bytearray(int(r.requires_grad) for r in records)
        self.hooks = HookManager(self, unit_modules, **hook_options)
        self._trainable_tracker = RequiresGradTracker(self)

    # -- requires_grad ([Note: changing requires_grad] in _trainable.py) ----------------------

    def _sync_requires_grad(self) -> None:
        """At the root's pre-forward: applies requires_grad changes made since the last forward."""
        if not in_backward():
            self._trainable_tracker.sync()

    def _trainable_changed(self) -> None:
        """Called after requires_grad changes were applied (the hooks' orders already follow)."""

    # -- parameters -----------------------------------------------------------------------
    def _swap_params(self, dist: bool) -> None:
        """Registers the distributed (dist=True) or the compute parameters on the modules."""
        if self._holds_dist_params == dist:
            return
        for r in self.param_buffer.records:
            p = r.dist_param if dist else r.param
            for mod, attr in r.places:
                mod._parameters[attr] = p
        self._holds_dist_params = dist

    def _finish_root_forward(self, output):
        """The root's post-forward work: the hooks' settling, then the sharded parameters back
        on the modules when no backward will come to swap them (no grad, or no graph)."""
        output = self.hooks.root_post_forward(output)
        if not torch.is_grad_enabled() or not grad_tensors(output):
            self._swap_params(dist=True)
        return output

    # -- gradients ------------------------------------------------------------------------
    def _used_anywhere(self) -> bytes:
        """The used-parameter bytes OR-ed over the data-parallel ranks (one small collective, which
        also checks that every rank trains the same parameters): only where a bucket carries no
        flag tail (see [Note: unused parameters])."""
        ctx = self.dist_ctx
        n = len(self._used)
        if ctx.dp_world == 1:
            return bytes(self._used)
        payload = bytearray(self._used) + self._trainable_tracker.payload()
        flags = torch.frombuffer(payload, dtype=torch.uint8).to(ctx.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=ctx.all_dp_group)
        reduced = bytes(flags.cpu().numpy()) if flags.is_cuda else bytes(flags.numpy())
        self._trainable_tracker.check_agreement(reduced[n:])
        return reduced[:n]

    def _reduced_flags(self, records) -> Optional[bytes]:
        """The used bytes of `records` (by record index) as their buckets' reductions brought them
        ([Note: used-flag tail] in csrc/comm/reduce.c): no collective. Raises when ranks trained
        different parameters (checked where the reduction crossed every rank: with replicas, not
        after set_requires_all_reduce(False), whose flags are the replica's, as its gradients are).
        None when a bucket of theirs carries no flags."""
        engine = self.param_buffer.engine
        by_bucket = {}
        for r in records:
            by_bucket.setdefault(r.bucket, []).append(r)
        flags = {}
        for b in by_bucket:
            flags[b] = engine.read_flags(b)  # (used, split), decoded by the engine
            if flags[b] is None:
                return None
        used = bytearray(len(self._used))
        split = False
        for b, recs in by_bucket.items():
            bucket_used, bucket_split = flags[b]
            for r in recs:
                used[r.index] = bucket_used[r.item]
                split = split or bool(bucket_split[r.item])
        if split:
            self._trainable_tracker.disagreement()
        return bytes(used)

    def _grads_due(self, records) -> Optional[bytearray]:
        """A byte per record index, 1 where the coming `_attach_grads` will give `.grad` (what a
        bucket stepped in the backward steps, [Note: stepping in backward] in _backward_step.py),
        changing nothing; None when the flags arrive only at the sync."""
        used = bytes(self._used) if self.dist_ctx.dp_world == 1 else self._reduced_flags(records)
        if used is None:
            return None
        due = bytearray(len(self._used))
        for r in records:
            due[r.index] = used[r.index] or self._has_grad[r.index]
        return due

    def _drop_grads(self) -> None:
        """Every gradient gone: the engine's zeroed (held ones too), `.grad` detached, the used
        flags cleared in place (the hooks hold the bytearray). zero_grad, reset_iter_state, and
        a backward that raised ([Note: a backward that raised] in _hooks.py)."""
        self.param_buffer.engine.zero_grads()
        for r in self.param_buffer.records:
            r.dist_param.grad = None
        self._used[:] = bytes(len(self._used))
        self._has_grad[:] = bytes(len(self._has_grad))

    def _attach_grads(self, records) -> None:
        """`.grad` of each distributed parameter of `records`: its gradient DTensor once some
        rank used it, None until then (see [Note: unused parameters]). With nothing to attach (every
        group's gradient sync off) nothing is read: the flags wait in the engine."""
        records = [r for r in records if r.grad_dtensor is not None]
        if not records:
            return
        used = bytes(self._used) if self.dist_ctx.dp_world == 1 else self._reduced_flags(records)
        if used is None:
            used = self._used_anywhere()
        has = self._has_grad
        for r in records:
            if used[r.index]:
                has[r.index] = 1
            r.dist_param.grad = r.grad_dtensor if has[r.index] else None

    # -- introspection --------------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{name: full tensor} of the main weights, gathered on every rank (collective)."""
        return {r.name: r.dist_param.full_tensor().clone() for r in self.param_buffer.records}

    @torch.no_grad()
    def full_grads(self) -> dict:
        """{name: full tensor} of the optimizer gradients (after a sync), gathered on every
        rank (collective); frozen parameters are left out."""
        return {r.name: r.grad_dtensor.full_tensor().clone() for r in self.param_buffer.records
                if r.grad_dtensor is not None}

    def memory_report(self, optimizer: Optional[torch.optim.Optimizer] = None, locations: bool = False) -> dict:
        """Bytes this rank holds now: parameters (compute + main), gradients, optimizer state,
        and temporary buffers currently materialised (full weights / gradient buckets); with
        `locations`, also on which devices each kind of state lives."""
        return self.param_buffer.memory_report(optimizer, locations)

    def comm_stats(self, bucket: int = -1) -> dict:
        """Collectives issued so far (counts and bytes), for one bucket or all."""
        return self.param_buffer.engine.stats(bucket)

