"""capture: run a training program's ranks and record what they execute.

``record.py`` is ``prism record`` (every rank real, the recording backend); ``solo.py`` is
``prism capture`` (the bare graph of N ranks from a few run alone); ``common.py`` what both share
(spool, output directory, devices, manifest).
"""

from prismllm.capture.record import RecordOptions, RecordResult, record
from prismllm.capture.solo import CaptureOptions, CapturePlan, CaptureResult, capture

__all__ = ["CaptureOptions", "CapturePlan", "CaptureResult", "RecordOptions", "RecordResult", "capture", "record"]
