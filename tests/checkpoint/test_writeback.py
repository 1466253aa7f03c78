"""Write-back started chunk by chunk while a dump writes: bounded, and advice only."""

from __future__ import annotations

import os

from gpubuf.checkpoint import writeback
from gpubuf.checkpoint.writeback import IN_FLIGHT, Writeback


def test_at_most_in_flight_chunks_are_left_unwaited(tmp_path):
    fd = os.open(tmp_path / "f.bin", os.O_WRONLY | os.O_CREAT)
    try:
        wb = Writeback(fd)
        chunk = b"x" * 4096
        for i in range(IN_FLIGHT + 4):
            os.write(fd, chunk)
            wb.written(i * len(chunk), len(chunk))
            if writeback._function() is not None:
                assert len(wb._in_flight) == min(i + 1, IN_FLIGHT)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    assert (tmp_path / "f.bin").read_bytes() == b"x" * 4096 * (IN_FLIGHT + 4)


def test_a_file_that_refuses_turns_it_off_without_raising():
    read, write = os.pipe()  # sync_file_range refuses a pipe (ESPIPE)
    try:
        wb = Writeback(write)
        os.write(write, b"abc")
        wb.written(0, 3)
        wb.written(3, 3)
        assert wb._fn is None
    finally:
        os.close(read)
        os.close(write)
