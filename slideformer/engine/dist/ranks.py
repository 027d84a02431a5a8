"""One process per GPU, started by the engine itself: ``train.gpus = N`` (or "all").

The training process is rank 0: it owns the run (events, checkpoints, data, control) exactly as
a one-GPU run does. It builds the host state once in shared memory, then starts ranks 1..N-1
(``torch.multiprocessing``, spawn), which map that same state: N ranks, one copy of the weights,
remainders and moments. Each step rank 0 broadcasts the step's micro-batches and AdamW
hyper-parameters; every rank runs the sliding window over its share
(slideformer.engine.dist.group) and updates its slice of every item in place. Checkpoints are
written by rank 0 from the shared state, in the one-GPU format, so a run resumes on any number
of GPUs.

torch.distributed carries the collectives: NCCL between GPUs, gloo on the CPU (the tests).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

import torch

from slideformer.engine.config import RunConfig
from slideformer.engine.dist.group import RankGroup
from slideformer.engine.errors import UserError
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime.shapes import ExecShape

FIELDS = ("w", "rem", "m", "v", "g")
"""The tensors of a host item (None where an item has none)."""
PINNED = ("w", "g")
"""The fields the device copies to and from (page-locked on CUDA)."""
TIMEOUT = timedelta(minutes=30)
"""How long a rank waits for the others in a collective before the run fails."""
WATCH_S = 1.0
"""How often rank 0 checks that the other ranks are alive."""


def gpu_count(cfg: RunConfig) -> int:
    """The number of ranks ``train.gpus`` asks for on this machine ("all": every CUDA GPU)."""
    gpus = cfg.train.gpus
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    have = torch.cuda.device_count() if cuda else None
    if gpus == "all":
        return have or 1
    if have is not None and gpus > have:
        raise UserError("train.gpus", f"is {gpus}, but this machine has {have} CUDA GPU(s)",
                        f"set train.gpus = {have} or \"all\"")
    return gpus


def rank_shape(shape: ExecShape, world: int) -> ExecShape:
    """The executor shape of one rank: its share of the micro-batches, every optimizer update
    on the host (the shared state; device-updated, speculative and regenerated items are
    one-GPU modes)."""
    if world == 1:
        return shape
    return dataclasses.replace(shape, n_micro=shape.n_micro // world, device_update=False,
                               device_layers=0, spec_layers=0, regen_layers=0)


class _Plain:
    """Allocates host buffers in plain memory: they move to shared memory (:func:`share`)
    and are page-locked by each rank after that (:class:`Pins`)."""

    @staticmethod
    def host_alloc(shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)


def host_alloc(backend, world: int):
    """What allocates the host state: the backend (pinned on CUDA) for one GPU; for several,
    plain memory that moves to shared memory when the ranks start."""
    return backend if world == 1 else _Plain()


def share(host: dict) -> None:
    """Move every tensor of the host state to shared memory, in place (views follow)."""
    for item in host.values():
        for name in FIELDS:
            t = getattr(item, name, None)
            if t is not None:
                t.share_memory_()


class Pins:
    """Page-locks the shared buffers the device copies (CUDA), and unlocks them on close."""

    def __init__(self, host: dict, cuda: bool):
        self.done: list[torch.Tensor] = []
        if not cuda:
            return
        for item in host.values():
            for name in PINNED:
                t = getattr(item, name, None)
                if t is not None and t.numel():
                    err = torch.cuda.cudart().cudaHostRegister(
                        t.data_ptr(), t.numel() * t.element_size(), 0)
                    if int(err) != 0:
                        raise RuntimeError(f"cudaHostRegister failed ({err})")
                    self.done.append(t)

    def close(self) -> None:
        for t in self.done:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self.done.clear()


class Solo:
    """A one-process run: nothing to start, tell or stop."""

    group = None

    def start_step(self, micro_batches: list, hyper: AdamHyper) -> None:
        pass

    def close(self) -> None:
        pass


class Ranks:
    """Rank 0's view of the other ranks: starts them, hands them each step, stops them."""

    def __init__(self, cfg: RunConfig, host: dict, shape: ExecShape, dtype: torch.dtype,
                 world: int, cuda: bool, init_rank=None):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        share(host)
        self._tmp = tempfile.TemporaryDirectory(prefix="slideformer-ranks-")
        init = Path(self._tmp.name, "rendezvous").as_uri()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_rank_main, daemon=True, name=f"rank{r}",
                                  args=(r, world, init, cfg, shape, dtype, host, cuda,
                                        init_rank))
                      for r in range(1, world)]
        for p in self.procs:
            p.start()
        self._closing = threading.Event()
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=0,
                                world_size=world, timeout=TIMEOUT)
        self.group = RankGroup(0, world)
        self.pins = Pins(host, cuda)

    def _watch(self) -> None:
        """A rank that dies leaves the others waiting in a collective: end this process too,
        saying which rank ended how (the run resumes from its last checkpoint)."""
        while not self._closing.wait(WATCH_S):
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                print(f"error: {dead[0].name} of the run ended unexpectedly (exit code "
                      f"{dead[0].exitcode}); the run stops here and resumes from its last "
                      "checkpoint (--resume)", file=sys.stderr, flush=True)
                os._exit(3)

    def start_step(self, micro_batches: list, hyper: AdamHyper) -> None:
        """Tell the other ranks to run a step on these micro-batches."""
        import torch.distributed as dist
        dist.broadcast_object_list([("step", micro_batches, hyper)], src=0)

    def close(self) -> None:
        import torch.distributed as dist
        self._closing.set()
        dist.broadcast_object_list([("stop", None, None)], src=0)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        dist.destroy_process_group()
        self.pins.close()
        self._tmp.cleanup()


def start_ranks(cfg: RunConfig, host: dict, shape: ExecShape, dtype: torch.dtype, world: int,
                cuda: bool, init_rank=None):
    """The other ranks of this run (:class:`Solo` for one GPU). ``init_rank``: a module-level
    function each of them calls first with its rank (a benchmark caps each GPU's memory)."""
    return Solo() if world == 1 else Ranks(cfg, host, shape, dtype, world, cuda, init_rank)


def _rank_main(rank: int, world: int, init: str, cfg: RunConfig, shape: ExecShape,
               dtype: torch.dtype, host: dict, cuda: bool, init_rank) -> None:
    """Ranks 1..N-1: run the steps rank 0 hands out, on this rank's GPU, until told to stop."""
    import torch.distributed as dist

    from slideformer.engine.devices import residual_dtype_name, torch_dtype
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.runtime.backend import CpuBackend, CudaBackend
    from slideformer.engine.runtime.executor import SlidingExecutor

    if cuda:
        torch.cuda.set_device(rank)
    if init_rank is not None:
        init_rank(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank,
                            world_size=world, timeout=TIMEOUT)
    backend = CudaBackend(f"cuda:{rank}") if cuda else CpuBackend()
    pins = Pins(host, cuda)
    compute = str(dtype).removeprefix("torch.")
    ex = SlidingExecutor(load_spec(cfg.model.path), backend, host, shape, dtype,
                         seed=cfg.train.seed, group=RankGroup(rank, world),
                         residual_dtype=torch_dtype(residual_dtype_name(cfg.train.precision, compute)),
                         fp8=cfg.train.precision == "fp8")
    clip = cfg.optim.max_grad_norm
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0)
        what, micro_batches, hyper = msg[0]
        if what == "stop":
            break
        ex.train_step(micro_batches, lambda coef, h=hyper: dataclasses.replace(h, grad_scale=coef),
                      clip, timeline=False)
    ex.close()
    pins.close()
    dist.destroy_process_group()
