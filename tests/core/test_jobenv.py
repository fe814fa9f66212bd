"""A process's rank and job from its launcher's variables (gpumon/agent/jobenv.py)."""
import pytest

from gpumon.agent.jobenv import in_jobs, job_names, ranks_of


@pytest.mark.parametrize("env, want", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (3, 1, 8)),
    # torchrun under srun: torchrun's ranks are the training's
    ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}, (5, 1, 8)),
    ({"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}, (2, 0, 4)),
    ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_SIZE": "16"}, (6, 2, 16)),
    ({"PMI_RANK": "1", "MPI_LOCALRANKID": "1", "PMI_SIZE": "2"}, (1, 1, 2)),
    ({"LOCAL_RANK": "0"}, (None, 0, None)),
    ({"RANK": "x", "SLURM_PROCID": "4", "SLURM_NTASKS": "8"}, (4, None, 8)),
    ({}, (None, None, None)),
])
def test_ranks_from_the_first_launcher_whose_rank_is_set(env, want):
    assert ranks_of(env) == want


def test_a_job_by_its_id_an_array_element_or_the_array():
    env = {"SLURM_JOB_ID": "1207", "SLURM_ARRAY_JOB_ID": "1200", "SLURM_ARRAY_TASK_ID": "7"}
    assert job_names(env) == {"1207", "1200", "1200_7"}
    assert in_jobs(env, {"1200_7"}) and in_jobs(env, {"1207"}) and not in_jobs(env, {"1201"})
    assert not in_jobs({}, {"1207"})
    assert job_names({"POD_NAME": "trainer-0"}) == {"trainer-0"}
