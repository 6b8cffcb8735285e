"""KV hand-off bookkeeping of a disaggregated worker: what it holds of a request between the
prefill's first token and the decode side's admission, and which routing attempt each belongs to.

    prefill side  KVLeases   the KV of parked requests (KVLease), held until the decode side
                             acknowledges the transfer, the router releases it, or it expires; a
                             read in progress pins its lease: an ended lease is freed only once its
                             readers are done, so a block is never reused while it is copied out
    decode side   KVInbox    transfers admitted and not yet in the engine, the fetched KV staged in
                             memory in order (StagedKV, its bytes counted against a bound), and the
                             (request, attempt)s aborted while in that pipeline
    both          KVInbox.attempts, the newest routing attempt seen per request: a message of an
                  older one is stale (Ray may deliver a threaded actor's calls out of order)

Plain bookkeeping under locks, no engine: the worker (worker.py) frees the blocks, fetches, admits
and reports. KVInbox's one condition guards its staging, marks and attempts together: an abort
decides on all three at once, and the transfer thread waits on it for staging room.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from phaselab.disagg.messages import TransferSpec


@dataclass
class KVLease:
    request_id: str
    block_ids: list[int] | None  # held blocks (ray-actor), None once copied out (ray-object-store)
    handle: Any
    expires_ns: int
    attempt: int = 0
    readers: int = 0
    ended: bool = False
    reason: str = ""


@dataclass
class StagedKV:
    spec: TransferSpec
    kv: Any  # torch.Tensor
    queued_ns: int
    start_ns: int
    end_ns: int
    num_bytes: int


class KVLeases:
    """Prefill side: the open leases by request id, under a lock of their own (read_kv runs on RPC threads)."""

    def __init__(self) -> None:
        self._leases: dict[str, KVLease] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, rid: object) -> bool:
        return rid in self._leases

    def add(self, lease: KVLease) -> None:
        with self._lock:
            self._leases[lease.request_id] = lease

    def pin(self, rid: str, attempt: int | None) -> KVLease | None:
        """The lease whose blocks a reader copies now (counted among its readers until unpin), or
        None when there are none to read (ended, copied out, or another attempt's)."""
        with self._lock:
            lease = self._leases.get(rid)
            if lease is not None and attempt is not None and lease.attempt != attempt:
                lease = None
            if lease is None or lease.ended or lease.block_ids is None:
                return None
            lease.readers += 1
            return lease

    def unpin(self, lease: KVLease) -> None:
        with self._lock:
            lease.readers -= 1

    def end(self, rid: str, reason: str, attempt: int | None = None) -> KVLease | None:
        """End the request's lease (that attempt's, when given). Returns it when it is gone (no
        reader: the caller frees its blocks); None when there is none, or while readers pin it
        (settled() names it once they are done)."""
        with self._lock:
            lease = self._leases.get(rid)
            if lease is None or (attempt is not None and lease.attempt != attempt):
                return None
            if not lease.ended:
                lease.ended, lease.reason = True, reason
            if lease.readers:
                return None
            del self._leases[rid]
            return lease

    def settled(self) -> list[str]:
        """Ended leases whose readers are done (to end again, now for good)."""
        with self._lock:
            return [rid for rid, lease in self._leases.items() if lease.ended and not lease.readers]

    def expired(self, now_ns: int) -> list[str]:
        with self._lock:
            return [rid for rid, lease in self._leases.items() if not lease.ended and now_ns > lease.expires_ns]


class KVInbox:
    """Decode side: transfers in the pipeline and staged KV; both sides: the newest attempt per request."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.staged: deque[StagedKV] = deque()
        self.staged_bytes = 0
        self.cancelled: set[tuple[str, int]] = set()  # (request, attempt) aborted on this decode worker
        self.in_transfer: set[tuple[str, int]] = set()  # admitted, not yet in the engine nor dropped
        self.attempts: dict[str, int] = {}  # the newest routing attempt seen per request

    def note_attempt(self, rid: str, attempt: int) -> None:
        with self.cv:
            self.attempts[rid] = max(attempt, self.attempts.get(rid, attempt))

    def forget(self, rid: str, attempt: int) -> None:
        """`attempt` of the request is over on this worker (finished, failed, aborted): forget it
        unless a newer attempt arrived meanwhile (else one entry per request, forever)."""
        with self.cv:
            if self.attempts.get(rid, attempt) <= attempt:
                self.attempts.pop(rid, None)

    def forget_request(self, rid: str) -> None:
        """The request is done here, whatever its attempt."""
        with self.cv:
            self.attempts.pop(rid, None)

    def current(self, request_ids: Iterable[str], attempt: int) -> list[str]:
        """The requests of which `attempt` is not stale (no newer one seen)."""
        with self.cv:
            return [rid for rid in request_ids if self.attempts.get(rid, attempt) <= attempt]

    def enter_transfer(self, key: tuple[str, int]) -> None:
        with self.cv:
            self.in_transfer.add(key)

    def cancel(self, request_ids: list[str], attempt: int) -> None:
        """Decode: mark these requests' `attempt` aborted while in the pipeline."""
        with self.cv:
            # only a transfer still in the pipeline needs the mark (it is dropped there, and its
            # mark with it); an abort that overtook its admit (Ray may reorder calls of a threaded
            # actor) is marked too, and such marks are bounded
            if len(self.cancelled) > 10_000:
                self.cancelled = {key for key in self.cancelled if key in self.in_transfer}
            self.cancelled.update((rid, attempt) for rid in request_ids
                                  if (rid, attempt) in self.in_transfer or self.attempts.get(rid, -1) < attempt)
            self.cv.notify_all()

    def is_cancelled(self, key: tuple[str, int]) -> bool:
        with self.cv:
            return key in self.cancelled

    def leave_transfer(self, key: tuple[str, int]) -> None:
        """Decode, under `cv`: a transfer left the pipeline (dropped, failed, or handed to the
        engine); a cancelled one is over here."""
        self.in_transfer.discard(key)
        if key in self.cancelled:
            self.cancelled.discard(key)
            rid, attempt = key
            if self.attempts.get(rid, attempt) <= attempt:
                self.attempts.pop(rid, None)

    def drop_transfer(self, key: tuple[str, int]) -> None:
        with self.cv:
            self.leave_transfer(key)
        self.forget(*key)

    def wait_for_room(self, key: tuple[str, int], num_bytes: int, max_bytes: int, stop: threading.Event) -> bool:
        """Transfer thread: wait until the KV fits the staging bound (or nothing is staged): beyond
        it the KV stays leased on the prefill side. False (it left the pipeline) when cancelled."""
        with self.cv:
            while (self.staged and self.staged_bytes + num_bytes > max_bytes
                   and key not in self.cancelled and not stop.is_set()):
                self.cv.wait(0.1)
            if key in self.cancelled:
                self.leave_transfer(key)
                return False
            return True

    def stage(self, st: StagedKV) -> bool:
        """Stage fetched KV; False (it left the pipeline) when it was cancelled during the fetch."""
        with self.cv:
            key = (st.spec.request_id, st.spec.attempt)
            if key in self.cancelled:
                self.leave_transfer(key)
                return False
            self.staged.append(st)
            self.staged_bytes += st.num_bytes
            return True

    def unstage(self, failed: bool = False) -> None:
        """The head of the staged KV leaves (admitted, or failed: its attempt is over)."""
        with self.cv:
            st = self.staged.popleft()
            self.staged_bytes -= st.num_bytes
            self.leave_transfer((st.spec.request_id, st.spec.attempt))
            self.cv.notify_all()
        if failed:
            self.forget(st.spec.request_id, st.spec.attempt)

    def drop_cancelled(self) -> None:
        """Drop the staged KV of cancelled attempts."""
        with self.cv:
            keep = []
            for st in self.staged:
                key = (st.spec.request_id, st.spec.attempt)
                if key in self.cancelled:
                    self.leave_transfer(key)
                else:
                    keep.append(st)
            self.staged = deque(keep)
            self.staged_bytes = sum(st.num_bytes for st in keep)
            self.cv.notify_all()
