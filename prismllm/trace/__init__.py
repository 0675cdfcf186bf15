"""PrismTrace: the execution graph (schema, assembly, validation, comparison, exports)."""

from prismllm.trace.assemble import assemble, assemble_spool
from prismllm.trace.compare import CompareResult, compare_traces
from prismllm.trace.graph import PrismTrace, TraceError
from prismllm.trace.validate import validate

__all__ = [
    "PrismTrace",
    "TraceError",
    "assemble",
    "assemble_spool",
    "validate",
    "compare_traces",
    "CompareResult",
]
