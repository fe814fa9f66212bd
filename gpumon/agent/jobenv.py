"""A process's place in a job, from the environment its launcher gave it: its rank, local rank
and world size, and the job it belongs to. Standard library only: the agent reads its own
environment with it (its hello), the client reads other processes' (/proc/PID/environ).

Ranks come from the first launcher whose rank variable is set, in this order: torchrun and
its kind (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), Slurm's srun (``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``), Open MPI's mpirun (``OMPI_COMM_WORLD_RANK``,
``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_SIZE``), then MPICH/Hydra and Intel MPI
(``PMI_RANK``, ``MPI_LOCALRANKID``, ``PMI_SIZE``). torchrun under srun gives its ranks both:
torchrun's are the training's ranks, so they win.
"""
from __future__ import annotations

from typing import Mapping

RANK_VARS = (
    ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None and v.strip() != "" else None
    except ValueError:
        return None


def ranks_of(env: Mapping[str, str]) -> tuple[int | None, int | None, int | None]:
    """(rank, local rank, world size) of a process with this environment; None where unknown.
    A torchrun launcher has LOCAL_RANK-less children only: its own ranks are None."""
    for rank_v, local_v, world_v in RANK_VARS:
        rank = _int(env.get(rank_v))
        if rank is not None:
            return rank, _int(env.get(local_v)), _int(env.get(world_v))
    # LOCAL_RANK alone (some launchers set only it): a local rank, no global one
    return None, _int(env.get("LOCAL_RANK")), _int(env.get("WORLD_SIZE"))


def job_of(env: Mapping[str, str]) -> str:
    """The job a process belongs to: Slurm's job id, else the Kubernetes pod (POD_NAME, or
    HOSTNAME inside a pod), else empty."""
    if env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"]
    if env.get("POD_NAME"):
        return env["POD_NAME"]
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("HOSTNAME"):
        return env["HOSTNAME"]
    return ""


def job_names(env: Mapping[str, str]) -> set[str]:
    """Every name a user may give this process's job: its job id (``SLURM_JOB_ID``, or the
    pod), and for an element of a Slurm job array ``ARRAYID_TASKID`` and the array's id."""
    names = {job_of(env)} - {""}
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array:
        names.add(array)
        if task:
            names.add(f"{array}_{task}")
    return names


def in_jobs(env: Mapping[str, str], jobs: set[str] | frozenset[str]) -> bool:
    """Whether a process with this environment belongs to one of jobs (see job_names)."""
    return bool(job_names(env) & set(jobs))
