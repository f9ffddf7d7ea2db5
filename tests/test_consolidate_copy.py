"""The safetensors writer's file-to-file copies (what consolidation uses for weights kept in their source dtype): the
bytes read back by safetensors' own reader equal the source file's bytes; a filesystem that refuses the copy, or a
source cut short, gets the produced tensor instead (whose read says what is wrong), and a failure leaves nothing."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opentau_cli.store.safetensors_writer import FileSpan, TensorEntry, write_safetensors

pytestmark = pytest.mark.quick

SHM = Path("/dev/shm")  # tmpfs: another filesystem than the test's tmp_path, so copy_file_range refuses (EXDEV)


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "source.bin"
    path.write_bytes(os.urandom(4096))
    return path


def _expected(source: Path, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    return torch.frombuffer(bytearray(source.read_bytes()[offset:offset + nbytes]), dtype=dtype).reshape(shape)


def _entries(source: Path, produced: list[str]) -> list[TensorEntry]:
    """A fp32 tensor from two ranges of the source, a produced int64 tensor, a bf16 tensor from one range; a copied
    entry's produce() records that it was called and returns the same bytes read independently."""

    def fallback(name, spans, dtype, shape):
        def produce():
            produced.append(name)
            return torch.cat([_expected(source, s.offset, s.nbytes, torch.uint8, (s.nbytes,)) for s in spans]).view(dtype).reshape(shape)
        return produce

    a_spans = [FileSpan(source, 100, 24), FileSpan(source, 1000, 36)]  # 15 fp32 values across two ranges
    c_spans = [FileSpan(source, 2050, 16)]
    return [
        TensorEntry("a", (3, 5), torch.float32, fallback("a", a_spans, torch.float32, (3, 5)), a_spans),
        TensorEntry("b", (4,), torch.int64, lambda: torch.arange(4)),
        TensorEntry("c", (2, 4), torch.bfloat16, fallback("c", c_spans, torch.bfloat16, (2, 4)), c_spans),
    ]


def _check(out: Path, source: Path) -> None:
    got = load_file(out)
    assert sorted(got) == ["a", "b", "c"]
    raw = source.read_bytes()
    assert got["a"].view(torch.uint8).reshape(-1).numpy().tobytes() == raw[100:124] + raw[1000:1036]
    assert torch.equal(got["b"], torch.tensor([0, 1, 2, 3]))
    assert got["c"].dtype == torch.bfloat16 and got["c"].view(torch.uint8).reshape(-1).numpy().tobytes() == raw[2050:2066]


def test_spans_are_copied_file_to_file_without_producing_the_tensor_and_read_back_equal(tmp_path, source):
    produced: list[str] = []
    out = write_safetensors(tmp_path / "out.safetensors", _entries(source, produced))
    assert produced == []  # copied by the kernel, never materialised here
    _check(out, source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "source.bin"]


def test_on_a_filesystem_that_refuses_the_copy_the_tensors_are_produced_and_the_file_is_the_same(tmp_path, source):
    shm = Path(tempfile.mkdtemp(dir=SHM))
    try:
        assert os.stat(shm).st_dev != os.stat(source).st_dev
        produced: list[str] = []
        out = write_safetensors(shm / "out.safetensors", _entries(source, produced))
        assert produced == ["a", "c"]
        _check(out, source)
        same = write_safetensors(tmp_path / "same.safetensors", _entries(source, []))
        assert out.read_bytes() == same.read_bytes()
        assert sorted(p.name for p in shm.iterdir()) == ["out.safetensors"]
    finally:
        for p in shm.iterdir():
            p.unlink()
        shm.rmdir()


def test_a_source_that_ends_before_its_span_is_produced_instead_and_its_read_error_leaves_nothing(tmp_path, source):
    """copy_file_range copies nothing past the end of a file: the tensor is then produced, and its own read reports
    what is wrong (for a shard: "truncated", tests/test_consolidate.py)."""
    calls = []

    def produce():
        calls.append("a")
        raise OSError(5, "the read found the file cut short")

    entries = [TensorEntry("a", (8,), torch.float32, produce, [FileSpan(source, 4080, 32)])]
    with pytest.raises(OSError, match="cut short"):
        write_safetensors(tmp_path / "out.safetensors", entries)
    assert calls == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source.bin"]


def test_spans_that_do_not_make_the_tensor_are_refused_and_leave_nothing(tmp_path, source):
    entries = [TensorEntry("a", (8,), torch.float32, lambda: torch.zeros(8), [FileSpan(source, 0, 28)])]
    with pytest.raises(ValueError, match="spans hold 28 bytes, planned 32"):
        write_safetensors(tmp_path / "out.safetensors", entries)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source.bin"]
