"""A tensor-parallel CPU engine: one process per rank, each with its own ONNX Runtime session over its rank's graph
and its own KV pool (its share of the KV heads), all running every step; their AllReduce / AllGather nodes meet in a
shared-memory channel (cpu_ops/collectives.cc), as TensorRT-LLM's ranks meet in NCCL and vLLM's CPU workers in
shared memory.

Rank 0 runs in this process and gives the step's results; ranks 1 .. tp-1 are worker processes that receive each
call (the step's chunks, a KV block copy) over a pipe and answer when done. `TensorParallelEngine` has the
`CpuEngine` contract, so the scheduler, the sampler and every server run it unchanged.

A rank whose process dies breaks the channel: a watcher thread marks it, so the other ranks leave their collective
with an error instead of waiting, and every later call says which rank stopped; the engine must be started again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import secrets
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np

from trtbuild.builder.engine_dir import EngineInfo
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.cpu_topology import numa_node_cpus, parse_rank_cpus, pin_this_thread, rank_cpu_sets
from trtbuild.runtime.engine import CpuEngine, SequenceChunk, StepOutput, check_chunks, default_threads

log = logging.getLogger(__name__)

# The channel's layout, as cpu_ops/collectives.cc reads it: a 4096-byte header (uint32 magic, version, world size,
# broken flag; uint64 slot bytes; uint32 barrier timeout in ms; the barrier's counters at 64 and 128), then two
# buffers of one slot per rank.
_MAGIC, _VERSION, _HEADER_BYTES = 0x48435054, 1, 4096
SLOT_BYTES = 8 << 20  # a collective larger than a slot goes through in pieces
# How long a rank waits for the others at a collective, and after rank 0 ends a call for the others' answers: they
# run the same step, so only a rank that is stopped or stuck takes this long.
COLLECTIVE_SECONDS = 60.0
ANSWER_SECONDS = 120.0
_SHUT_DOWN = "the engine was shut down"


def engine_method(engine: CpuEngine, path: str) -> Callable[..., Any]:
    """The CpuEngine method a call names, dotted ("execute", "kv.copy_blocks"): what every rank runs."""
    target: Any = engine
    for part in path.split("."):
        target = getattr(target, part)
    return target


class RankStopped(TrtbuildError):
    """A tensor-parallel rank's process is gone, or failed a call: the engine cannot step any more."""


class Channel:
    """The shared memory a tensor-parallel engine's ranks meet in, named by a random id (the graphs' tp_group)."""

    def __init__(self, world: int) -> None:
        self.id = secrets.randbits(62)
        self.memory = SharedMemory(name=f"trtbuild-tp-{self.id:x}", create=True,
                                   size=_HEADER_BYTES + 2 * world * SLOT_BYTES)
        header = np.ndarray(4, np.uint32, self.memory.buf)
        header[:] = (_MAGIC, _VERSION, world, 0)
        np.ndarray(1, np.uint64, self.memory.buf, offset=16)[0] = SLOT_BYTES
        np.ndarray(1, np.uint32, self.memory.buf, offset=24)[0] = int(COLLECTIVE_SECONDS * 1000)

    def mark_broken(self) -> None:
        """Make every rank waiting in (or reaching) a collective fail instead of waiting for a rank that is gone."""
        np.ndarray(4, np.uint32, self.memory.buf)[3] = 1

    @staticmethod
    def mark_broken_by_id(channel_id: int) -> None:
        """`mark_broken` from a worker process, which maps the channel by its file (not through SharedMemory, whose
        resource tracker would count the worker's mapping as one to remove)."""
        with open(f"/dev/shm/trtbuild-tp-{channel_id:x}", "r+b") as f, mmap.mmap(f.fileno(), _HEADER_BYTES) as m:
            np.ndarray(4, np.uint32, m)[3] = 1

    def close(self) -> None:
        self.memory.close()
        self.memory.unlink()


class _Ranks:
    """The worker processes of ranks 1 .. tp-1 (runtime/tp_worker.py) and a socket to each.

    NOTE: subprocesses, not multiprocessing's: its spawn start method runs the user's main module again in each
    worker, which a script without a `__main__` guard does not survive, and fork would copy ONNX Runtime's threads."""

    def __init__(self, info: EngineInfo, threads: list[int], num_blocks: int, channel: Channel,
                 cpu_sets: list[frozenset[int]] | None) -> None:
        import trtbuild

        # NOTE: where this process found trtbuild (not resolved: a symlinked package dir stays where it was found)
        package_root = str(Path(trtbuild.__file__).absolute().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self.processes: list[subprocess.Popen] = []
        self.pipes: list[Connection] = []
        self.stopped: str | None = None  # why the engine cannot step any more
        for rank in range(1, info.model.mapping.tp_size):
            ours, theirs = socket.socketpair()
            cpus = ",".join(map(str, sorted(cpu_sets[rank]))) if cpu_sets else "-"
            command = [sys.executable, "-m", "trtbuild.runtime.tp_worker", str(theirs.fileno()), str(info.path),
                       str(rank), str(threads[rank]), str(num_blocks), str(channel.id), cpus]
            self.processes.append(subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env))
            theirs.close()
            self.pipes.append(Connection(ours.detach()))

    def exit_code(self, rank: int) -> int | None:
        return self.processes[rank - 1].poll()

    def send(self, path: str, args: tuple) -> None:
        self._check()
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send((path, args))
            except OSError:
                self._stop(f"rank {rank}'s process is gone (exit code {self.exit_code(rank)})")

    def receive(self, loading: bool = False) -> None:
        """Every worker's answer to the last call, each within ANSWER_SECONDS of rank 0's own (`loading`: the
        "ready" of its engine, which may take minutes); the first failure stops the engine."""
        timeout = None if loading else ANSWER_SECONDS
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                if not pipe.poll(timeout):  # NOTE: its late answer would be taken for the next call's: stop
                    status, message = "late", f"no answer within {timeout:.0f} s of rank 0's"
                else:
                    status, message = pipe.recv()
            except (EOFError, OSError):
                status, message = "gone", f"its process exited, exit code {self.processes[rank - 1].wait()}"
            if status not in ("ok", "ready") and self.stopped is None:
                self.stopped = f"rank {rank} failed ({message})"
        self._check()

    def _stop(self, why: str) -> None:
        self.stopped = self.stopped or why
        raise RankStopped(f"tensor-parallel engine stopped: {self.stopped}; start it again.")

    def _check(self) -> None:
        if self.stopped is not None:
            self._stop(self.stopped)

    def watch(self, on_exit: Callable[[int, int | None], None]) -> None:
        """Call `on_exit(rank, exit code)` (from a daemon thread) when a worker exits."""
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(target=lambda r=rank, p=process: on_exit(r, p.wait()), name=f"trtbuild-tp-watch{rank}",
                             daemon=True).start()


def _rank_exited(ranks: _Ranks, channel: Channel, rank: int, code: int | None) -> None:
    if ranks.stopped == _SHUT_DOWN:
        return
    if ranks.stopped is None:
        ranks.stopped = f"rank {rank}'s process exited (exit code {code})"
        log.error("tensor-parallel engine: %s", ranks.stopped)
    channel.mark_broken()


def _shut_down(ranks: _Ranks, channel: Channel) -> None:
    ranks.stopped = _SHUT_DOWN
    for pipe in ranks.pipes:
        with contextlib.suppress(OSError):
            pipe.send(None)
    for process in ranks.processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    channel.close()


class _AllRanksKV:
    """The KV pools of every rank as one: rank 0's pool answers questions, and what changes a pool changes all."""

    def __init__(self, engine: TensorParallelEngine) -> None:
        self._engine, self._pool = weakref.proxy(engine), engine.rank0.kv  # NOTE: no cycle keeps the engine

    def reserve(self) -> None:
        self._engine.on_all_ranks("kv.reserve")

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._engine.on_all_ranks("kv.copy_blocks", copies)

    @property
    def bytes_per_block(self) -> int:
        return self._pool.bytes_per_block * self._engine.tp_size

    @property
    def bytes_per_token(self) -> int:
        return self._pool.bytes_per_token * self._engine.tp_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class TensorParallelEngine:
    """`CpuEngine`'s contract over the ranks of a tensor-parallel cpu engine (module docstring)."""

    def __init__(self, info: EngineInfo, num_threads: int | None = None, num_blocks: int = 64,
                 cpu_sets: list[frozenset[int]] | None = None) -> None:
        """`num_threads`: over all ranks [None: each rank's CPUs where they are pinned, else `default_threads`].
        `cpu_sets`: the CPUs of each rank [None: one run of NUMA nodes each where the machine has as many nodes as
        ranks (runtime/cpu_topology.py), else none pinned]. Rank 0's are this thread's and its later threads'."""
        self.tp_size = info.model.mapping.tp_size
        self.cpu_sets = cpu_sets or rank_cpu_sets(self.tp_size, numa_node_cpus())
        if num_threads is None and self.cpu_sets:
            threads = [len(cpus) for cpus in self.cpu_sets]
        else:
            threads = [max(1, (num_threads or default_threads(info.tuned_threads)) // self.tp_size)] * self.tp_size
        self.channel = Channel(self.tp_size)
        self.ranks = _Ranks(info, threads, num_blocks, self.channel, self.cpu_sets)
        self._finalizer = weakref.finalize(self, _shut_down, self.ranks, self.channel)
        self._pinned: set[int] = set()  # this process's threads pinned to rank 0's CPUs
        try:
            self._pin_this_thread()  # NOTE: before the session: ONNX Runtime's threads inherit it
            self.rank0 = CpuEngine(info, num_threads=threads[0], num_blocks=num_blocks, rank=0,
                                   tp_group=self.channel.id)
            self.ranks.receive(loading=True)
        except BaseException:
            self._finalizer()
            raise
        self.ranks.watch(functools.partial(_rank_exited, self.ranks, self.channel))  # NOTE: holds no engine
        self.info, self.kv = self.rank0.info, _AllRanksKV(self)
        log.info("tensor-parallel engine: %d ranks, %s threads, CPUs %s", self.tp_size, threads,
                 [sorted(c) for c in self.cpu_sets] if self.cpu_sets else "not pinned (fewer NUMA nodes than ranks)")

    def _pin_this_thread(self) -> None:
        """Rank 0 runs on its CPUs in whichever thread steps it (its session's threads started pinned)."""
        if self.cpu_sets and threading.get_ident() not in self._pinned:
            pin_this_thread(self.cpu_sets[0])
            self._pinned.add(threading.get_ident())

    def on_all_ranks(self, path: str, *args: Any) -> Any:
        """Call `path` (a method of CpuEngine, dotted) on every rank, rank 0 here; returns rank 0's result."""
        self._pin_this_thread()
        self.ranks.send(path, args)
        try:
            result = engine_method(self.rank0, path)(*args)
        except Exception as e:
            self.channel.mark_broken()  # NOTE: so that no worker waits for rank 0 in a collective
            self.ranks.stopped = self.ranks.stopped or f"rank 0 failed ({type(e).__name__}: {e})"
            self.ranks.receive()  # raises RankStopped with the first rank's reason
            raise
        self.ranks.receive()
        return result

    def execute(self, chunks: list[SequenceChunk]) -> StepOutput:
        # NOTE: bad chunks are refused here, before any rank starts: a rank failing mid-step stops the engine
        check_chunks(self.info.build, chunks, self.max_draft_len, len(self.kv.groups))
        return self.on_all_ranks("execute", chunks)

    def step(self, chunks: list[SequenceChunk]) -> np.ndarray:
        return self.execute(chunks).logits

    def warm_up(self, max_batch_size: int, max_num_tokens: int) -> None:
        self.on_all_ranks("warm_up", max_batch_size, max_num_tokens)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.on_all_ranks("allocate_kv_cache", num_blocks)
        self.kv = _AllRanksKV(self)

    def close(self) -> None:
        """Stop the worker processes and remove the channel (also done when the engine is collected)."""
        self._finalizer()

    def __getattr__(self, name: str) -> Any:  # session, run_seconds, max_draft_len, lora_slots: rank 0's
        if name == "rank0":  # NOTE: not yet set (a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.rank0, name)


def make_cpu_engine(info: EngineInfo, num_threads: int | None = None, num_blocks: int = 64,
                    rank_cpus: str | None = None) -> CpuEngine | TensorParallelEngine:
    """The engine for a cpu engine directory: one session, or one per tensor-parallel rank (`rank_cpus`: their
    CPUs, RuntimeConfig.rank_cpus)."""
    tp = info.model.mapping.tp_size
    cpu_sets = parse_rank_cpus(rank_cpus) if rank_cpus is not None else None
    if cpu_sets is not None and len(cpu_sets) != tp:  # NOTE: refused, not ignored
        raise ConfigError("rank_cpus", f"gives {len(cpu_sets)} ranks' CPUs, but {info.path} has {tp} "
                                       f"tensor-parallel rank{'s' if tp > 1 else ''}")
    if tp > 1:
        return TensorParallelEngine(info, num_threads=num_threads, num_blocks=num_blocks, cpu_sets=cpu_sets)
    return CpuEngine(info, num_threads=num_threads, num_blocks=num_blocks)
