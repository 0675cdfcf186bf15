"""Two API differences between torchtitan 0.3.0 and torch 2.13.0, bridged without touching
either (nothing here is about prism or CPUs: torchtitan 0.3.0 targets a newer torch):

* ``torch.distributed.set_timeout`` (called by ``set_pg_timeouts`` after the first step) is
  ``distributed_c10d._set_pg_timeout`` in torch 2.13.0;
* pipeline schedules' ``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`` (inputs already split
  into microbatches, as torchtitan's ``pp_forward_backward_step`` passes them): torch 2.13.0's
  ``step`` takes a whole batch and splits it, and would take these names for model kwargs
  ("Expecting 2 arg_mbs but got 1"); here they go to ``_step_microbatches``, after the same
  per-step set-up as ``step``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def install() -> None:
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    from torch.distributed.pipelining import schedules as S

    for cls in (S.PipelineScheduleSingle, S.PipelineScheduleMulti):
        if getattr(cls.step, "_premade_microbatches", False):
            continue
        cls.step = _step_with_microbatches(cls.step)


def _step_with_microbatches(orig):
    @functools.wraps(orig)
    def step(
        self,
        *args,
        target=None,
        losses=None,
        return_outputs=True,
        loss_kwargs=None,
        arg_mbs=None,
        kwarg_mbs=None,
        target_mbs=None,
        **kwargs,
    ):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return orig(
                self,
                *args,
                target=target,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                **kwargs,
            )
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled for backward computation")
        stages = list(getattr(self, "_stages", None) or [self._stage])
        for st in stages:
            st.has_backward = self._has_backward
            st.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        for st in stages:
            if st.is_last and return_outputs:
                return self._merge_outputs(st.output_chunks)
        return None

    step._premade_microbatches = True
    return step
