"""Process launching and supervision, shared by every stage that runs rank processes.

``launch(LaunchSpec(...))`` starts and supervises a torchrun-shaped job (``launcher.py``);
``sandbox.launch_sandbox`` runs sandbox ranks and assistants against a graph; ``status.py``
is how a stuck run says where each process stands; ``program.py`` checks that a launch runs
the program a graph was made from.
"""

from prismllm.launch.environment import (
    NVLS_OFF_ENV,
    TORCHRUN_ENV_VARS,
    build_env,
    device_env,
    gpu_ids,
)
from prismllm.launch.launcher import launch
from prismllm.launch.messages import describe_returncode, error_line, says_out_of_memory
from prismllm.launch.spec import (
    DEFAULT_RUNNER,
    LAUNCHER_ID,
    STATUS_PREFIX,
    ExtraProcess,
    LaunchError,
    LaunchInterrupted,
    LaunchResult,
    LaunchSpec,
    LineSink,
    RankFailure,
    RankOutOfMemory,
    status_after_default,
)

__all__ = [
    "DEFAULT_RUNNER",
    "ExtraProcess",
    "LAUNCHER_ID",
    "LaunchError",
    "LaunchInterrupted",
    "LaunchResult",
    "LaunchSpec",
    "LineSink",
    "NVLS_OFF_ENV",
    "RankFailure",
    "RankOutOfMemory",
    "STATUS_PREFIX",
    "TORCHRUN_ENV_VARS",
    "build_env",
    "describe_returncode",
    "device_env",
    "error_line",
    "says_out_of_memory",
    "gpu_ids",
    "launch",
    "status_after_default",
]
