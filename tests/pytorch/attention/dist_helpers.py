"""Run a test body on N CPU processes joined by a gloo process group (torch.multiprocessing;
forked where possible, see :func:`start_method`).

The body is a module-level function ``body(rank, world_size, *args)``; an exception in any rank
fails the test with that rank's traceback. :func:`run_bodies` runs several bodies in one spawn
(a spawned process re-imports the test module: seconds each with megatron-core) and
reports each body's result, so one test per body still says which failed.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def start_method() -> str:
    """"fork" while this process has not touched CUDA: a forked rank starts with the modules
    already imported (a spawned one imports torch, the package and the test module again, seconds
    of CPU per rank); "spawn" once it has (a forked child cannot use CUDA after its parent did)."""
    return "spawn" if torch.cuda.is_initialized() else "fork"


def free_port() -> int:
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
    mp.start_processes(_entry, args=(world_size, free_port(), body, args), nprocs=world_size, join=True,
                       start_method=start_method())


def _bodies_entry(rank: int, world_size: int, port: int, bodies, outdir: str) -> None:
    results = {}

    def run_all(rank_, world_):
        for name, body in bodies.items():
            try:
                body(rank_, world_)
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - reported to the test by body name
                results[name] = traceback.format_exc()

    try:
        _entry(rank, world_size, port, run_all, ())
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)


def run_bodies(bodies, world_size: int):
    """Every body of ``bodies`` ({name: module-level function}) in order, in one spawn of
    ``world_size`` ranks; returns {name: [each rank's "ok" or traceback]}."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_bodies_entry, args=(world_size, free_port(), bodies, outdir), nprocs=world_size, join=True,
                           start_method=start_method())
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(outdir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    return {name: [r.get(name, "not run") for r in per_rank] for name in bodies}


def check_body(results, name: str) -> None:
    failures = [s for s in results[name] if s != "ok"]
    assert not failures, failures[0]
