"""The collective layer of a parallel worker group (KVP ranks or SPP stages).

`Collective` wraps one torch.distributed process group built directly over a store (gloo on
CPU, NCCL on CUDA), so a process may hold several groups and no global default group is set.
It offers what the group needs: `all_gather` of one tensor per rank, `send`/`recv` between
ranks, and `broadcast_plan` (a pickled `StepPlan` or None from rank 0, the leader). Rank 0 hosts
the `TCPStore`; `GroupAddress` is the plain message that tells the other ranks where it is.

`serve_rank(coll, run)` is every non-leader rank's loop: receive a plan, run it, until the
leader broadcasts None. `thread_group` starts ranks 1..world-1 as threads of this process
(tests and one-host use; torch releases the GIL in its kernels); raycluster.parallel.ray_group
starts them as Ray actors.
"""

from __future__ import annotations

import pickle
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


# A step plan up to this size (a few thousand block ids) goes in one broadcast.
PLAN_BUFFER_BYTES = 64 * 1024


@dataclass
class GroupAddress:
    host: str
    port: int
    world: int
    timeout_s: float = 60.0


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Collective:
    def __init__(self, addr: GroupAddress, rank: int, device: str = "cpu") -> None:
        if not 0 <= rank < addr.world:
            raise ValueError(f"rank {rank} outside world {addr.world}")
        self.rank, self.world = rank, addr.world
        t = timedelta(seconds=addr.timeout_s)
        self.store = dist.TCPStore(addr.host, addr.port, addr.world, is_master=rank == 0,
                                   timeout=t, wait_for_workers=False)
        if device.startswith("cuda"):   # pragma: no cover - no GPU here
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = t
            self.pg = dist.ProcessGroupNCCL(self.store, rank, addr.world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr.host)]
            opts._timeout = t
            self.pg = dist.ProcessGroupGloo(self.store, rank, addr.world, opts)
        self._buf = torch.zeros(PLAN_BUFFER_BYTES, dtype=torch.uint8)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's tensor, in rank order."""
        out = t.new_empty((self.world,) + tuple(t.shape))
        self.pg.allgather([list(out.unbind(0))], [t.contiguous()]).wait()
        return out

    def send(self, t: torch.Tensor, dst: int, tag: int = 0):
        """Posts the send; returns the work to wait on before reusing `t`."""
        return self.pg.send([t.contiguous()], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.pg.recv([t], src, tag).wait()
        return t

    def broadcast_plan(self, plan: Any = None) -> Any:
        """Rank 0 passes the plan (None stops the group); every rank returns it. One broadcast of
        a fixed buffer (length + pickle) when the plan fits, a second for the rest when not."""
        buf = self._buf
        if self.rank == 0:
            data = pickle.dumps(plan, protocol=5)
            n = len(data)
            buf[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            head = min(n, buf.numel() - 8)
            buf[8:8 + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        self.pg.broadcast([buf], dist.BroadcastOptions()).wait()
        if self.rank == 0:
            if n > head:
                self.pg.broadcast([torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)],
                                  dist.BroadcastOptions()).wait()
            return plan
        n = int(buf[:8].view(torch.int64)[0])
        head = min(n, buf.numel() - 8)
        data = buf[8:8 + head].numpy().tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            self.pg.broadcast([rest], dist.BroadcastOptions()).wait()
            data += rest.numpy().tobytes()
        return pickle.loads(data)


def serve_rank(coll: Collective, run: Callable[[Any], Any]) -> int:
    """A worker rank's loop: run each plan the leader broadcasts until it sends None. Returns
    the number of plans run."""
    steps = 0
    while (plan := coll.broadcast_plan()) is not None:
        run(plan)
        steps += 1
    return steps


class ThreadRanks:
    """Ranks 1..world-1 running `serve_rank` in threads of this process; `errors` keeps what a
    rank raised (the leader's next collective then times out rather than hangs forever)."""

    def __init__(self, addr: GroupAddress, make_run: Callable[[Collective], Callable[[Any], Any]],
                 device: str = "cpu") -> None:
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._main, args=(addr, r, make_run, device),
                                          name=f"rank-{r}", daemon=True) for r in range(1, addr.world)]
        for t in self._threads:
            t.start()

    def _main(self, addr, rank, make_run, device) -> None:
        try:
            coll = Collective(addr, rank, device)
            serve_rank(coll, make_run(coll))
        except BaseException as e:   # surfaced through `errors`; the thread must not die silently
            self.errors.append(e)

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)
