"""How the per-module API's root state ends a step outside a backward: the reduction of gradients
the backwards held back (torch.distributed.pipelining, torch 2.15's finalize_backward) and the
reset after a pass that raised (reset_iter_state). A base class of RootState (_root.py), which
owns the engine, the groups and the hooks these use.
"""
from __future__ import annotations

from .._common import in_backward

__all__ = ["StepEnd"]


class StepEnd:
    """RootState's step ends outside a backward (see the module docstring)."""

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
        release = [b for u in self.hooks.unit_states if u.reshard_after_backward for b in u.releasable]
        if release:
            self.param_buffer.engine.reshard(release)
        for u in self.hooks.unit_states:
            if u.reshard_after_backward:
                self.register(u.index, False)

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
        for u in range(len(self.groups)):
            self.register(u, False)
