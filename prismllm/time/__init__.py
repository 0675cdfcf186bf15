"""Slice timing (pipeline stage 2): every rank runs for real in one slice, inside the virtual
world of the others, and its measured graph becomes the timed graph."""

from prismllm.time.slices import TimeOptions, TimeResult, check_time_devices, plan_slices, slice_dir, time_slices

__all__ = ["TimeOptions", "TimeResult", "check_time_devices", "plan_slices", "slice_dir", "time_slices"]
