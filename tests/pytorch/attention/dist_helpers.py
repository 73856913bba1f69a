"""Run a test body on N CPU processes joined by a gloo process group (torch.multiprocessing spawn).

The body is a module-level function ``body(rank, world_size, *args)``; an exception in any rank
fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, body, args) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two ranks on a 2-core CI machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(body, world_size: int = 2, *args) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    mp.spawn(_entry, args=(world_size, _free_port(), body, args), nprocs=world_size, join=True)
