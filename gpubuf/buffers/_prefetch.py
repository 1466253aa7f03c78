"""Prefetching batches: indices drawn in order in the caller's thread, reads run ahead.

``ReplayBuffer(prefetch=k)`` keeps up to ``k`` batches in flight beyond the one being returned.
What runs ahead is only the *read* (gather, cross-device copy, transforms): worker threads on
the host, a side CUDA stream on the GPU. The *draws* (the sampler's indices) happen in the thread
that calls :meth:`~gpubuf.ReplayBuffer.sample`, under the buffer's lock, in the order the batches
are returned. Hence the guarantee this module is built around:

    for the same generator seed, ``prefetch=k`` returns exactly the batches ``prefetch=None``
    returns, in the same order, writes included.

Writes (``add``, ``extend``, ``empty``, ``__setitem__``, loading state) call
:meth:`Prefetcher.invalidate` before they modify anything. Every batch drawn but not yet
returned is then dropped (its read is cancelled or its result discarded), and the draws it made
are undone: the sampler's attributes, and the buffer's generator when it has its own
(``generator=...``), are restored to what they were right after the last batch returned. The
next ``sample()`` therefore draws, from the written data, what it would have drawn without
prefetch. (With torch's default generator there is no rewinding: other code draws from it too.)

A sampler whose ``sample`` mutates tensors in place can define ``_prefetch_state()`` and
``_prefetch_restore(state)``; the default snapshot is a shallow copy of its ``__dict__``, right
for samplers that reassign their attributes (all of gpubuf's).

Priority updates do not invalidate prefetched batches (as in TorchRL): a prefetched batch's
indices come from the priorities as they were when it was drawn, at most ``k`` updates old.
"""

from __future__ import annotations

import collections
import itertools
from concurrent.futures import CancelledError, Executor
from dataclasses import dataclass
from typing import Any

__all__ = ["Prefetcher"]


@dataclass(eq=False)
class _Entry:
    """One drawn batch on its way to the caller."""

    seq: int
    batch_size: int
    index: Any
    info: dict
    state: Any  # the draw state right before this draw: where a rewind returns to
    ran_out: bool  # the sampler's ran_out right after this draw
    ready: Any = None  # CUDA event after the draw (the side stream waits on it), or None
    future: Any = None  # the read in a worker; None: read by the caller when it is handed out
    valid: bool = True


class Prefetcher:
    """The queue of drawn batches of one buffer.

    Args:
        depth: batches kept in flight beyond the one being returned (``prefetch``).
        executor: runs the reads (a thread pool of ``depth`` workers).

    Every method is called with the buffer; the buffer provides the hooks ``_lock``,
    ``_draw``, ``_mark_ready``, ``_produce``, ``_hand_out``, ``_draw_state`` and
    ``_restore_draw_state`` (see :class:`~gpubuf.ReplayBuffer`).
    """

    def __init__(self, depth: int, executor: Executor) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.depth = depth
        self._executor = executor
        self._queue: collections.deque[_Entry] = collections.deque()
        self._in_hand: set[_Entry] = set()  # taken off the queue, not yet returned
        self._next_seq = 0
        self._delivered = -1  # seq of the last batch returned (or that raised)

    def __len__(self) -> int:
        return len(self._queue)

    # -------------------------------------------------------------- drawing (caller's thread, lock held)
    def _draw(self, buffer: Any, batch_size: int, ahead: bool) -> _Entry:
        state = buffer._draw_state()
        try:
            index, info = buffer._draw(batch_size)
        except BaseException:
            if ahead:
                # Without prefetch this draw has not happened yet: leave no trace of it.
                buffer._restore_draw_state(state)
            raise
        seq = self._next_seq
        self._next_seq += 1
        ran_out = bool(buffer._sampler.ran_out)
        return _Entry(seq, batch_size, index, info, state, ran_out, buffer._mark_ready(prefetching=True))

    def _top_up(self, buffer: Any, batch_size: int) -> None:
        while len(self._queue) < self.depth:
            try:
                entry = self._draw(buffer, batch_size, ahead=True)
            except Exception:
                # The same draw is made again when this batch is due, and raises there.
                return
            entry.future = self._executor.submit(self._read, buffer, entry)
            self._queue.append(entry)

    # -------------------------------------------------------------- reading (worker threads)
    @staticmethod
    def _read(buffer: Any, entry: _Entry) -> Any:
        if not entry.valid:
            return None  # dropped by a write before the read started: nothing to do
        return buffer._produce(entry.index, entry.info, entry.batch_size, entry.ready, prefetching=True)

    # -------------------------------------------------------------- the caller
    def sample(self, buffer: Any, batch_size: int) -> tuple[Any, dict]:
        """The next batch and its info; draws ahead so that ``depth`` batches stay in flight.

        Raises:
            Whatever the draw or the read of this batch raises (an empty buffer, a bad batch size).
        """
        while True:
            with buffer._lock:
                if self._queue and self._queue[0].batch_size != batch_size:
                    # Batches of another size are not what a run without prefetch would return now.
                    self._invalidate_locked(buffer)
                if self._queue:
                    entry = self._queue.popleft()
                else:
                    entry = self._draw(buffer, batch_size, ahead=False)
                self._in_hand.add(entry)
                self._top_up(buffer, batch_size)
            try:
                if entry.future is None:
                    result = buffer._produce(entry.index, entry.info, batch_size, entry.ready, prefetching=True)
                else:
                    result = entry.future.result()
            except BaseException as err:
                with buffer._lock:
                    self._in_hand.discard(entry)
                    valid = entry.valid
                    if valid:
                        self._delivered = max(self._delivered, entry.seq)
                if valid and not isinstance(err, CancelledError):
                    raise
                continue
            with buffer._lock:
                self._in_hand.discard(entry)
                if not entry.valid:
                    continue  # a write landed since the draw: draw again, from the written data
                self._delivered = max(self._delivered, entry.seq)
            data, done = result
            # The sampler's flag as a run without prefetch would show it after this batch.
            try:
                buffer._sampler.ran_out = entry.ran_out
            except AttributeError:
                pass
            return buffer._hand_out(data, done), entry.info

    # -------------------------------------------------------------- writes
    def invalidate(self, buffer: Any) -> None:
        """Drops every batch drawn and not yet returned, and undoes its draws (see the module doc).

        Call with the buffer's lock held, before the write modifies anything.
        """
        self._invalidate_locked(buffer)

    def _invalidate_locked(self, buffer: Any) -> None:
        pending = [e for e in itertools.chain(self._in_hand, self._queue) if e.valid]
        self._queue.clear()
        if not pending:
            return
        for entry in pending:
            entry.valid = False
            if entry.future is not None:
                entry.future.cancel()  # a read not started yet never runs
        oldest = min(pending, key=lambda e: e.seq)
        # Rewind only when nothing after `oldest` was returned (several threads sampling at once
        # could have): then its state is exactly the state after the last batch returned.
        if oldest.seq == self._delivered + 1:
            buffer._restore_draw_state(oldest.state)
            self._next_seq = oldest.seq
