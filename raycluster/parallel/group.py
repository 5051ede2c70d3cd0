"""The collective layer of a parallel worker group (KVP or TP ranks, SPP stages).

`Collective` wraps one torch.distributed process group built directly over a store (gloo on
CPU, NCCL on CUDA), so a process may hold several groups and no global default group is set.
It offers what the group needs: `all_gather` of one tensor per rank, `all_reduce` (sum, in
place; tensor parallelism's per-layer exchange), `send`/`recv` between ranks, and the plan chain: the leader (rank 0) `post_plan`s each message (a pickled `StepPlan`,
a block move, or None) to rank 1, and each rank's `next_plan` passes it on to the next, so no rank
waits for the others to be idle before it gets its next message. Rank 0 hosts
the `TCPStore`; `GroupAddress` is the plain message that tells the other ranks where it is.
`subgroup(members)` builds a further `Collective` over some of the ranks (its own process
group, met in the same store under a prefix): a pipeline stage's TP ranks all-reduce in one.

`serve_rank(coll, run)` is every non-leader rank's loop: receive a message, run it, until the
leader posts None. `ThreadRanks` starts ranks 1..world-1 as threads of this process
(tests and one-host use; torch releases the GIL in its kernels); raycluster.parallel.ray_group
starts them as Ray actors.
"""

from __future__ import annotations

import pickle
from collections import deque
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


# A step plan up to this size (a few thousand block ids) goes in one message per hop.
PLAN_BUFFER_BYTES = 64 * 1024
MAX_POSTED = 8      # messages the leader (or a relaying rank) may have in flight down the chain
PLAN_TAG = 4        # tags 1-3 are the SPP hidden states, sampled rows and KV block moves
GATHER_TAG = 5


@dataclass
class GroupAddress:
    host: str
    port: int
    world: int
    timeout_s: float = 60.0


def _process_group(store, rank: int, world: int, host: str, timeout: timedelta, device: str):
    """A gloo (CPU) or NCCL (CUDA) process group of `world` ranks meeting in `store`."""
    if device.startswith("cuda"):   # pragma: no cover - no GPU here
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world, opts)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class Collective:
    """`bind_host`: the address this rank's gloo sockets bind to, the store's host by default;
    a rank on another node than the store binds its own node's address."""

    def __init__(self, addr: GroupAddress, rank: int, device: str = "cpu", bind_host: str | None = None) -> None:
        if not 0 <= rank < addr.world:
            raise ValueError(f"rank {rank} outside world {addr.world}")
        self.rank, self.world = rank, addr.world
        self.members = list(range(addr.world))     # world rank of each rank of this group
        self._host, self._device = bind_host or addr.host, device
        self._timeout = timedelta(seconds=addr.timeout_s)
        self.store = dist.TCPStore(addr.host, addr.port, addr.world, is_master=rank == 0,
                                   timeout=self._timeout, wait_for_workers=False)
        self.pg = _process_group(self.store, rank, addr.world, self._host, self._timeout, device)
        self._buf = torch.zeros(PLAN_BUFFER_BYTES, dtype=torch.uint8)
        self._posted: deque = deque()

    def subgroup(self, members: list[int]) -> Collective:
        """A Collective of its own over world ranks `members` (this rank among them), e.g. the
        TP ranks of one pipeline stage: its own process group, met in this group's store under
        a prefix naming the members, so only the members build it (each once, all at about the
        same time: building waits for them all). Its `rank` / `world` / `send` / `recv` count
        in the subgroup's ranks (`members[i]` is subgroup rank i). No plan chain of its own."""
        members = list(members)
        if self.rank not in members or len(set(members)) != len(members):
            raise ValueError(f"rank {self.rank}: subgroup {members} must hold this rank, each rank once")
        if any(not 0 <= m < self.world for m in members):
            raise ValueError(f"subgroup {members} outside world {self.world}")
        sub = Collective.__new__(Collective)
        sub.rank, sub.world = members.index(self.rank), len(members)
        sub.members = [self.members[m] for m in members]
        sub._host, sub._device, sub._timeout = self._host, self._device, self._timeout
        sub.store = dist.PrefixStore("sub/" + ",".join(map(str, sub.members)) + "/", self.store)
        sub.pg = _process_group(sub.store, sub.rank, sub.world, self._host, self._timeout, self._device)
        sub._buf, sub._posted = torch.zeros(PLAN_BUFFER_BYTES, dtype=torch.uint8), deque()
        return sub

    def all_gather(self, t: torch.Tensor, ranks: list[int] | None = None) -> torch.Tensor:
        """[len(ranks), *t.shape]: the tensor of each of `ranks` (default all, ascending; this
        rank among them), in that order. Only those ranks take part: each sends its tensor to
        every other and receives theirs (len - 1 messages each way, all in flight at once): for
        the small groups and small states KVP exchanges per layer this has about half the
        latency of gloo's ring allgather here, and a KVP step can leave out idle ranks."""
        ranks = range(self.world) if ranks is None else ranks
        t = t.contiguous()
        out = t.new_empty((len(ranks),) + tuple(t.shape))
        peers = []
        for i, r in enumerate(ranks):
            if r == self.rank:
                out[i] = t
            else:
                peers.append((i, r))
        if len(peers) == len(ranks):
            raise ValueError(f"rank {self.rank} gathers over {list(ranks)} without being among them")
        sends = [self.pg.send([t], r, GATHER_TAG) for _, r in peers]
        for i, r in peers:
            self.pg.recv([out[i]], r, GATHER_TAG).wait()
        for w in sends:
            w.wait()
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place on every rank; returns `t`. Every rank ends with the
        same values (gloo's ring copies the reduced chunks back out), so ranks stay in step."""
        self.pg.allreduce([t]).wait()
        return t

    def send(self, t: torch.Tensor, dst: int, tag: int = 0):
        """Posts the send; returns the work to wait on before reusing `t`."""
        return self.pg.send([t.contiguous()], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.pg.recv([t], src, tag).wait()
        return t

    def post_plan(self, plan: Any) -> None:
        """Leader: send the next message (a plan, a block move, or None to stop) down the chain
        of ranks. It does not wait for the ranks to be idle: an SPP stage may still be running
        the previous step when the next one is posted, which is what lets chunks stream."""
        self._send_obj(plan, 1)

    def next_plan(self) -> Any:
        """Non-leader: the next message from rank - 1, forwarded to rank + 1 before returning."""
        plan = self._recv_obj(self.rank - 1)
        if self.rank + 1 < self.world:
            self._send_obj(plan, self.rank + 1)
        return plan

    def flush(self) -> None:
        """Wait until every posted message has been received (e.g. before tearing down)."""
        while self._posted:
            self._posted.popleft()[0].wait()

    def _send_obj(self, obj: Any, dst: int) -> None:
        # One message of a fixed size (length + pickle) when it fits, a second for the rest.
        # Not waited for: gloo completes a send only once the peer has posted its receive, and
        # a stage still busy with the last step must not hold the leader back. Sends complete
        # in order; at most MAX_POSTED stay outstanding (with their buffers kept alive).
        data = pickle.dumps(obj, protocol=5)
        buf = torch.zeros(PLAN_BUFFER_BYTES, dtype=torch.uint8)
        buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head = min(len(data), PLAN_BUFFER_BYTES - 8)
        buf[8:8 + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        bufs = [buf]
        if len(data) > head:
            bufs.append(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))
        posted = self._posted
        for b in bufs:
            posted.append((self.pg.send([b], dst, PLAN_TAG), b))
        while posted and (len(posted) > MAX_POSTED or posted[0][0].is_completed()):
            posted.popleft()[0].wait()

    def _recv_obj(self, src: int) -> Any:
        buf = self._buf
        self.pg.recv([buf], src, PLAN_TAG).wait()
        n = int(buf[:8].view(torch.int64)[0])
        head = min(n, buf.numel() - 8)
        data = buf[8:8 + head].numpy().tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            self.pg.recv([rest], src, PLAN_TAG).wait()
            data += rest.numpy().tobytes()
        return pickle.loads(data)


def serve_rank(coll: Collective, run: Callable[[Any], Any]) -> int:
    """A worker rank's loop: run each message the leader posts until it posts None. Returns
    the number of plans run."""
    steps = 0
    while (plan := coll.next_plan()) is not None:
        run(plan)
        steps += 1
    coll.flush()            # the None must reach the ranks after this one
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
