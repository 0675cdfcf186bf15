"""The environment of a launched process: torchrun's variables, device selection, NCCL's host
identity for processes that share a GPU, and the variables every child gets."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from prismllm.launch.spec import ExtraProcess, LaunchError, LaunchSpec

# Set in every child, after any override: multicast/NVLS must stay off on these machines.
NVLS_OFF_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Set in every child of a single-host run unless the user set them: gloo's pairs and NCCL's
# bootstrap listen on loopback, not on the interface the host name resolves to (on a cluster node,
# its network address): nothing of a run on one host is reachable from another.
LOOPBACK_ENV: dict[str, str] = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}

# Variables the elastic agent of torchrun sets for each worker
# (torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers).
TORCHRUN_ENV_VARS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE",
)


def shares_gpu(devices: str | Sequence[int]) -> bool:
    """Whether a GPU list names a GPU more than once (processes that share it)."""
    return not isinstance(devices, str) and len(set(devices)) != len(devices)


def gpu_ids(gpus: Sequence[int], parent: Mapping[str, str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries of GPU indices (indices into the parent's visible list)."""
    visible = parent.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if max(gpus) >= len(ids):
            raise LaunchError(f"GPU {max(gpus)} is not among CUDA_VISIBLE_DEVICES={visible}")
        return [ids[g] for g in gpus]
    return [str(g) for g in gpus]


def device_env(devices: str | Sequence[int], nproc: int, parent: Mapping[str, str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for the children, or {} to leave the parent's as it is (or, for a
    list that shares a GPU, to set it per child: ``build_env``)."""
    if isinstance(devices, str):
        if devices == "cpu":
            return {"CUDA_VISIBLE_DEVICES": ""}
        raise LaunchError(f"devices must be 'cpu' or a list of GPU indices, not {devices!r}")
    gpus = [int(d) for d in devices]
    if len(gpus) < nproc:
        raise LaunchError(f"{nproc} ranks need {nproc} GPUs; {len(gpus)} given ({gpus})")
    gpus = gpus[:nproc]
    if any(g < 0 for g in gpus):
        raise LaunchError(f"GPU indices must be non-negative: {gpus}")
    if shares_gpu(gpus):
        gpu_ids(gpus, parent)  # validate
        return {}
    if gpus == list(range(nproc)):
        return {}  # as torchrun: CUDA_VISIBLE_DEVICES left alone, LOCAL_RANK selects the GPU
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids(gpus, parent))}


def own_host_env(run_id: str, who: str | int) -> dict[str, str]:
    """What makes a process its own host to NCCL. NCCL refuses two members of a communicator
    on one GPU of one host ("Duplicate GPU detected"); members on different hosts may share a
    GPU, and NCCL then connects them through its network transport (sockets here)."""
    return {"NCCL_HOSTID": f"prism-{run_id}-{who}"}


def torchrun_env(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    agent_store: bool,
) -> dict[str, str]:
    """The variables torchrun's agent sets for one worker of a single-node job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        # True: the launcher hosts the TCPStore and rank 0 connects as a client (torchrun's
        # default); False: rank 0's env:// rendezvous hosts it.
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def build_env(
    spec: LaunchSpec,
    *,
    rank: int,
    local_rank: int,
    master_port: int,
    run_id: str,
    agent_store: bool = False,
    error_file: str | None = None,
    parent: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of one child. Order: the launcher's environment, device
    selection, torchrun's set, spec.env, spec.rank_env[rank], then the NVLS-off variables."""
    base = dict(os.environ if parent is None else parent)
    env = dict(base)
    env.update(device_env(spec.devices, spec.nproc, base))
    own_host = own_hosts(spec)
    if own_host:
        # Each process its own host with its own GPU (shared or not): LOCAL_RANK 0 selects it.
        if spec.devices != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = gpu_ids([int(spec.devices[local_rank])], base)[0]
        env.update(own_host_env(run_id, rank))
    env.update(
        torchrun_env(
            rank=rank,
            local_rank=0 if own_host else local_rank,
            world_size=spec.world_size if spec.world_size is not None else spec.nproc,
            local_world_size=1 if own_host else spec.nproc,
            master_addr=spec.master_addr,
            master_port=master_port,
            run_id=run_id,
            agent_store=agent_store,
        )
    )
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    if "OMP_NUM_THREADS" not in base and spec.nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun, to keep N processes from oversubscribing
    env["PYTHONUNBUFFERED"] = "1"  # output reaches the launcher as it is written
    _on_loopback(spec, env)
    apply_overrides(env, spec.env, spec.rank_env.get(rank, {}))
    env.update(NVLS_OFF_ENV)
    return env


def _on_loopback(spec: LaunchSpec, env: dict[str, str]) -> None:
    """A single-host run's communication listens on loopback (``LOOPBACK_ENV``); a multi-host one
    (a rendezvous token: ``LaunchSpec.rdzv_token``) must reach the other hosts."""
    if spec.rdzv_token is None:
        for k, v in LOOPBACK_ENV.items():
            env.setdefault(k, v)


def own_hosts(spec: LaunchSpec) -> bool:
    """Whether every process of this launch is told it is its own host (``own_host_env``)."""
    return spec.own_hosts or shares_gpu(spec.devices)


def child_command(spec: LaunchSpec) -> list[str]:
    if spec.runner:
        return [spec.python, "-m", spec.runner, spec.script, *spec.args]
    return [spec.python, spec.script, *spec.args]


def build_extra_env(
    spec: LaunchSpec,
    extra: ExtraProcess,
    index: int,
    *,
    master_port: int,
    run_id: str,
    parent: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of a helper process (``LaunchSpec.extra``): the launcher's
    environment (GPUs hidden with devices "cpu"), the run's store, its own host when processes
    share GPUs, ``spec.env`` and ``extra.env``, then the NVLS-off variables."""
    env = dict(os.environ if parent is None else parent)
    if spec.devices == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(
        {
            "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RUN_ID": run_id,
            "PYTHONUNBUFFERED": "1",
        }
    )
    if own_hosts(spec):
        env.update(own_host_env(run_id, f"x{index}"))
    _on_loopback(spec, env)
    apply_overrides(env, spec.env, extra.env)
    env.update(NVLS_OFF_ENV)
    return env


def apply_overrides(env: dict[str, str], *overrides: Mapping[str, str | None]) -> None:
    """Apply each mapping in turn: a value sets its variable, None removes it."""
    for o in overrides:
        for k, v in o.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = str(v)
