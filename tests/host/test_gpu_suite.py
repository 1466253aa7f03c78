"""The GPU suite script's arguments, and the commit it records for a copy without ``.git``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpubuf.tools.bench import environment

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "gpu_suite.sh"


def _run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env or None)


def test_without_a_stage_it_prints_its_usage_and_fails():
    done = _run()
    assert done.returncode == 2
    for stage in ("tests", "bench", "codec", "slice", "gather", "counts", "graph", "aot", "GPUBUF_GIT_SHA"):
        assert stage in done.stdout


def test_an_unknown_stage_fails_before_anything_runs(tmp_path):
    done = _run("bench", "bnech", OUT=str(tmp_path / "out"), PATH="/usr/bin:/bin")
    assert done.returncode == 2 and "unknown stage 'bnech'" in done.stderr
    assert not (tmp_path / "out").exists()


def test_git_sha_falls_back_to_the_named_commit_where_git_cannot_tell(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(environment.subprocess, "run", no_git)
    monkeypatch.delenv(environment.GIT_SHA_VARIABLE, raising=False)
    assert environment.git_sha() is None
    monkeypatch.setenv(environment.GIT_SHA_VARIABLE, "0123abcd")
    assert environment.git_sha() == "0123abcd"


def test_the_named_commit_wins_over_git(monkeypatch):
    """A copy sent to a GPU machine can carry a ``.git`` older than its files: the commit named by
    whoever sent it is the one measured."""
    monkeypatch.delenv(environment.GIT_SHA_VARIABLE, raising=False)
    from_git = environment.git_sha()
    monkeypatch.setenv(environment.GIT_SHA_VARIABLE, "0123abcd")
    assert environment.git_sha() == "0123abcd"
    monkeypatch.delenv(environment.GIT_SHA_VARIABLE)
    assert environment.git_sha() == from_git
