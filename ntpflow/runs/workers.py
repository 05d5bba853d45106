"""Several workers for one training with the account: ``ntpflow train --workers N`` (which starts them) or
``torchrun --nproc-per-node N -m ntpflow train ...``; ``torch.distributed`` with gloo on a CPU, NCCL on GPUs.

Each worker holds the whole model and takes the same steps on the whole batch; the account's readout set, where its
cost lies (the tangents at every quadrature point), is split between them (``ntpflow.engine.exact.Shard``) and its
accumulators are summed and gathered. Worker 0 writes the run folder; the others compute. The workers' weights are
compared at every checkpoint and at the end (they must be the same bits).
"""

import gc
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


def worker_env() -> tuple[int, int] | None:
    """(rank, number of workers) when this process is one of several workers (the environment torchrun and
    ``--workers`` set: RANK, WORLD_SIZE), else None."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), size) if size > 1 else None


def is_follower() -> bool:
    """Whether this process is a worker beside worker 0 (started as one of several; worker 0 writes and speaks)."""
    env = worker_env()
    return env is not None and env[0] != 0


def join_workers(device: str) -> int:
    """Join the workers' process group (once; gloo on a CPU, NCCL on CUDA, from the environment); returns this
    worker's rank."""
    if not dist.is_initialized():
        cuda = (torch.cuda.is_available() if device == "auto" else torch.device(device).type == "cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank()


def leave_workers() -> None:
    """Leave the workers' process group, once every worker is done (nothing alone). The group's last references (in
    reference cycles) are collected here, while the interpreter is whole: left to its teardown, a gloo worker aborted
    ("terminate called without an active exception") in 2 of 20 exits of a 2-worker training, and in none of 60
    with the collection."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def is_lead() -> bool:
    """Whether this process writes: worker 0, or a process alone."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every worker (nothing alone)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def same_threads() -> None:
    """Every worker on worker 0's torch thread count (the same count, the same bits)."""
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([torch.get_num_threads()])
        dist.broadcast(t, 0)
        torch.set_num_threads(int(t))


def check_same_weights(models: Sequence[torch.nn.Module], step: int) -> None:
    """RuntimeError (one line) unless every worker holds the same weights (a float64 checksum per worker)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    total = torch.stack([torch.stack([p.detach().double().sum() for p in m.parameters()]).sum() for m in models])
    low, high = total.clone(), total.clone()
    dist.all_reduce(low, dist.ReduceOp.MIN)
    dist.all_reduce(high, dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise RuntimeError(f"the workers' weights differ at step {step}: their steps were not the same bits")


def launch(n: int, argv: Sequence[str]) -> int:
    """Run ``python -m ntpflow ARGV`` as ``n`` workers on this machine (each on cores // n torch threads on a CPU,
    unless OMP_NUM_THREADS says otherwise); returns 0, or the first failing worker's exit status (the others are
    stopped)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // n))
    env = {**os.environ, "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": threads}
    procs = [subprocess.Popen([sys.executable, "-m", "ntpflow", *argv],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                return failed[0] if failed else 0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
