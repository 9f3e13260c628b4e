"""`hpcllm prepare` holds a lock on --out, and a prepare killed inside its swap leaves the whole
earlier dataset or the whole new one.

A prepare is killed at every file-system change of its swap in turn: the test forks, and the
forked prepare ends with ``os._exit`` (no clean-up runs, as under SIGKILL) just before its
k-th rename, link, unlink or rmdir.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import select
import shutil
import signal
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from datasets_fixtures import TEXTS, make_corpus, split_docs
from family_runs import cli

from hpcllm.datasets import inspection
from hpcllm.datasets import prepare as prepare_module
from hpcllm.datasets.prepare import PrepareOptions, prepare
from hpcllm.datasets.shards import MANIFEST, load_manifest
from hpcllm.datasets.tokenizer import byte_tokenizer, load_tokenizer, train_bpe
from hpcllm.errors import UserError
from hpcllm.folder_lock import LOCK

KILLED = 75  # the exit status of a forked prepare that was "killed"


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    # No thread pool of the tokenizers library in this process: the tests fork it.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # Flushing to disk guards against a node crash, which these tests do not make; it is most
    # of a tiny prepare's time.
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def _tokenizer_folder(folder: Path) -> Path:
    """Write a Hugging Face style tokenizer folder: tokenizer.json and tokenizer_config.json."""
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(train_bpe(iter(TEXTS), 300).spec)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def _expected(docs: list[str], val_fraction: float) -> dict[str, bytes]:
    return {
        split: "".join(d + "\n<|endoftext|>\n" for d in texts).encode()
        for split, texts in split_docs(docs, val_fraction).items()
    }


def _read_back(out: Path) -> tuple[dict, dict[str, bytes]]:
    """Return the manifest in ``out`` and its splits' text, read as a run would read them."""
    manifest = load_manifest(out)  # every named file there, the tokenizer's hash the manifest's
    text = {}
    for split in ("train", "val"):
        buf = io.BytesIO()
        inspection.dump(manifest, split, buf)  # each shard's header checked against it
        text[split] = buf.getvalue()
    return manifest.raw, text


def _only_the_dataset(out: Path) -> None:
    """Assert that ``out`` holds a manifest and the files it names, nothing else, and that no
    staging folder is left beside it."""
    raw = json.loads((out / MANIFEST).read_text())
    tokenizer = raw["tokenizer"]
    named = {tokenizer["file"], *([tokenizer["config_file"]] if "config_file" in tokenizer else [])}
    named |= {entry["file"] for split in raw["splits"].values() for entry in split}
    assert sorted(p.name for p in out.iterdir()) == sorted({MANIFEST, *named})
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


def _fork(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked copy of this process; return the copy's pid. It exits 0 when
    ``work`` returns, 1 when it raises."""
    pid = os.fork()
    if pid == 0:  # the copy: never returns into pytest
        code = 1
        try:
            work()
            code = 0
        except BaseException:
            os.write(2, traceback.format_exc().encode())
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _kill_inside_the_swap_at(step: int) -> None:
    """Make this process end, as a kill would, just before the ``step``-th file-system change
    (rename, link, unlink, rmdir) from the start of prepare's swap on."""
    swap = prepare_module._swap_in
    count = itertools.count(1)

    def killing(change: Callable) -> Callable:
        def changed(*args, **kwargs):
            if next(count) == step:
                os._exit(KILLED)
            return change(*args, **kwargs)

        return changed

    def killed_swap(stage: Path, out: Path) -> dict:
        for name in ("replace", "rename", "link", "unlink", "remove", "rmdir"):
            setattr(os, name, killing(getattr(os, name)))
        return swap(stage, out)

    prepare_module._swap_in = killed_swap


def _options(out: Path, inputs: list[str], tokenizer: str, val_fraction: float, shards: int):
    return PrepareOptions(
        out=out,
        inputs=tuple(inputs),
        tokenizer=tokenizer,
        val_fraction=val_fraction,
        shards=shards,
    )


def _no_links(*args, **kwargs):
    raise OSError(1, "Operation not permitted")


@pytest.mark.slow
@pytest.mark.parametrize(
    "before, after",
    [("folder", "byte"), ("byte", "folder"), ("byte-generation-names", "folder")],
)
def test_a_prepare_killed_anywhere_in_its_swap_leaves_one_whole_dataset(
    tmp_path, capsys, monkeypatch, before, after
):
    inputs, docs = make_corpus(tmp_path / "src")
    folder = str(_tokenizer_folder(tmp_path / "tok"))
    # The two datasets differ in tokenizer (one with a tokenizer_config.json), split and shards.
    old_fraction, new_fraction = 0.25, 0.5
    old_tokenizer = folder if before == "folder" else "byte"
    new_tokenizer = folder if after == "folder" else "byte"
    expected = {"old": _expected(docs, old_fraction), "new": _expected(docs, new_fraction)}
    sha = {
        when: (load_tokenizer(Path(name)) if name == folder else byte_tokenizer()).sha256
        for when, name in (("old", old_tokenizer), ("new", new_tokenizer))
    }
    earlier = tmp_path / "earlier" / "out"
    old = _options(earlier, inputs, old_tokenizer, old_fraction, 2)
    prepare(old, progress=False)
    if before == "byte-generation-names":  # as a file system without hard links leaves it
        with monkeypatch.context() as patch:
            patch.setattr(os, "link", _no_links)
            prepare(old, progress=False)
        assert load_manifest(earlier).tokenizer_path.name == "tokenizer.g1.json"
    outcomes = []
    for step in itertools.count(1):
        out = tmp_path / f"kill-{step}" / "out"
        shutil.copytree(earlier, out)
        new = _options(out, inputs, new_tokenizer, new_fraction, 1)

        def killed_prepare(step=step, new=new):
            _kill_inside_the_swap_at(step)
            prepare(new, progress=False)

        code = _exit_code(_fork(killed_prepare))
        assert code in (KILLED, 0), capsys.readouterr().err
        raw, text = _read_back(out)
        which = "old" if raw["val_fraction"] == old_fraction else "new"
        outcomes.append(which)
        assert text == expected[which]
        assert raw["tokenizer"]["sha256"] == sha[which]
        assert ("config_file" in raw["tokenizer"]) == (
            (old_tokenizer if which == "old" else new_tokenizer) == folder
        )
        if code == 0:  # not killed: the swap has fewer steps
            _only_the_dataset(out)
            break
        capsys.readouterr()
        # The next prepare takes the dead one's lock over, removes what it left, and leaves
        # the new dataset under its own names alone.
        again = prepare(new, progress=False)
        assert f"taking over the lock of {out} from pid" in capsys.readouterr().err
        _only_the_dataset(out)
        assert _read_back(out)[1] == expected["new"]
        assert again["tokenizer"]["file"] == "tokenizer.json"
        assert step < 100
    # Killed before the new manifest: the old dataset; after: the new one; never anything else.
    flip = outcomes.index("new")
    assert flip > 1 and outcomes == ["old"] * flip + ["new"] * (len(outcomes) - flip)


def test_without_hard_links_a_dataset_keeps_its_generation_names(tmp_path, monkeypatch):
    inputs, docs = make_corpus(tmp_path / "src")
    out = tmp_path / "out"
    prepare(_options(out, inputs, "byte", 0.0, 2), progress=False)
    with monkeypatch.context() as patch:
        patch.setattr(os, "link", _no_links)
        manifest = prepare(_options(out, inputs, "byte", 0.25, 1), progress=False)
    assert manifest["splits"]["train"][0]["file"] == "train-00000.g1.h5"
    assert manifest == json.loads((out / MANIFEST).read_text())
    _only_the_dataset(out)
    assert _read_back(out)[1] == _expected(docs, 0.25)
    again = prepare(_options(out, inputs, "byte", 0.5, 2), progress=False)  # back to own names
    assert [e["file"] for e in again["splits"]["train"]] == ["train-00000.h5", "train-00001.h5"]
    _only_the_dataset(out)
    assert _read_back(out)[1] == _expected(docs, 0.5)


def _wait_readable(fd: int, pid: int) -> None:
    if not select.select([fd], [], [], 120)[0]:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the first prepare never reached its swap")
    assert os.read(fd, 1) == b"1", "the first prepare ended before its swap"


@pytest.mark.slow
def test_a_second_prepare_on_the_same_out_is_refused_naming_the_first(tmp_path):
    inputs, docs = make_corpus(tmp_path / "src")
    out = tmp_path / "out"
    prepare(_options(out, inputs, "byte", 0.0, 1), progress=False)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()

    def first_prepare() -> None:  # waits, holding the lock, with its dataset staged
        swap = prepare_module._swap_in

        def waiting_swap(stage: Path, out: Path) -> dict:
            os.write(ready_w, b"1")
            os.read(go_r, 1)
            return swap(stage, out)

        prepare_module._swap_in = waiting_swap
        prepare(_options(out, inputs, "byte", 0.25, 2), progress=False)

    pid = _fork(first_prepare)
    try:
        _wait_readable(ready_r, pid)
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        assert json.loads(before[LOCK])["pid"] == pid
        # Meanwhile the folder reads as the earlier dataset; the lock file is none of it.
        assert _read_back(out)[1] == _expected(docs, 0.0)
        info = inspection.summary(load_manifest(out))
        assert LOCK not in str(info) and info["splits"]["train"]["files"] == ["train-00000.h5"]
        second = cli("prepare", "--input", *inputs, "--tokenizer", "byte", "--val-fraction",
                     "0.5", "--out", str(out), "--quiet", timeout=120)  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        assert second.stderr.startswith(
            f"hpcllm: error: {out} is in use by another prepare "
            f"(pid {pid} on {socket.gethostname()} since "
        )
        assert "; wait for it, or give this prepare another --out" in second.stderr
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert len(list(tmp_path.glob(".out.partial-*"))) == 1  # the first's; none of its own
    finally:
        os.write(go_w, b"1")
        code = _exit_code(pid)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
    assert code == 0
    # The first finished as if alone; the folder is its dataset, and the lock is gone.
    assert _read_back(out)[1] == _expected(docs, 0.25)
    _only_the_dataset(out)


def test_a_lock_of_a_dead_prepare_is_taken_over_and_a_folder_it_made_goes(tmp_path, capsys):
    inputs, docs = make_corpus(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"host": "n1", "pid": 1, "since": 0}))
    prepare(_options(out, inputs, "byte", 0.0, 1), progress=False)
    assert f"taking over the lock of {out} from pid 1 on n1" in capsys.readouterr().err
    _only_the_dataset(out)
    # A refused prepare leaves no folder of its own behind, nor a lock in one.
    with pytest.raises(UserError, match="does not exist"):
        prepare(_options(tmp_path / "new", inputs, "missing.json", 0.0, 1), progress=False)
    assert not (tmp_path / "new").exists()
