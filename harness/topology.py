"""TP x DP layouts and real multi-process worlds to run them in.

A world of `W` ranks starts once (spawned processes, or `torchrun`) and runs every layout of up to `W` ranks
inside it: each layout uses the first `tp * dp` ranks, TP innermost (`rank = dp_index * tp + tp_index`), with
its own subgroups. gloo on the CPU; NCCL with one GPU per rank; gloo with CUDA tensors when ranks share a GPU.
A rank that raises fails the whole run with its traceback; a rank that hangs hits the collective timeout, and
the parent kills the world when its own deadline passes: never a silent hang.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def name(self) -> str:
        return f"tp{self.tp}xdp{self.dp}"

    @classmethod
    def parse(cls, name: str) -> Layout:
        tp, dp = name.removeprefix("tp").split("xdp")
        return cls(int(tp), int(dp))


def layouts(max_world: int, max_tp: int | None = None, max_dp: int | None = None) -> list[Layout]:
    """Every TP x DP factorization of every world size from 1 to `max_world`; TP at most `max_tp` and DP at most
    `max_dp` where given (what a scenario can be sharded on: whole vocab tiles per TP rank, whole sequences per DP
    rank)."""
    return sorted((Layout(tp, w // tp) for w in range(1, max_world + 1) for tp in range(1, w + 1)
                   if w % tp == 0 and tp <= (max_tp or w) and w // tp <= (max_dp or w)),
                  key=lambda l: (l.world, -l.tp))


@dataclass
class Placement:
    """Where this process sits in one layout (or `None` from `RankContext.place` when it sits out)."""

    layout: Layout
    tp_rank: int
    dp_rank: int
    tp_group: Any
    dp_group: Any


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    backend: str
    _groups: dict

    def place(self, layout: Layout) -> Placement | None:
        if self.rank >= layout.world:
            return None
        dp_rank, tp_rank = divmod(self.rank, layout.tp)
        tp_group, dp_group = self._groups[layout]
        return Placement(layout, tp_rank, dp_rank, tp_group, dp_group)


def pin_numerics(threads: int = 1) -> dict[str, Any]:
    """Pins what can change bits inside one process and returns it for the record."""
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    return {"threads_per_rank": threads, "tf32": False, "deterministic_algorithms": True}


def _build_groups(world_size: int, layout_list: list[Layout], timeout: datetime.timedelta) -> dict:
    """Creates every subgroup of every layout, in the same order on every rank (a `new_group` requirement)."""
    rank = dist.get_rank()
    groups = {}
    for lay in layout_list:
        if lay.world > world_size:
            continue
        mine_tp = mine_dp = None
        for d in range(lay.dp):
            ranks = [d * lay.tp + t for t in range(lay.tp)]
            g = dist.new_group(ranks, timeout=timeout) if lay.tp > 1 else None
            if rank in ranks:
                mine_tp = g
        for t in range(lay.tp):
            ranks = [d * lay.tp + t for d in range(lay.dp)]
            g = dist.new_group(ranks, timeout=timeout) if lay.dp > 1 else None
            if rank in ranks:
                mine_dp = g
        groups[lay] = (mine_tp, mine_dp)
    return groups


def pick_backend(device: str, world_size: int) -> str:
    """gloo on the CPU; NCCL when every rank gets its own GPU; gloo with CUDA tensors when ranks share one."""
    if device == "cpu":
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


def _cuda_device(index: int, memory_fraction: float | None) -> torch.device:
    """Binds this process to GPU `index`, capped at `memory_fraction` of its memory (so that a run can share
    a node with a training job)."""
    dev = torch.device("cuda", index % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(memory_fraction, dev)
    return dev


def _worker(rank: int, world_size: int, fn: Callable, args: tuple, init_file: str, out_dir: str, device: str,
            backend: str, timeout_s: float, memory_fraction: float | None) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    pin_numerics()
    dev = _cuda_device(rank, memory_fraction) if device == "cuda" else torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
    try:
        ctx = RankContext(rank, world_size, dev, backend, _build_groups(world_size, layouts(world_size), timeout))
        result = fn(ctx, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def in_turn(ctx: RankContext, fn: Callable, calls: list[tuple]) -> list[Any]:
    """`fn(ctx, *args)` for each `args` of `calls`, one after the other in one world (each call its own layouts,
    say); every result, in order."""
    return [fn(ctx, *args) for args in calls]


def run_world(fn: Callable, world_size: int, *args: Any, device: str = "cpu", backend: str | None = None,
              timeout_s: float = 300.0, memory_fraction: float | None = None) -> list[Any]:
    """Runs `fn(ctx, *args)` on `world_size` spawned ranks and returns each rank's (picklable) result.

    `fn` must be importable by name (module level). Raises `RuntimeError` with the failing rank's traceback, or
    `TimeoutError` after `timeout_s` seconds (the whole world is then killed). On CUDA, `memory_fraction` caps
    each rank's allocations (`torch.cuda.set_per_process_memory_fraction`).
    """
    backend = backend or pick_backend(device, world_size)
    with tempfile.TemporaryDirectory(prefix="grpo-world-") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(_worker, args=(world_size, fn, args, init_file, tmp, device, backend,
                                                min(timeout_s, 120.0), memory_fraction),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world of {world_size} ranks ({backend}, {device}) did not finish within "
                                       f"{timeout_s:.0f} s")
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a rank failed in a world of {world_size} ({backend}, {device}):\n{exc}") from None
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"a rank died in a world of {world_size} ({backend}, {device}): {exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def run_torchrun(fn: Callable, *args: Any, device: str = "cpu", timeout_s: float = 300.0,
                 memory_fraction: float | None = None) -> Any:
    """Runs `fn(ctx, *args)` in a process started by `torchrun` (env:// rendezvous); returns this rank's result."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pin_numerics()
    dev = torch.device(device)
    if device == "cuda":
        dev = _cuda_device(int(os.environ.get("LOCAL_RANK", rank)), memory_fraction)
    backend = pick_backend(device, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout)
    try:
        ctx = RankContext(rank, world_size, dev, backend, _build_groups(world_size, layouts(world_size), timeout))
        return fn(ctx, *args)
    finally:
        dist.destroy_process_group()
