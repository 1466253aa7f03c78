"""Rate limiters: how many samples a buffer may serve per item inserted (Reverb's semantics).

A limiter keeps three counters: items inserted, items reserved for an insert in flight, and
items sampled. With ``spi = samples_per_insert`` and ``diff = inserted * spi - sampled``:

* an insert of ``n`` items is admitted when the buffer would still hold at most
  ``min_size_to_sample`` items afterwards, or when ``(inserted + reserved + n) * spi - sampled
  <= max_diff``;
* a sample of ``n`` items is admitted when the buffer holds at least ``min_size_to_sample``
  items and ``inserted * spi - sampled - n >= min_diff``.

So once the buffer has reached its minimum size, ``diff`` stays within ``[min_diff, max_diff]``:
samplers wait for writers and writers wait for samplers. Inserts are counted when they are
reserved (before the write) against ``max_diff`` and only once committed (after the write)
for sampling, so a sample is never admitted for rows that are not there yet.

The classes here are plain Python and thread-safe; :class:`RateLimiterHost` serves one to every
writer and sampler of a distributed buffer from an asyncio Ray actor, where waiting callers
cost no thread.

Progress: a writer extending ``n`` items at a time and samplers drawing ``B`` at a time can
always go on when ``max_diff - min_diff >= n * spi + B``; with a narrower buffer, both may wait
until their timeouts.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import threading
from typing import Any

from gpubuf.distributed._ray import get, require_ray
from gpubuf.errors import RateLimitTimeoutError


class RateLimiter:
    """Reverb's ``RateLimiter``: the ratio, the minimum size, and the band ``diff`` stays in.

    Args:
        samples_per_insert: samples served per item inserted, ``> 0``.
        min_size_to_sample: items the buffer must hold before any sample, ``>= 1``.
        min_diff: the lowest ``inserted * samples_per_insert - sampled`` a sample may leave.
        max_diff: the highest ``inserted * samples_per_insert - sampled`` an insert may leave.

    Raises:
        ValueError: a ratio that is not positive and finite, a minimum size below 1, or
            ``min_diff > max_diff``.
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float, max_diff: float) -> None:
        if isinstance(samples_per_insert, bool) or not isinstance(samples_per_insert, numbers.Real):
            raise ValueError(f"samples_per_insert must be a positive number, got {samples_per_insert!r}")
        if not (math.isfinite(samples_per_insert) and samples_per_insert > 0):
            raise ValueError(f"samples_per_insert must be positive and finite, got {samples_per_insert!r}")
        if (
            isinstance(min_size_to_sample, bool)
            or not isinstance(min_size_to_sample, numbers.Integral)
            or min_size_to_sample < 1
        ):
            raise ValueError(f"min_size_to_sample must be an integer >= 1, got {min_size_to_sample!r}")
        if math.isnan(min_diff) or math.isnan(max_diff) or min_diff > max_diff:
            raise ValueError(f"min_diff ({min_diff}) must not exceed max_diff ({max_diff})")
        self.samples_per_insert = float(samples_per_insert)
        self.min_size_to_sample = int(min_size_to_sample)
        self.min_diff = float(min_diff)
        self.max_diff = float(max_diff)

    def can_insert(self, size_after: int, inserted_after: int, sampled: int) -> bool:
        """Whether an insert may proceed: the buffer would hold ``size_after`` items and
        ``inserted_after`` would have been inserted (reservations included)."""
        if size_after <= self.min_size_to_sample:
            return True
        return inserted_after * self.samples_per_insert - sampled <= self.max_diff

    def can_sample(self, size: int, inserted: int, sampled: int, n: int) -> bool:
        """Whether ``n`` more items may be sampled from a buffer holding ``size`` of ``inserted``."""
        if size < self.min_size_to_sample:
            return False
        return inserted * self.samples_per_insert - sampled - n >= self.min_diff

    def config(self) -> dict[str, Any]:
        return {
            "samples_per_insert": self.samples_per_insert,
            "min_size_to_sample": self.min_size_to_sample,
            "min_diff": self.min_diff,
            "max_diff": self.max_diff,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.config().items())
        return f"{type(self).__name__}({fields})"


class SampleToInsertRatio(RateLimiter):
    """Reverb's ``SampleToInsertRatio``: keeps ``samples / inserts`` near ``samples_per_insert``.

    Args:
        samples_per_insert: the target number of samples per item inserted, ``> 0``.
        min_size_to_sample: items the buffer must hold before any sample, ``>= 1``.
        error_buffer: how far ``inserted * samples_per_insert - sampled`` may drift: a number
            ``e`` gives the band ``samples_per_insert * min_size_to_sample +/- e``; a pair
            ``(min_diff, max_diff)`` gives it directly. The band must be at least
            ``2 * max(1, samples_per_insert)`` wide, or single inserts and samples could block
            each other for good.

    Raises:
        ValueError: an invalid ratio or minimum size, or a band narrower than
            ``2 * max(1, samples_per_insert)``.

    Examples:
        >>> SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=1000, error_buffer=400.0)
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, error_buffer: Any) -> None:
        if isinstance(error_buffer, numbers.Real) and not isinstance(error_buffer, bool):
            if not error_buffer >= 0:
                raise ValueError(f"error_buffer must be >= 0, got {error_buffer!r}")
            offset = float(samples_per_insert) * int(min_size_to_sample) if isinstance(samples_per_insert, numbers.Real) else 0.0
            min_diff, max_diff = offset - float(error_buffer), offset + float(error_buffer)
        else:
            try:
                min_diff, max_diff = (float(v) for v in error_buffer)
            except (TypeError, ValueError):
                raise ValueError(
                    f"error_buffer must be a number or a (min_diff, max_diff) pair, got {error_buffer!r}"
                ) from None
        super().__init__(samples_per_insert, min_size_to_sample, min_diff, max_diff)
        if max_diff - min_diff < 2 * max(1.0, self.samples_per_insert):
            raise ValueError(
                f"the error buffer spans {max_diff - min_diff}, expected at least 2 * max(1, samples_per_insert) = "
                f"{2 * max(1.0, self.samples_per_insert)}: a narrower one can block inserts and samples for good"
            )
        self.error_buffer = error_buffer


class MinSize(RateLimiter):
    """Reverb's ``MinSize``: samples wait until the buffer holds ``min_size_to_sample`` items; inserts never wait."""

    def __init__(self, min_size_to_sample: int = 1) -> None:
        super().__init__(1.0, min_size_to_sample, -math.inf, math.inf)


class RateLimiterState:
    """The counters of one rate limiter, and its admission decisions. Thread-safe.

    Args:
        limiter: the rule (:class:`SampleToInsertRatio`, :class:`MinSize`, ...).
        capacity: the buffer's capacity, so that the size stops growing once it is full
            (writes then overwrite the oldest items); None for no bound.
    """

    def __init__(self, limiter: RateLimiter, capacity: int | None = None) -> None:
        self.limiter = limiter
        self.capacity = capacity
        self.inserted = 0
        self.reserved = 0
        self.sampled = 0
        self._lock = threading.Lock()

    def _size(self, inserted: int) -> int:
        return inserted if self.capacity is None else min(inserted, self.capacity)

    def snapshot(self) -> dict[str, int]:
        """The counters: ``inserted`` (written), ``reserved`` (inserts in flight), ``sampled``."""
        return {"inserted": self.inserted, "reserved": self.reserved, "sampled": self.sampled}

    def can_insert(self, n: int) -> bool:
        after = self.inserted + self.reserved + n
        return self.limiter.can_insert(self._size(after), after, self.sampled)

    def can_sample(self, n: int) -> bool:
        return self.limiter.can_sample(self._size(self.inserted), self.inserted, self.sampled, n)

    def try_reserve_insert(self, n: int) -> dict[str, int] | None:
        """Reserves room for ``n`` items if the limiter admits them now; returns the counters or None."""
        with self._lock:
            if not self.can_insert(n):
                return None
            self.reserved += n
            return self.snapshot()

    def commit_insert(self, n: int) -> None:
        """The ``n`` reserved items were written: they count as inserted."""
        with self._lock:
            self.reserved -= n
            self.inserted += n

    def cancel_insert(self, n: int) -> None:
        """The write of ``n`` reserved items failed: the reservation is dropped."""
        with self._lock:
            self.reserved -= n

    def try_sample(self, n: int) -> dict[str, int] | None:
        """Counts ``n`` samples if the limiter admits them now; returns the counters or None."""
        with self._lock:
            if not self.can_sample(n):
                return None
            self.sampled += n
            return self.snapshot()

    def reset(self) -> None:
        """Back to an empty buffer (after ``empty()``)."""
        with self._lock:
            self.inserted = self.reserved = self.sampled = 0


class RateLimiterHost:
    """A :class:`RateLimiterState` served to every writer and sampler from an asyncio Ray actor.

    Waiting calls are coroutines parked on one condition, woken by every change of the
    counters; a call that times out changes nothing.
    """

    def __init__(self, limiter: RateLimiter, capacity: int | None = None) -> None:
        self._state = RateLimiterState(limiter, capacity)
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        # Made on first use, inside the actor's event loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _wait_for(self, attempt: Any, timeout: float | None) -> dict[str, int] | None:
        changed = self._condition()
        async with changed:
            result = attempt()
            if result is not None or (timeout is not None and timeout <= 0):
                return result
            holder: list = []

            def admitted() -> bool:
                got = attempt()
                if got is not None:
                    holder.append(got)
                return got is not None

            try:
                await asyncio.wait_for(changed.wait_for(admitted), timeout)
            except asyncio.TimeoutError:
                return holder[-1] if holder else None
            # The reservation was made by the predicate that returned True, exactly once.
            return holder[-1]

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    async def reserve_insert(self, n: int, timeout: float | None = None) -> dict[str, int] | None:
        """Waits up to ``timeout`` seconds (None: for ever, 0: not at all) to reserve ``n`` inserts."""
        return await self._wait_for(lambda: self._state.try_reserve_insert(n), timeout)

    async def commit_insert(self, n: int) -> None:
        self._state.commit_insert(n)
        await self._notify()

    async def cancel_insert(self, n: int) -> None:
        self._state.cancel_insert(n)
        await self._notify()

    async def acquire_sample(self, n: int, timeout: float | None = None) -> dict[str, int] | None:
        """Waits up to ``timeout`` seconds (None: for ever, 0: not at all) to sample ``n`` items."""
        result = await self._wait_for(lambda: self._state.try_sample(n), timeout)
        if result is not None:
            await self._notify()
        return result

    async def can_insert(self, n: int) -> bool:
        return self._state.can_insert(n)

    async def can_sample(self, n: int) -> bool:
        return self._state.can_sample(n)

    async def snapshot(self) -> dict[str, int]:
        return self._state.snapshot()

    async def reset(self) -> None:
        self._state.reset()
        await self._notify()


def admit_sample(limiter: "LimiterHandle | None", n: int, wait: bool, timeout: float | None) -> None:
    """Admits a sample of ``n`` items through a buffer's ``limiter`` (see :meth:`LimiterHandle.acquire_sample`).

    Raises:
        ValueError: ``wait`` on a buffer without a rate limiter.
        RateLimitTimeoutError: the limiter did not admit the sample.
    """
    if limiter is not None:
        limiter.acquire_sample(n, wait, timeout)
    elif wait:
        raise ValueError(
            "sample(wait=True) waits on the buffer's rate limiter and this buffer has none: pass "
            "rate_limiter=MinSize(n) to wait for n items, or SampleToInsertRatio(...)"
        )


class LimiterHandle:
    """A caller's side of a :class:`RateLimiterHost` actor: blocking calls that raise typed errors.

    Picklable (it holds the actor handle), so writer and sampler tasks share one limiter.
    """

    def __init__(self, actor: Any, limiter: RateLimiter) -> None:
        self.actor = actor
        self.limiter = limiter

    @classmethod
    def start(cls, limiter: RateLimiter, capacity: int | None) -> "LimiterHandle":
        """Starts the limiter's actor (no CPU reserved: it only counts)."""
        if not isinstance(limiter, RateLimiter):
            raise TypeError(
                f"rate_limiter must be a RateLimiter (SampleToInsertRatio, MinSize), got {type(limiter).__name__}"
            )
        ray = require_ray()
        actor = ray.remote(num_cpus=0)(RateLimiterHost).remote(limiter, capacity)
        return cls(actor, limiter)

    def reserve_insert(self, n: int, timeout: float | None) -> None:
        """Blocks until ``n`` inserts are admitted.

        Raises:
            RateLimitTimeoutError: not admitted within ``timeout`` seconds; nothing reserved.
        """
        if get(self.actor.reserve_insert.remote(n, timeout)) is None:
            raise RateLimitTimeoutError(
                f"the rate limiter did not admit an insert of {n} item(s) within {timeout} s ({self.limiter}; "
                f"counters {get(self.actor.snapshot.remote())}): samplers have not caught up"
            )

    def commit_insert(self, n: int) -> None:
        # Not waited for: calls from one caller reach the actor in order.
        self.actor.commit_insert.remote(n)

    def cancel_insert(self, n: int) -> None:
        self.actor.cancel_insert.remote(n)

    def acquire_sample(self, n: int, wait: bool, timeout: float | None) -> None:
        """Blocks (``wait``) until a sample of ``n`` items is admitted, or tries once.

        Raises:
            RateLimitTimeoutError: not admitted (within ``timeout`` seconds when ``wait``).
        """
        limit = timeout if wait else 0
        if get(self.actor.acquire_sample.remote(n, limit)) is None:
            when = f"within {timeout} s" if wait else "now (wait=False)"
            raise RateLimitTimeoutError(
                f"the rate limiter did not admit a sample of {n} item(s) {when} ({self.limiter}; counters "
                f"{get(self.actor.snapshot.remote())}): too few items inserted"
            )

    def can_sample(self, n: int) -> bool:
        return bool(get(self.actor.can_sample.remote(n)))

    def can_insert(self, n: int) -> bool:
        return bool(get(self.actor.can_insert.remote(n)))

    def snapshot(self) -> dict[str, int]:
        return get(self.actor.snapshot.remote())

    def reset(self) -> None:
        get(self.actor.reset.remote())

    def stop(self) -> None:
        ray = require_ray()
        try:
            ray.kill(self.actor, no_restart=True)
        except (ValueError, RuntimeError):  # already gone with its runtime
            pass
