"""``FSDPMemTracker`` that keeps FSDP2's hooks of grouped units (``fully_shard([a, b])``) intact.

[Note: FSDPMemTracker and grouped units] (read in torch 2.13)
``fully_shard`` on a list of modules registers *group* forward hooks
(``_register_group_forward_hooks``): every module's pre-forward runs the state's pre-forward
(the first one unshards, the rest find the group unsharded), and only the post-forward of the
module that completes the group runs the state's post-forward (reshard, pre-backward hook).
``FSDPMemTracker._instrument_fsdp_module`` replaces those hooks with one plain pre/post pair per
module, so under the tracker a group reshards after each of its modules and all-gathers again
before the next: it measures a different program from the one that trains (lower than the real
peak). Its exit then re-registers plain per-module hooks and restores the parameter group's
``pre_backward``/``post_backward`` once per module, which leaves the first module's wrapper
installed; the next tracker (the steady step, [Note: the steady step]) then fails with
"does not support memory tracking for multiple iterative calls".

This subclass instruments a grouped state once: its parameter group through its first module,
and its forward hooks re-registered as group hooks around the tracker's wrappers, then
restored as group hooks on exit. Single-module states are left to the base class.
"""

from __future__ import annotations

from typing import Any

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _SavedFSDPMethods
from torch.distributed.fsdp import FSDPModule

try:  # private in torch; without it grouped units keep their own (untracked) forward hooks
    from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks
except ImportError:  # pragma: no cover - other torch versions
    _register_group_forward_hooks = None


def _grouped_states(root: Any) -> list[tuple[FSDPModule, Any]]:
    """(first module, state) of every FSDP state that manages several modules."""
    seen: set[int] = set()
    out = []
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if len(getattr(state, "_modules", ())) > 1 and id(state) not in seen:
            seen.add(id(state))
            out.append((state._modules[0], state))
    return out


class GroupAwareMemTracker(FSDPMemTracker):
    """``FSDPMemTracker`` that measures grouped units as FSDP2 runs them (see the Note)."""

    def __init__(self, mod: Any, optm: Any = None) -> None:
        super().__init__(mod, optm)
        self._grouped: list[tuple[FSDPModule, Any, Any, Any]] = []

    def _instrument_fsdp_module(self) -> None:
        grouped = _grouped_states(self._root_mod)
        # Hide the grouped states' modules from the base class while it instruments the rest.
        hidden = {id(m) for _, state in grouped for m in state._modules}
        real_modules = self._root_mod.modules

        def visible_modules():
            return (m for m in real_modules() if id(m) not in hidden)

        self._root_mod.modules = visible_modules  # type: ignore[method-assign]
        try:
            super()._instrument_fsdp_module()
        finally:
            del self._root_mod.modules
        for first, state in grouped:
            group = state._fsdp_param_group
            if group is None:
                continue
            self._instrument_fsdp_sharded_params_grads(group)
            saved = _SavedFSDPMethods(group.pre_backward, group.post_backward)
            group.pre_backward = self._fsdp_param_group_pre_backward(first, group.pre_backward)
            group.post_backward = self._fsdp_param_group_post_backward(first, group.post_backward)
            if _register_group_forward_hooks is not None:
                state._pre_forward_hook_handle.remove()
                handle = _register_group_forward_hooks(
                    state._modules, self._fsdp_state_pre_forward(first, state._pre_forward),
                    self._fsdp_state_post_forward(first, state._post_forward),
                    state._modules_to_run_forward, state._cast_output_dtype)
                state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
            self._grouped.append((first, state, group, saved))

    def _deregister_module_and_optimizer_hooks(self) -> None:
        super()._deregister_module_and_optimizer_hooks()
        for _first, state, group, saved in self._grouped:
            group.pre_backward = saved.pre_backward
            group.post_backward = saved.post_backward
            if _register_group_forward_hooks is not None:
                state._pre_forward_hook_handle.remove()
                handle = _register_group_forward_hooks(
                    state._modules, state._pre_forward, state._post_forward,
                    state._modules_to_run_forward, state._cast_output_dtype)
                state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
        self._grouped.clear()


class CompiledStepMemTracker(GroupAwareMemTracker):
    """``GroupAwareMemTracker`` for plans with compiled blocks: it tells Dynamo to ignore it
    while compiling (``ignore_compile_internals``), so the blocks' compiled graphs run under
    it instead of Dynamo skipping or recompiling the frames under a dispatch mode (issue 22).

    It also takes higher-order operators (``supports_higher_order_operators``): a checkpointed
    block's partitioned graphs call ``run_and_save_rng_state`` / ``run_with_rng_state``, which
    a mode without that flag refuses; the base ``__torch_dispatch__`` runs them below the
    tracker and tracks what they return, as it does for any op."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True
