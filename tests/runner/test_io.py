"""Atomic writes: the destination is named whatever step fails, and nothing torn or temporary is left."""

from __future__ import annotations

import errno
import stat

import pytest

from specsamp.io import atomic_write, torch_save_atomic, write_json_atomic


def _leftovers(d):
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_a_full_disk_hidden_in_a_runtime_error_names_the_destination(tmp_path):
    dest = tmp_path / "result.json"
    dest.write_text("old")

    def write(f):  # torch.save reports a full disk as RuntimeError(...) from OSError(ENOSPC)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("PytorchStreamWriter failed writing file data") from e

    with pytest.raises(OSError) as info:
        atomic_write(dest, write)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(dest)
    assert dest.read_text() == "old" and not _leftovers(tmp_path)


def test_other_errors_pass_unchanged_and_leave_nothing(tmp_path):
    dest = tmp_path / "x.bin"
    with pytest.raises(ValueError, match="not storage"):
        atomic_write(dest, lambda f: (_ for _ in ()).throw(ValueError("not storage")))
    with pytest.raises(KeyboardInterrupt):
        atomic_write(dest, lambda f: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert not dest.exists() and not _leftovers(tmp_path)


def test_an_uncreatable_directory_names_the_destination(tmp_path):
    (tmp_path / "file").write_text("")
    dest = tmp_path / "file" / "sub" / "result.json"  # a parent is a regular file
    with pytest.raises(OSError) as info:
        write_json_atomic(dest, {"a": 1})
    assert info.value.filename == str(dest)


def test_written_files_are_complete(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    torch_save_atomic(tmp_path / "t.pt", [1, 2])
    for name in ("r.json", "t.pt"):
        mode = (tmp_path / name).stat().st_mode
        assert mode & stat.S_IRUSR and (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "r.json").read_text().startswith("{")
