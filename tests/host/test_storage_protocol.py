"""The storage protocol's defaults: a storage that implements only set/get/len/_empty works
with every buffer and writer, through the same read and write paths as the tensor storages."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from gpubuf.errors import SchemaMismatchError
from gpubuf.storages.base import Storage, WriteCursor


class DictStorage(Storage):
    """The smallest storage: items of one TensorDict per slot, nothing of the protocol overridden."""

    def __init__(self, max_size: int) -> None:
        super().__init__(max_size)
        self.items: dict[int, TensorDict] = {}
        self.sets = 0

    def set(self, cursor, data, *, set_cursor: bool = True) -> None:
        if isinstance(cursor, int):
            pairs = [(cursor, data)]
        else:
            rows = torch.as_tensor(cursor).tolist()
            pairs = list(zip(rows, data.unbind(0)))
        if "bad" in data.keys():
            raise SchemaMismatchError("this storage refuses the key 'bad'")
        self.sets += 1
        for row, item in pairs:
            self.items[row] = item.clone()

    def get(self, index):
        if isinstance(index, int):
            return self.items[index]
        return torch.stack([self.items[i] for i in torch.as_tensor(index).tolist()])

    def __len__(self) -> int:
        return len(self.items)

    def _empty(self) -> None:
        self.items.clear()


def _rows(start: int, n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(start, start + n, dtype=torch.float32).unsqueeze(-1)}, [n])


def test_the_defaults_write_round_robin_and_read_back():
    storage = DictStorage(5)
    rb = ReplayBuffer(storage=storage, batch_size=3, generator=torch.Generator().manual_seed(0))
    assert storage.layout is None and storage._write_state is None and storage._row_sources is None
    assert rb.extend(_rows(0, 4)).tolist() == [0, 1, 2, 3]
    assert rb.extend(_rows(4, 3)).tolist() == [4, 0, 1]  # wraps round the capacity
    assert rb.add(_rows(7, 1)[0]) == 2
    assert rb.write_count == 8 and rb.writer._cursor == 3
    assert [float(storage.items[i]["x"]) for i in range(5)] == [5.0, 6.0, 7.0, 3.0, 4.0]
    batch, info = rb.sample(return_info=True)
    assert torch.equal(batch["x"].squeeze(-1), torch.tensor([storage.items[i]["x"].item() for i in info["index"].tolist()]))


def test_a_rejected_batch_moves_no_cursor():
    storage = DictStorage(5)
    rb = ReplayBuffer(storage=storage)
    rb.extend(_rows(0, 2))
    with pytest.raises(SchemaMismatchError):
        rb.extend(TensorDict({"x": torch.zeros(3, 1), "bad": torch.zeros(3)}, [3]))
    cursor = rb.writer._state
    assert cursor.cursor == 2 and cursor.write_count == 2 and len(storage) == 2 and storage.sets == 1


def test_the_default_write_path_fills_the_index_entry():
    storage = DictStorage(4)
    rb = TensorDictReplayBuffer(storage=storage)
    data = _rows(0, 3)
    assert rb.extend(data).tolist() == [0, 1, 2]
    assert [int(storage.items[i]["index"]) for i in range(3)] == [0, 1, 2]
    rb.extend(_rows(3, 2))
    assert int(storage.items[0]["index"]) == 0 and int(storage.items[3]["index"]) == 3
    assert "index" not in data.keys()  # the caller's TensorDict is left as it was
    batch, info = rb.sample(6, return_info=True)
    assert torch.equal(batch["index"], info["index"])


@pytest.mark.parametrize(
    "make",
    [lambda tmp: DictStorage(6), lambda tmp: LazyTensorStorage(6), lambda tmp: LazyMemmapStorage(6, scratch_dir=tmp / "m")],
    ids=["defaults", "tensor", "memmap"],
)
def test_append_rows_reports_the_index_rows_it_wrote_and_extend_hands_them_back(make, tmp_path):
    """``_append_rows`` returns where the batch went and, with an index key, the rows it wrote
    into that column; extend returns those rows, which match the stored "index" column."""
    storage = make(tmp_path)
    appended = storage._append_rows(WriteCursor(), _rows(0, 2))
    assert appended.start == 0 and appended.rows is None  # no index column asked for
    # With an index key the data holds the rows written as that entry afterwards (the writer
    # relies on it and sets nothing more).
    other = make(tmp_path / "keyed")
    data = _rows(0, 3).set("index", torch.full((3,), -7))
    appended = other._append_rows(WriteCursor(), data, index_key=("index",))
    assert appended.rows.tolist() == [0, 1, 2] and torch.equal(data["index"], appended.rows)
    rb = TensorDictReplayBuffer(storage=make(tmp_path / "rb"))
    rb.extend(_rows(0, 4))
    index = rb.extend(_rows(4, 4))  # rows 4, 5, then 0, 1
    assert index.dtype == torch.long and index.tolist() == [4, 5, 0, 1]
    stored = [int(rb.storage.get(i)["index"]) for i in range(6)]
    assert stored == [0, 1, 2, 3, 4, 5]
    assert [float(rb.storage.get(i)["x"]) for i in (0, 1, 4, 5)] == [6.0, 7.0, 4.0, 5.0]


@pytest.mark.parametrize("make", [lambda tmp: LazyTensorStorage(6), lambda tmp: LazyMemmapStorage(6, scratch_dir=tmp / "m")],
                         ids=["tensor", "memmap"])
def test_writers_share_a_storage_s_cursor_only_when_it_declares_one(make, tmp_path):
    storage = make(tmp_path)
    first, second = ReplayBuffer(storage=storage), ReplayBuffer(storage=storage)
    first.extend(_rows(0, 4))
    shared = storage._write_state
    if shared is None:
        # Each writer keeps its own cursor: the second starts at row 0.
        assert isinstance(first.writer._state, WriteCursor) and first.writer._state is not second.writer._state
        assert second.extend(_rows(10, 1)).tolist() == [0]
    else:
        assert first.writer._state is shared and second.writer._state is shared
        assert second.extend(_rows(10, 1)).tolist() == [4]


def test_a_write_cursor_pickles_without_its_lock():
    import pickle

    cursor = WriteCursor()
    cursor.cursor, cursor.write_count = 3, 11
    copy = pickle.loads(pickle.dumps(cursor))
    assert (copy.cursor, copy.write_count) == (3, 11)
    with copy.lock:
        pass
