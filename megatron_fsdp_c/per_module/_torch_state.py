"""The state torch's own code finds on our sharded modules, and register_fsdp_forward_method.

[Note: torch's state key]
torch's fully_shard is a composable API (torch.distributed._composable.contract): its state
lives in module.__dict__[STATE_KEY][f], f the undecorated fully_shard, and `fully_shard.state(m)`
looks it up there. Code in torch that sees an FSDPModule reaches into that state:
- register_fsdp_forward_method: m._get_fsdp_state()._pre_forward(m, args, kwargs) before the
  method and ._post_forward(m, args, out) after it;
- torch.distributed.pipelining (stage.perform_reduce_grad, after the microbatches' backwards ran
  with set_requires_gradient_sync(False)), torch 2.11 to 2.14: fully_shard.state(m)._state_ctx
  .all_states[*]._fsdp_param_groups[*].post_backward() (2.11: ._fsdp_param_group.post_backward()),
  then ._root_post_backward_final_callback(); torch 2.15 calls FSDPModule.finalize_backward.
fully_shard (_fully_shard.py) registers one TorchState per group under that key on each of the
group's modules, and "fully_shard" in the composable registry, so torch's own fully_shard and
replicate refuse such a module as already sharded. TorchState offers exactly those names, each
calling ours: the forward hooks of _root.py, and RootState.reduce_held ([Note: reductions outside
a backward] in _root.py) for the post-backward pair (torch 2.15's pipelining calls
FSDPModule.finalize_backward instead, ours too). Anything else torch's FSDPState has is
absent, so a new use in torch fails with an AttributeError naming it instead of misbehaving.
tests/test_per_module_dropin.py fails if torch's lookup stops finding it.
"""
from __future__ import annotations

import functools
from typing import List

import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed._composable_state import _State
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from ._group import ShardGroup, group_of
from ._module import FSDPModule
from ._root import post_forward, pre_forward

__all__ = ["TorchState", "register_fsdp_forward_method", "register_torch_state"]

# The key torch's fully_shard.state(module) reads under module.__dict__[STATE_KEY]: the function
# contract() decorated (functools.wraps keeps it as __wrapped__).
_TORCH_FUNC = torch_fully_shard.__wrapped__


def register_torch_state(group: ShardGroup) -> None:
    """Registers the group's TorchState where torch's fully_shard.state() finds it (see [Note:
    torch's state key])."""
    group.torch_state = TorchState(group)
    for m in group.modules:
        m.__dict__.setdefault(STATE_KEY, {})[_TORCH_FUNC] = group.torch_state
        m.__dict__.setdefault(REGISTRY_KEY, {}).setdefault(_TORCH_FUNC.__name__, RegistryItem())


class _ParamGroup:
    """What pipelining calls on torch's FSDPParamGroup: post_backward()."""

    def __init__(self, group: ShardGroup):
        self._group = group

    def post_backward(self) -> None:
        """The group's gradients held over the microbatches are reduced by the
        _root_post_backward_final_callback() torch's callers make next (one reduction for all
        groups, in the engine's shared order)."""
        if self._group.owner is not None:
            self._group.owner.reduce_requested = True


class _StateContext:
    """What pipelining reads of torch's FSDPStateContext: the states of every group under the root."""

    def __init__(self, group: ShardGroup):
        self._group = group

    @property
    def all_states(self) -> List["TorchState"]:
        state = self._group.owner
        return [g.torch_state for s in state.owners() for g in s.groups] if state is not None \
            else [self._group.torch_state]

    @property
    def is_last_backward(self) -> bool:
        return self._group.is_last_backward

    @is_last_backward.setter
    def is_last_backward(self, value: bool) -> None:
        self._group.is_last_backward = bool(value)


class TorchState(_State):
    """Our group as torch's FSDPState is reached for (see [Note: torch's state key])."""

    def __init__(self, group: ShardGroup):
        super().__init__()
        self._group = group

    @property
    def _state_ctx(self) -> _StateContext:
        return _StateContext(self._group)

    @property
    def _fsdp_param_groups(self) -> List[_ParamGroup]:
        return [_ParamGroup(self._group)]

    @property
    def _fsdp_param_group(self) -> _ParamGroup:
        """torch 2.11's name (one param group per state; pipelining reads it)."""
        return _ParamGroup(self._group)

    def _pre_forward(self, module: nn.Module, args, kwargs):
        """A registered forward method starts: as a forward pre-hook, and the module's own
        forwards inside the method do not end the pass (the method's end does)."""
        args, kwargs = pre_forward(module, args, kwargs)
        self._group.owner.methods_running += 1
        return args, kwargs

    def _post_forward(self, module: nn.Module, args, output):
        state = self._group.owner
        state.methods_running -= 1
        output = post_forward(module, args, output)
        if not state.methods_running and not state.hooks.pass_state.in_backward:
            # FSDP2's wrapper runs the group's post-forward once more at the method's end, after
            # the inner forwards left the FORWARD state, so the group reshards there whatever its
            # reshard_after_forward: its sharded parameters are registered ([Note: per-group
            # registration] in _registration.py; the engine keeps the gathered weights for a backward).
            state.registration.register(self._group.unit_state.index, False)
        return output

    def _root_post_backward_final_callback(self) -> None:
        """Reduces what the backwards held back, if a post_backward() asked (pipelining's
        perform_reduce_grad), or any held gradients of groups whose sync is on again."""
        state = self._group.owner
        if state is not None:
            for s in state.owners():  # every engine of the model, in one order on every rank
                s.reduce_held()


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """torch's register_fsdp_forward_method for our modules (torch's own also works on them,
    through TorchState): `module.<method_name>` runs between the forward hooks, as forward does,
    e.g. a `generate` that runs the module several times, or an encoder's `encode`. A module that
    is not sharded is left as it is (as torch's does)."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig = getattr(module, method_name)
    state = group_of(module).torch_state

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, orig(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))
