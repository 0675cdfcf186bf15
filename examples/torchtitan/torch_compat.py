"""API differences between torchtitan 0.3.0 and torch 2.11.0 / 2.13.0, bridged without touching
either (nothing here is about prism or CPUs: torchtitan 0.3.0 targets a torch newer than 2.13.0).
Each bridge is applied only where the running torch lacks the API (checked on the API itself,
not on a version number), so with a torch that has them all this does nothing.

Both 2.11.0 and 2.13.0:

* ``torch.distributed.set_timeout`` (called by ``set_pg_timeouts`` after the first step) is
  ``distributed_c10d._set_pg_timeout``;
* pipeline schedules' ``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`` (inputs already split
  into microbatches, as torchtitan's ``pp_forward_backward_step`` passes them): torch's ``step``
  takes a whole batch and splits it, and would take these names for model kwargs ("Expecting 2
  arg_mbs but got 1"); here they go to ``_step_microbatches``, after the same per-step set-up
  as ``step``.

2.11.0 only:

* ``step(..., loss_kwargs=...)`` (``{"global_valid_tokens": ...}``, the loss's divisor): 2.13.0
  forwards it to the loss function; 2.11.0's schedules have no ``loss_kwargs`` (``step`` would
  hand it to the model), so for the step the schedule's loss function is
  ``functools.partial(loss_fn, **loss_kwargs)``: the call 2.13.0 makes;
* ``PipelineStage(..., get_mesh=...)`` (2.13.0: the callback that finds the mesh of a DTensor a
  stage receives): 2.11.0's ``PipelineStage`` has no such argument and exchanges plain tensors,
  which is what stages exchange under ``spmd_backend="partial_dtensor"``; the argument is
  dropped;
* ``torch.distributed.fsdp.DataParallelMeshDims``: torchtitan imports it at module load
  (``distributed/fsdp.py``, ``distributed/full_dtensor.py``) and builds one only under
  ``spmd_backend`` ``full_dtensor`` or ``spmd_types``, for ``fully_shard(dp_mesh_dims=...)``,
  which 2.11.0's ``fully_shard`` does not take. Here it is a placeholder that lets the import
  pass and whose construction says so; ``partial_dtensor`` (``prism_configs.py``) never builds
  one;
* ``fully_shard([norm, lm_head])`` run one module at a time: torchtitan's default loss,
  ``ChunkedLossWrapper``, runs the root norm in the model's forward and ``lm_head`` per chunk in
  the loss, then ``lm_head.reshard()`` frees the group's unsharded weights, the norm's too.
  2.13.0 completes a group whose modules did not all run
  (``FSDPState._force_complete_incomplete_states``: the model's output gets the group's
  pre-backward hook, which all-gathers again); 2.11.0 runs a group's post-forward only once
  every module of it ran, so the norm's backward reads a freed weight ("The tensor has a non-zero
  number of elements, but its data is not allocated yet", RMSNorm's MulBackward0). There,
  ``ChunkedLossWrapper.Config.build`` builds the loss it wraps (``CrossEntropyLoss``, as
  torchtitan's own ``llama3_debugmodel_ce_loss``): the same loss, computed on the whole
  sequence's logits at once, with ``lm_head`` applied in the model's forward.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist


def install() -> None:
    """Apply the bridges the running torch needs (once; before torchtitan is imported)."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = DataParallelMeshDims
    from torch.distributed.pipelining import schedules as S, stage

    for cls in (S.PipelineScheduleSingle, S.PipelineScheduleMulti):
        params = inspect.signature(cls.step).parameters
        if "arg_mbs" not in params and not getattr(cls.step, "_premade_microbatches", False):
            cls.step = _step_with_microbatches(cls.step)  # loss_kwargs too, where torch lacks it
    init = stage.PipelineStage.__init__
    if "get_mesh" not in inspect.signature(init).parameters and not getattr(init, "_drops_get_mesh", False):
        stage.PipelineStage.__init__ = _without_get_mesh(init)
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    if not hasattr(FSDPState, "_force_complete_incomplete_states"):
        from torchtitan.components.loss import ChunkedLossWrapper

        ChunkedLossWrapper.Config.build = _build_wrapped_loss


def _build_wrapped_loss(self, **kwargs):
    """``ChunkedLossWrapper.Config.build`` on a torch whose FSDP2 cannot complete a partly run
    module group (2.11.0): the wrapped loss itself."""
    return self.loss_fn.build(**kwargs)


def _without_get_mesh(init):
    @functools.wraps(init)
    def __init__(self, *args, get_mesh=None, **kwargs):
        init(self, *args, **kwargs)

    __init__._drops_get_mesh = True
    return __init__


class DataParallelMeshDims:
    """Stands in for torch >= 2.13's ``torch.distributed.fsdp.DataParallelMeshDims`` on a torch
    without it (2.11.0), for torchtitan's imports only."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims and its "
            "fully_shard takes no dp_mesh_dims: use --parallelism.spmd-backend partial_dtensor"
        )


def _takes_loss_kwargs(fn) -> bool:
    return "loss_kwargs" in inspect.signature(fn).parameters


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
        extra = {}
        loss_fn = self._loss_fn
        if _takes_loss_kwargs(type(self)._step_microbatches):
            extra["loss_kwargs"] = loss_kwargs
        elif loss_kwargs and loss_fn is not None:
            self._loss_fn = functools.partial(loss_fn, **loss_kwargs)  # torch 2.11.0
        try:
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return orig(self, *args, target=target, losses=losses, return_outputs=return_outputs, **extra, **kwargs)
            if self._has_backward and not torch.is_grad_enabled():
                raise RuntimeError("step() requires gradients to be enabled for backward computation")
            stages = list(getattr(self, "_stages", None) or [self._stage])
            for st in stages:
                st.has_backward = self._has_backward
                st.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, **extra)
            for st in stages:
                if st.is_last and return_outputs:
                    return self._merge_outputs(st.output_chunks)
            return None
        finally:
            self._loss_fn = loss_fn

    step._premade_microbatches = True
    return step
