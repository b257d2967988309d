"""`launch --num-shard N --backend grpc`: one shard process per rank, started the way TGI's launcher starts them.

Each child runs `text-generation-server serve MODEL --uds-path P [--sharded]` with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set; a shard is ready when its socket `{P}-{rank}` exists. The children die with the
launcher (PR_SET_PDEATHSIG), a child that exits early stops the launcher, and `stop` ends every child.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from paged_backend.worker.default_model import default_model

logger = logging.getLogger("paged_backend.tgi")
STARTUP_TIMEOUT = 600.0  # seconds for every shard to load its weights and bind its socket
STOP_TIMEOUT = 15.0
DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT = "localhost", 29500  # TGI's defaults
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: `stop` and the exit watcher still end the children
        pass


def shard_command(args: argparse.Namespace, num_shard: int) -> list[str]:
    command = [sys.executable, "-m", "paged_backend.tgi.shard", "serve", args.model_id or default_model()]
    command += ["--uds-path", args.shard_uds_path]
    if num_shard > 1:
        command.append("--sharded")
    for flag, value in (("--dtype", args.dtype), ("--num-blocks", args.num_blocks), ("--device", args.device)):
        if value is not None:
            command += [flag, str(value)]
    return command


class ShardProcesses:
    """The launcher's shard children: start, wait for their sockets, watch them, stop them."""

    def __init__(self, args: argparse.Namespace, num_shard: int) -> None:
        self.socket_paths = [Path(f"{args.shard_uds_path}-{rank}") for rank in range(num_shard)]
        for path in self.socket_paths:
            path.unlink(missing_ok=True)  # a stale socket would pass for readiness
        env = {
            **os.environ,
            "WORLD_SIZE": str(num_shard),
            "MASTER_ADDR": args.master_addr or DEFAULT_MASTER_ADDR,
            "MASTER_PORT": str(args.master_port or DEFAULT_MASTER_PORT),
        }
        command = shard_command(args, num_shard)
        self.processes = [
            subprocess.Popen(command, env={**env, "RANK": str(rank)}, preexec_fn=_die_with_parent)
            for rank in range(num_shard)
        ]
        self.failure: str | None = None
        self._stopping = threading.Event()

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not all(path.exists() for path in self.socket_paths):
            self._check_alive()
            if self.failure:
                raise SystemExit(f"paged-backend launch: {self.failure}")
            if time.monotonic() > deadline:
                raise SystemExit(f"paged-backend launch: shards not ready after {timeout:.0f}s")
            time.sleep(0.1)
        logger.info("%d shards ready at %s-*", len(self.processes), str(self.socket_paths[0])[:-2])
        threading.Thread(target=self._watch, daemon=True).start()

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.poll() is not None and not self._stopping.is_set() and self.failure is None:
                self.failure = f"shard {rank} exited with code {process.returncode}"

    def _watch(self) -> None:
        """A shard that dies while serving takes the launcher down, as TGI's launcher does (SIGTERM to itself)."""
        while not self._stopping.wait(0.5):
            self._check_alive()
            if self.failure:
                logger.error("%s: shutting down", self.failure)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def stop(self) -> None:
        logger.info("stopping %d shards", len(self.processes))
        self._stopping.set()
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        logger.info("shards stopped")
