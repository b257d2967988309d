"""Executors: how the worker ranks come to exist. mp starts processes here, ray places actors in a placement
group, torchrun has already started every rank (this process is one of them).

Each executor starts ranks 1..N-1 running `worker_main`, says how to describe a failed worker, and stops them.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.multiprocessing as mp

from paged_backend.config import EngineConfig
from paged_backend.distributed.state import Topology
from paged_backend.distributed.worker import worker_main
from paged_backend.errors import InvalidRequest

logger = logging.getLogger(__name__)
STOP_TIMEOUT = 10.0  # seconds workers get to leave after the stop message before they are killed


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class MultiprocExecutor:
    """Worker processes on this machine (torch.multiprocessing), never forked from the driver itself: a fork of a
    driver whose OpenMP pool, gRPC or server threads already ran can deadlock in the child (GNU OpenMP hangs at the
    child's first parallel region), which is what any process that generated before building a parallel engine
    is. On CPU they fork from multiprocessing's fork server, a clean process that imported the worker once, so
    starts stay cheap; once CUDA is initialised they are spawned."""

    name = "mp"

    def start(self, config: EngineConfig, model, topology: Topology, device: torch.device) -> str:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = mp.get_context("spawn" if torch.cuda.is_initialized() else "forkserver")
        if context.get_start_method() == "forkserver":
            context.set_forkserver_preload(["paged_backend.distributed.worker"])
        shared = model if config.model is None else None  # a model with a checkpoint is loaded by each rank
        self.processes = [
            context.Process(
                target=worker_main,
                args=(rank, topology, init_method, config, shared, rank, torch.get_num_threads()),
                name=f"paged-backend-rank{rank}",
                daemon=True,  # never outlives the driver's interpreter
            )
            for rank in range(1, topology.world_size)
        ]
        for process in self.processes:
            process.start()
        return init_method

    def describe(self) -> str:
        states = []
        for rank, process in enumerate(self.processes, start=1):
            process.join(0.5)  # a dying peer is what broke the collective: give it a moment to be reaped
            code = process.exitcode
            if code is None:
                continue
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            states.append(f"worker rank {rank} (pid {process.pid}) {how}")
        return "; ".join(states) or "no worker process exited, one stopped answering within distributed_timeout_seconds"

    def stop(self, graceful: bool) -> None:
        for process in self.processes:
            if graceful:
                process.join(STOP_TIMEOUT)
            if process.is_alive():
                process.kill()
            process.join()


class RayExecutor:
    """Worker ranks as Ray actors in one placement group (one bundle per worker), as vLLM places them."""

    name = "ray"

    def start(self, config: EngineConfig, model, topology: Topology, device: torch.device) -> str:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as error:
            raise InvalidRequest(
                "distributed_executor_backend='ray' needs Ray, which is not installed; install paged-backend[ray]"
            ) from error
        self.ray = ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port(host)}"
        gpu = device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.group = placement_group([bundle] * (topology.world_size - 1), strategy="PACK")
        ray.get(self.group.ready(), timeout=config.parallel.distributed_timeout_seconds)
        actor_cls = ray.remote(RayWorker)
        self.actors = [
            actor_cls.options(
                num_cpus=1,
                num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
            ).remote()
            for index in range(topology.world_size - 1)
        ]
        shared = model if config.model is None else None  # named models load on their node
        self.runs = [
            actor.run.remote(rank, topology, init_method, config, shared, 0, torch.get_num_threads())
            for rank, actor in enumerate(self.actors, start=1)
        ]
        return init_method

    def describe(self) -> str:
        done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=0.5)
        states = []
        for ref in done:
            rank = self.runs.index(ref) + 1
            try:
                self.ray.get(ref)
                states.append(f"worker rank {rank} left")
            except Exception as error:  # the actor's own failure, as Ray reports it
                states.append(f"worker rank {rank} failed: {type(error).__name__}: {str(error).splitlines()[0]}")
        return "; ".join(states) or "no worker actor exited, one stopped answering within distributed_timeout_seconds"

    def stop(self, graceful: bool) -> None:
        from ray.util.placement_group import remove_placement_group

        if graceful:
            self.ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_TIMEOUT)
        for actor in self.actors:
            self.ray.kill(actor)
        remove_placement_group(self.group)
        if self.owns_ray:
            self.ray.shutdown()


class RayWorker:
    """A Ray actor that runs one worker rank until the driver stops it."""

    def run(self, *args) -> None:
        worker_main(*args)


class TorchrunExecutor:
    """Every rank was started by torchrun (or a launcher setting RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT): the
    ranks rendezvous through its environment; nothing is started or stopped here."""

    name = "torchrun"

    def start(self, config: EngineConfig, model, topology: Topology, device: torch.device) -> str:
        world = int(os.environ["WORLD_SIZE"])
        if world != topology.world_size:
            raise InvalidRequest(
                f"torchrun started {world} ranks but tensor_parallel_size x pipeline_parallel_size is "
                f"{topology.world_size}; make --nnodes x --nproc-per-node equal it"
            )
        return "env://"

    def describe(self) -> str:
        return "a torchrun rank left or stopped answering (see that node's torchrun log)"

    def stop(self, graceful: bool) -> None:
        pass  # torchrun's agents reap their own ranks; they leave once the driver's groups close


EXECUTORS = {"mp": MultiprocExecutor, "ray": RayExecutor, "torchrun": TorchrunExecutor}
