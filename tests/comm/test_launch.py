"""The launcher's environment, read without MPI: mpiexec's (MPICH's PMI, Open MPI, PMIx) and a
Slurm job step's (srun), but not the batch script's own environment, which starts no ranks."""
import pytest

from npmegatron import comm

LAUNCH_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                    "PMIX_SIZE", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_outside_any_launcher(env):
    assert not comm.launched_by_mpi() and comm.launch_rank() == 0 and comm.launch_size() == 1


def test_mpiexec(env):
    env.setenv("PMI_RANK", "2")
    env.setenv("PMI_SIZE", "4")
    assert comm.launched_by_mpi() and comm.launch_rank() == 2 and comm.launch_size() == 4


def test_an_srun_task_is_a_launched_rank(env):
    for name, value in (("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "5"), ("SLURM_STEP_NUM_TASKS", "8"),
                        ("SLURM_NTASKS", "16")):
        env.setenv(name, value)
    assert comm.launched_by_mpi() and comm.launch_rank() == 5 and comm.launch_size() == 8


def test_a_batch_script_is_not_a_launch(env):
    """sbatch's script sees its allocation (SLURM_NTASKS, SLURM_PROCID 0) but no srun step: a
    command there relaunches itself under mpiexec as on a workstation."""
    env.setenv("SLURM_PROCID", "0")
    env.setenv("SLURM_NTASKS", "16")
    assert not comm.launched_by_mpi() and comm.launch_size() == 1


def test_mpis_own_variables_win_inside_a_step(env):
    """mpiexec run inside an srun step: its ranks read PMI's variables, not the step's."""
    for name, value in (("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "0"), ("SLURM_STEP_NUM_TASKS", "1"),
                        ("PMI_RANK", "3"), ("PMI_SIZE", "4")):
        env.setenv(name, value)
    assert comm.launch_rank() == 3 and comm.launch_size() == 4
