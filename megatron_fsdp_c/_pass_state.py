"""The state the hooks keep (_hooks.py's HookManager): one UnitState per unit (the object, named
unit_state wherever it is held; a "unit" alone is its index, as ParamRecord.unit: tests/test_docs.py
checks that no `unit` has attributes), and one PassState for where the current pass
stands, replaced whole when a pass starts again (HookManager.reset_pass)."""
from __future__ import annotations

__all__ = ["PassState", "UnitState"]


class UnitState:
    """One unit of a HookManager: its buckets, its positions in the shared gather orders ([Note:
    gather order] in _hooks.py), and the per-unit settings the per-module API configures."""
    __slots__ = ("index", "module", "buckets", "releasable", "grad_buckets", "pos", "bpos", "members",
                 "members_left", "reshard_after_forward", "reshard_after_backward", "forward_prefetch",
                 "backward_prefetch")

    def __init__(self, index, module, buckets, releasable, grad_buckets):
        self.index = index
        self.module = module
        self.buckets = buckets            # bucket ids to gather before the unit runs
        self.releasable = releasable      # ZeRO-3 bucket ids to release after it ran
        self.grad_buckets = grad_buckets  # bucket ids with trainable parameters
        self.pos = -1                     # position in the forward gather order
        self.bpos = -1                    # position in the backward gather order (trainable ZeRO-3)
        self.members = 1                  # modules sharing the unit (the per-module API's list groups)
        self.members_left = 1             # of them, still to run in this forward before the release
        self.reshard_after_forward = True   # reshard after forward / after backward: ZeRO-3 releases, every
        self.reshard_after_backward = True  # strategy registers its sharded parameters again (per-module API)
        self.forward_prefetch = None      # units to have gathered when this one runs (None: the next one)
        self.backward_prefetch = None


class PassState:
    """Where the current pass stands, one object so that it starts again as one (reset_pass):
    positions in the shared gather orders ([Note: gather order] in _hooks.py: before *_done settled, gathers
    issued up to *_next), the units run in a forward since the last backward, and whether a
    backward is running and syncs."""
    __slots__ = ("fwd_next", "fwd_done", "bwd_next", "bwd_done", "ran", "in_backward", "sync")

    def __init__(self, backward_units: int):
        self.fwd_next = self.fwd_done = 0
        self.bwd_next = self.bwd_done = backward_units
        self.ran = set()  # unit indices run in a forward since the last backward
        self.in_backward = False
        self.sync = False  # this backward syncs (reduces and attaches gradients)
