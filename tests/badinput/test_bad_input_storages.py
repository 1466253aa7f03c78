"""Hostile input at every public entry point of the buffers over stacked, packed, spill, encoded
and ensemble storages, the shared prioritized sampler and the slice samplers (see
``hostile_probe.py``): each case either raises a gpubuf error with the buffer exactly as it was
(a deep snapshot: length, cursor, write count, the whole state dict, every readable row), or is
accepted and leaves the buffer consistent (rows read back, a sample draws written rows, the
next valid write lands at the cursor).

The default run takes an evenly spread subset of each kind's cases (``CASES_PER_KIND``); ``-m
slow`` runs them all, as ``python tests/badinput/hostile_probe.py`` does.
"""

from __future__ import annotations

import pytest

import hostile_probe as probe

CASES_PER_KIND = 12

def _kinds() -> list:
    params = []
    for config, op in probe.kinds():
        params.append(pytest.param(config, op, id=f"{config.name}-{op}"))
    return params


def _spread(cases: list, count: int | None) -> list:
    if count is None or len(cases) <= count:
        return cases
    step = len(cases) / count
    return [cases[int(i * step)] for i in range(count)]


def _run(config, op, count):
    fill = 0 if op == "sample_empty" else None
    cases = _spread(probe.operations(config)[op](config.build(fill)), count)
    failures = []
    for label, call in cases:
        outcome, detail = probe.run_case(config, call, fill=fill, loaded=op in probe.LOADS)
        if outcome in probe.FAILURES:
            failures.append(f"{label}: {outcome}: {detail}")
    assert not failures, f"{len(failures)} of {len(cases)} cases of {config.name}.{op}:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize(("config", "op"), _kinds())
def test_hostile_input_never_changes_or_breaks_the_buffer(config, op):
    _run(config, op, CASES_PER_KIND)


@pytest.mark.slow
@pytest.mark.parametrize(("config", "op"), _kinds())
def test_hostile_input_every_case(config, op):
    _run(config, op, None)


_CONSTRUCTORS = probe.constructor_cases()
#: Constructions that are valid (lazily allocated capacities, unbounded lists, arguments TorchRL takes).
ACCEPTED = {
    "max_size=1099511627776", "max_size=None", "device='meta'", "scratch_dir under a file", "no members",
    "traj_key and end_key", "traj_key=5", "cache_values='a'",
}


@pytest.mark.parametrize(("cls", "label", "call"), _CONSTRUCTORS, ids=[f"{c}-{label}" for c, label, _ in _CONSTRUCTORS])
def test_constructors_refuse_what_cannot_work(cls, label, call):
    outcome, detail = probe.run_constructor(call)
    assert outcome not in probe.FAILURES, f"{cls}({label}): {detail}"
    if label not in ACCEPTED:
        assert outcome == "typed", f"{cls}({label}) was accepted"
