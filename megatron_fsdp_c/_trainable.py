"""requires_grad changed after sharding, in both APIs: read once per forward at the root against a
snapshot, then applied to the compute parameters, the engine (which items train, gradient
buffers), the gradient hooks and the backward gather order; checked for agreement across ranks.

[Note: changing requires_grad]
A parameter's requires_grad may change between steps, in both APIs, on the distributed (DTensor)
parameter the user sees (or, in the Megatron-FSDP API, on the original Parameter the module held),
and training follows it as it does under DDP (find_unused_parameters=True, every parameter
trainable when DDP was built) and FSDP2:
- Read at each forward of the root, outside backward (`RequiresGradTracker.sync`): both flags of
  each record against the snapshot of what is applied (`owner._trainable`, a byte per record); a
  flag that moved wins (the distributed one if both moved) and both parameters get it (and the
  DTensor compute parameter of dp_mesh_dims, with its gradient hook: RootState._trainable_changed
  in per_module/_root.py), so autograd computes exactly the trainable parameters' gradients. A
  change made inside a forward counts from the next one.
- Unfrozen: the engine expects its gradient from now on (a bucket created frozen gets its
  gradient buffers, and its records their `.grad` DTensor views, at its first trainable
  parameter); its gradient hook is registered then, once. It is reduced and attached like any
  other ([Note: unused parameters] in _owner.py) and stepped by the optimizers that hold it:
  fully_shard remaps a frozen parameter of the optimizer like any other; one that no optimizer
  holds joins through optimizer.add_param_group({"params": [p]}).
- Frozen: no further gradient; its `.grad` stays as it was (None after zero_grad(), else the last
  value, which an optimizer step may still apply), as DDP and FSDP2 leave it. Once no parameter of
  a bucket trains and none has a `.grad`, the bucket's gradient memory is freed ([Note:
  requires_grad changes] in csrc/comm/trainable.c).
- Why gradient memory follows rather than being planned for every floating parameter (frozen ones
  a cheap path): frozen parameters then keep buckets of their own, which hold no gradient memory
  and reduce nothing. benchmarks/frozen_backbone.py (its GPT, backbone frozen, world 2): held
  14.1 MiB against 24.2 (ZeRO-3), 26.2 against 46.4 (ZeRO-1), 28.2 against 48.4 (no_shard), the
  gradients 1-2 MiB against 11-22; step times equal within this shared machine's noise; the
  check at each forward costs 20-45 us.
- ZeRO-3 units whose trainability changed join or leave the shared backward gather order
  (HookManager.retrain, [Note: gather order] in _hooks.py) before the forward begins.
- Every rank must change the same parameters between the same two steps, as under DDP: whether a
  bucket reduces is part of the shared collective order ([Note: collective order] in
  csrc/comm/reduce.c). Each bucket's reduction carries, per item, a "trains" and a "frozen" flag
  of every rank ([Note: used-flag tail] in csrc/comm/reduce.c): both set in the reduced sums means
  the ranks disagreed, and the next sync raises a RuntimeError naming the parameters
  (`disagreement`; with replicas, at a sync whose reduction crossed them). Where a bucket carries
  no flags (see [Note: unused parameters] in _owner.py), a hash of the snapshot rides in the
  used-flag all-reduce instead (8 bytes and their complements under MAX: a
  byte agrees on every rank iff the two maxima sum to 255). When a disagreement changed the
  collectives themselves (a bucket reduced on some ranks only), the backward before that sync
  fails or times out in them instead (collective_timeout).
- Mixed precision: in the Megatron-FSDP API a bucket frozen at sharding keeps main weights of its
  compute dtype, so with a wider main_params_dtype its parameters cannot start training (a clear
  error naming the fix) unless they were trainable when sharded or the optimizer given to
  fully_shard holds them (their main weights are then planned wide). In the per-module API every
  floating parameter's main weights are planned in its own dtype, frozen or not, as FSDP2 keeps
  its sharded parameters (ParamRecord.trains_later, per_module/_root.py), so any can start
  training.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Dict, List

import torch.distributed as dist

from . import _C

if TYPE_CHECKING:
    from ._param_buffer import ParamRecord

__all__ = ["RequiresGradTracker"]


def _digest(state: bytearray) -> bytes:
    return hashlib.blake2b(bytes(state), digest_size=8).digest()


class RequiresGradTracker:
    """Keeps an engine owner's trainable set in step with its parameters' requires_grad (see
    [Note: changing requires_grad]). The owner's `_trainable` bytes are the snapshot; the hooks
    read them too."""

    def __init__(self, owner):
        """`owner`: the EngineOwner (_owner.py), with its param_buffer, hooks and byte arrays."""
        self.owner = owner
        self.buf = owner.param_buffer
        self.state = owner._trainable
        self.by_bucket: Dict[int, List["ParamRecord"]] = self.buf.records_by_bucket()
        self.releasable = set()  # buckets no parameter of which trains that still hold gradient memory
        self.digest = _digest(self.state)

    # -- once per forward, at the root ------------------------------------------------------------
    def sync(self) -> None:
        state = self.state
        changes = []
        for r in self.buf.records:
            now = state[r.index]
            if r.dist_param.requires_grad != now:
                changes.append((r, r.dist_param.requires_grad))
            elif r.param.requires_grad != now:
                changes.append((r, r.param.requires_grad))
        if changes:
            self._apply(changes)
        if self.releasable:
            self._release()

    def _apply(self, changes) -> None:
        for r, on in changes:
            why = self.buf.train_error.get(r.bucket) if on else None
            if why:
                raise ValueError(f"parameter '{r.name}' cannot start training: {why}")
        groups: Dict[tuple, List["ParamRecord"]] = {}
        for r, on in changes:
            for t in (r.param, r.dist_param):
                if t.requires_grad != on:
                    t.requires_grad_(on)
            self.state[r.index] = int(on)
            groups.setdefault((r.bucket, on), []).append(r)
        for (b, on), recs in groups.items():
            self._set_bucket(b, recs, on)
        hooks = self.owner.hooks
        hooks.hook_grads([r for r, on in changes if on])
        hooks.retrain()
        self.owner._trainable_changed()
        self.digest = _digest(self.state)

    def _set_bucket(self, b: int, recs: List["ParamRecord"], on: bool) -> None:
        buf = self.buf
        buf.engine.set_trainable(b, [r.item for r in recs], on)
        buf.trainable_items[b] += len(recs) if on else -len(recs)
        spec = buf.specs[b]
        if on and spec["grad_mode"] == _C.GRAD_NONE:  # the engine made its gradient buffers
            spec["grad_mode"] = spec["trainable_mode"]
            for r in self.by_bucket[b]:
                r.grad_dtensor = buf.dtensor(r, _C.BUF_OPT_GRAD)
        if buf.trainable_items[b] == 0 and spec["grad_mode"] != _C.GRAD_NONE:
            self.releasable.add(b)
        else:
            self.releasable.discard(b)

    def _release(self) -> None:
        """Frees the gradient memory of frozen buckets none of whose parameters has a `.grad`
        left, when the engine holds nothing of them still to reduce."""
        buf, owner = self.buf, self.owner
        for b in sorted(self.releasable):
            recs = self.by_bucket[b]
            if any(r.dist_param.grad is not None for r in recs) or \
                    buf.engine.grad_state(b) not in ("clean", "reduced"):
                continue
            buf.engine.release_grads([b])
            buf.specs[b]["grad_mode"] = _C.GRAD_NONE
            for r in recs:
                r.grad_dtensor = None
                owner._used[r.index] = owner._has_grad[r.index] = 0
            self.releasable.discard(b)

    # -- agreement across ranks -------------------------------------------------------------------
    def check_agreement(self, reduced: bytes) -> None:
        """`reduced`: the MAX over the ranks of this rank's digest followed by its complements."""
        if all(a + b == 255 for a, b in zip(reduced[:8], reduced[8:16])):
            return
        self.disagreement()

    def disagreement(self) -> None:
        """Raises the error naming the parameters the ranks train differently. Collective: every
        rank calls it at the same sync (every rank reduced the same flags)."""
        ctx = self.owner.dist_ctx
        states = [None] * ctx.dp_world
        dist.all_gather_object(states, bytes(self.state), group=ctx.all_dp_group)
        differ = []
        for r in self.buf.records:
            on = [k for k, s in enumerate(states) if s[r.index]]
            if 0 < len(on) < len(states):
                differ.append(f"'{r.name}' (trainable on ranks {on} only)")
        raise RuntimeError(
            "requires_grad differs across ranks: " + ", ".join(differ[:8]) + (" ..." if len(differ) > 8 else "") +
            ". Every rank must change the requires_grad of the same parameters between the same two steps (as "
            "under DDP): which gradients are reduced is part of the collective order all ranks share")

    def payload(self) -> bytes:
        """What this rank adds to the used-flag all-reduce: the digest and its complements."""
        return self.digest + bytes(255 - x for x in self.digest)
