"""A worker process of a tensor-parallel cpu engine (runtime/tensor_parallel.py starts one per rank after rank 0):

    python -m trtbuild.runtime.tp_worker <socket fd> <engine dir> <rank> <threads> <num blocks> <channel id> <cpus>

(`cpus`: "0,1,..." to run on, before anything else starts a thread; "-": not pinned.)

It loads its rank's engine, answers "ready" (or the error), then runs each call rank 0 sends over the socket (a
CpuEngine method's dotted name and its arguments) and answers "ok" or the error, until the socket closes.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection


def serve(conn: Connection, engine_dir: str, rank: int, threads: int, num_blocks: int, group: int) -> None:
    from trtbuild.builder.engine_dir import read_engine_config
    from trtbuild.runtime.engine import CpuEngine
    from trtbuild.runtime.tensor_parallel import Channel, engine_method

    try:
        engine = CpuEngine(read_engine_config(engine_dir), num_threads=threads, num_blocks=num_blocks, rank=rank,
                           tp_group=group)
    except Exception as e:  # NOTE: any failure to load is reported to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            call = conn.recv()
        except EOFError:  # rank 0 closed the socket (shut down, or its process is gone)
            return
        if call is None:
            return
        path, args = call
        try:
            engine_method(engine, path)(*args)
            conn.send(("ok", None))
        except Exception as e:
            Channel.mark_broken_by_id(group)  # NOTE: rank 0 may be waiting for this rank in a collective
            conn.send(("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    fd, engine_dir, rank, threads, num_blocks, group, cpus = sys.argv[1:]
    if cpus != "-":  # NOTE: first: ONNX Runtime's threads, and the pages the rank touches first, follow it
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    serve(Connection(int(fd)), engine_dir, int(rank), int(threads), int(num_blocks), int(group))
