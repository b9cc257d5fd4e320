"""The corpus stage's all-to-all exchanges, on Ray tasks: one map task per staged block, one reduce task per partition.

Why not Ray Data's groupby: at 250,000 documents its sort-based exchange (sample, sort each block by the partition
column, merge, split into groups, convert each group to numpy) cost about ten times the bucket kernel it fed
(1.3 CPU-s of numpy in a 7.5 s phase on 2 CPUs), and the hash-based one starts a pool of actors per groupby. Here a map
task returns its rows already cut into one object per partition (`num_returns`), and the reduce task of a partition
receives those objects as arguments, zero-copy from the object store: nothing is sorted but what the kernels sort.

Memory: the object store holds one round's map outputs (the caller sizes the rounds); a reduce task holds its
partition; the driver holds object references and the reduce results, which are duplicate-shaped. Every task hands
its freed heap back to the system when it ends (`release_memory`): the worker processes outlive the tasks, and a
partition's temporaries would otherwise stay resident in an idle worker for the rest of the stage.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa


def release_memory() -> None:
    """Return freed memory to the system: Arrow's pool, and glibc's heap (malloc_trim; numpy arrays under its
    mmap threshold come from there, and free()d pages stay resident until trimmed)."""
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def by_part(part: np.ndarray, parts: range) -> tuple[np.ndarray, np.ndarray]:
    """(order, cuts): rows in partition order and the bounds of partition `parts[k]` in it, [cuts[k], cuts[k+1])."""
    order = np.argsort(part, kind="stable")
    return order, np.searchsorted(part[order], np.arange(parts.start, parts.stop + 1))


def shuffle(inputs: Sequence[Any], mapper: Callable, reducer: Callable, parts: int,
            map_args: tuple = (), reduce_args: Callable[[int], tuple] = lambda p: ()) -> list:
    """One exchange: `mapper(input, *map_args)` returns `parts` objects, the k-th for partition k;
    `reducer(*reduce_args(k), *objects for k from every input)` runs once per partition. Returns the reducers'
    results in partition order. Arguments that are object references arrive resolved (shared, read-only)."""
    import ray

    def split(x, *args):  # a single return value is stored as is, so one partition's object is not a 1-list
        out = mapper(x, *args)
        release_memory()
        return out[0] if parts == 1 else tuple(out)

    def reduce(*args):
        out = reducer(*args)
        release_memory()
        return out

    map_task = ray.remote(split).options(num_returns=parts)
    outputs = [map_task.remote(x, *map_args) for x in inputs]
    if parts == 1:
        outputs = [[o] for o in outputs]
    reduce_task = ray.remote(reduce)
    results = [reduce_task.remote(*reduce_args(p), *(o[p] for o in outputs)) for p in range(parts)]
    del outputs  # each partition's objects are freed once its reducer has run
    return ray.get(results)
