import pytest

from hpcllm.files import atomic_write, durable_replace, partial_path


def test_atomic_write_replaces_text_and_bytes_and_leaves_no_partial(tmp_path):
    path = tmp_path / "latest"
    atomic_write(path, "step_00000001\n")
    atomic_write(path, "step_00000002\n")
    assert path.read_text() == "step_00000002\n"
    atomic_write(path, b"\x89PNG")
    assert path.read_bytes() == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_atomic_write_writes_text_as_utf8(tmp_path):
    atomic_write(tmp_path / "t.json", '{"Ġ": 1}')
    assert (tmp_path / "t.json").read_bytes() == '{"Ġ": 1}'.encode()


def test_failed_write_keeps_the_old_file_and_removes_the_partial(tmp_path):
    path = tmp_path / "manifest.json"
    atomic_write(path, "old")
    with pytest.raises(TypeError):
        atomic_write(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert not partial_path(path).exists()


def test_partial_is_hidden_and_swept_by_prepare(tmp_path):
    partial = partial_path(tmp_path / "train-00000.h5")
    assert partial.parent == tmp_path and partial.name.startswith(".train-00000.h5.partial-")
    assert list(tmp_path.glob(".*.partial-*")) == [] and partial.match(".*.partial-*")


def test_durable_replace_moves_a_folder(tmp_path):
    src = tmp_path / ".step.partial"
    src.mkdir()
    (src / "meta.json").write_text("{}")
    durable_replace(src, tmp_path / "step")
    assert (tmp_path / "step" / "meta.json").read_text() == "{}" and not src.exists()
