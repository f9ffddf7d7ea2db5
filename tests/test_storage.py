"""The storage seam's local side (store/storage.py): the contract the checkpoint code relies on, on a real directory."""

from __future__ import annotations

import os

import pytest

from opentau_cli.store.storage import LocalStorage

pytestmark = pytest.mark.quick


def test_a_local_storage_puts_gets_lists_sizes_and_deletes_keys(tmp_path):
    store = LocalStorage(tmp_path / "remote")
    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(3 << 20))
    store.put_file(src, "checkpoints/000010/model.safetensors")
    store.write_bytes("checkpoints/last", b"000010\n")

    assert store.list() == ["checkpoints/000010/model.safetensors", "checkpoints/last"]
    assert store.list("checkpoints/000010") == ["checkpoints/000010/model.safetensors"]
    assert store.list("checkpoints/000020") == []
    assert store.size("checkpoints/000010/model.safetensors") == 3 << 20
    assert store.size("checkpoints/000020/model.safetensors") is None
    assert store.read_bytes("checkpoints/last") == b"000010\n"
    store.get_file("checkpoints/000010/model.safetensors", tmp_path / "back" / "model.safetensors")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == src.read_bytes()

    store.delete(["checkpoints/000010/model.safetensors", "checkpoints/000099/missing"])
    assert store.list() == ["checkpoints/last"]
    with pytest.raises(FileNotFoundError):
        store.read_bytes("checkpoints/000010/model.safetensors")
    assert store.url == (tmp_path / "remote").resolve().as_uri()


def test_a_failed_write_leaves_the_old_content_and_no_temp_file(tmp_path):
    store = LocalStorage(tmp_path)
    store.write_bytes("checkpoints/last", b"000010\n")

    class Broken:
        def read(self, *_):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        store._replace("checkpoints/last", lambda f: f.write(Broken().read()))
    assert store.read_bytes("checkpoints/last") == b"000010\n"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last"]


@pytest.mark.parametrize("key", ["", "/", "../outside", "checkpoints/../../x", "a/./b"])
def test_a_key_that_leaves_the_root_is_refused(tmp_path, key):
    with pytest.raises(ValueError):
        LocalStorage(tmp_path).write_bytes(key, b"x")
