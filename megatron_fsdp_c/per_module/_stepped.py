"""How a per-module root learns that an optimizer stepped its parameters.

[Note: stepped parameters]
The user's optimizer steps the DTensor parameters directly, and what the engine keeps from them
(ZeRO-1/2 and no_shard full weights, a group that does not reshard, a cast compute copy) must be
refreshed before the next forward. Two signals, either of which refreshes:
- the parameters' version counters (a load, a single-tensor optimizer, an in-place op);
- torch's global optimizer step post hook, for every torch.optim.Optimizer: a foreach step (the
  default on a GPU) bumps no version counter of a DTensor (nor of its local tensor), so the
  counters alone missed it and the forward ran on stale weights.
Why a global hook and a link on the parameters (each engine DTensor's `_mfsdp_model_ref`, a weak
reference to its owner) rather than a link made with the optimizer: FSDP2 scripts make the
optimizer from the sharded parameters before the first forward, when no engine exists yet, and
the optimizer is any torch class, made by the user; only the parameters lead from it to the model.
Refreshing at every forward after a syncing backward instead would miss a step taken after a
forward that came between backward and step (an evaluation before stepping), silently.
"""
from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["watch_optimizer_steps"]

_HANDLE = None


def _stepped(optimizer, args, kwargs) -> None:
    """After any optimizer's step: tell the roots of its megatron_fsdp_c parameters."""
    told = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = getattr(p, "_mfsdp_model_ref", None)
            owner = ref() if ref is not None else None
            if owner is not None and id(owner) not in told:
                told.add(id(owner))
                note = getattr(owner, "_note_optimizer_step", None)  # per-module roots only
                if note is not None:
                    note()


def watch_optimizer_steps() -> None:
    """Registers the global step post hook once per process."""
    global _HANDLE
    if _HANDLE is None:
        _HANDLE = register_optimizer_step_post_hook(_stepped)
