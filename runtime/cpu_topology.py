"""Which CPUs each rank of a tensor-parallel engine runs on: one NUMA node's (or several nodes') each, so that a rank
reads the weights and KV blocks it first touched from its own node's memory, as vLLM's CPU workers bind to theirs.
On a machine with fewer nodes than ranks (one socket) nothing is pinned."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> frozenset[int]:
    """Linux's CPU list format: "0-3,8-11" -> {0, 1, 2, 3, 8, 9, 10, 11}."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def parse_rank_cpus(text: str) -> list[frozenset[int]]:
    """`--rank-cpus`: each rank's CPUs, "|"-separated Linux CPU lists ("0-31|32-63"), none empty or shared."""
    from trtbuild.errors import ConfigError

    try:
        sets = [parse_cpu_list(part) for part in text.split("|")]
    except ValueError:
        sets = []
    if len(sets) < 2 or not all(sets) or len(frozenset().union(*sets)) != sum(map(len, sets)):
        raise ConfigError("rank_cpus", f"must give each tensor-parallel rank its own CPUs as Linux CPU lists "
                                       f"separated by '|' (e.g. 0-31|32-63), got {text!r}")
    return sets


def numa_node_cpus(nodes: Path = NODES) -> list[frozenset[int]]:
    """The CPUs of each NUMA node this process may run on, nodes in order; [] where sysfs does not say."""
    allowed = os.sched_getaffinity(0)
    found = []
    for node in sorted(nodes.glob("node[0-9]*"), key=lambda p: int(p.name.removeprefix("node"))):
        try:
            cpus = parse_cpu_list((node / "cpulist").read_text()) & allowed
        except (OSError, ValueError):
            continue
        if cpus:
            found.append(cpus)
    return found


def rank_cpu_sets(tp_size: int, nodes: list[frozenset[int]]) -> list[frozenset[int]] | None:
    """The CPUs of each rank: the nodes split into `tp_size` runs of whole nodes (the first runs one node longer
    where they do not divide), or None (no pinning) where there are fewer nodes than ranks."""
    if len(nodes) < tp_size or tp_size < 2:
        return None
    base, extra = divmod(len(nodes), tp_size)
    sets, start = [], 0
    for rank in range(tp_size):
        end = start + base + (rank < extra)
        sets.append(frozenset().union(*nodes[start:end]))
        start = end
    return sets


def pin_this_thread(cpus: frozenset[int] | None) -> None:
    """Run the calling thread (and the threads it starts after this) on `cpus` only; None: leave it."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
