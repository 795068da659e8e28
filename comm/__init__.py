"""npmegatron.comm: the communication layer (MPI through mpi4py, NCCL through CuPy).

Its collectives, process grid and accounting arrive with the comm issue; nothing here yet.
"""
