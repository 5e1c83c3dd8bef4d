"""Tensor parallelism over torch.distributed: one model split across processes.

parallel.py says which part of each weight a rank holds and gives the two collectives
the model needs; launch.py starts or joins the process group; driver.py and worker.py
are the two ends of one step (rank 0 schedules and samples, every rank runs the model).
"""
