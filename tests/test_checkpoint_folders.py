"""Checkpoint folders on one rank: ``latest``, ``keep_last``, and loads of folders that are not complete checkpoints.

Run in the test process (world 1), so they are quick and ``make mutate`` sees them.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
from one_rank import one_rank  # noqa: F401  (fixture)

import paramfsm
import paramfsm.checkpoint as ck
from paramfsm.checkpoint import folders
from paramfsm.errors import ArgumentError, ParamFSMError
from paramfsm.testing.models import mlp


@pytest.fixture
def rt(one_rank):  # noqa: F811
    torch.manual_seed(0)
    runtime = paramfsm.shard(mlp(width=8, depth=2, d_in=4, d_out=3))
    yield runtime
    runtime.close()


def _bump(rt) -> None:
    """Change every shard, so each save holds different values."""
    with torch.no_grad():
        for shard in rt.shard_parameters():
            shard.add_(1.0)


def test_latest_is_the_newest_complete_checkpoint(rt, tmp_path):
    assert ck.latest(tmp_path) is None and ck.latest(tmp_path / "nothing-here") is None
    for name in ("step-9", "step-10", "step-2"):  # saved in this order: newest is step-2, not by name
        ck.save(rt, tmp_path / name)
    (tmp_path / "incomplete").mkdir()
    (tmp_path / "incomplete" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / ".step-3.staging-0").mkdir()  # an unfinished save is never a candidate
    (tmp_path / ".step-3.staging-0" / ".metadata").write_bytes((tmp_path / "step-2" / ".metadata").read_bytes())
    assert ck.latest(tmp_path) == tmp_path / "step-2"
    assert ck.latest(str(tmp_path)) == tmp_path / "step-2"


def test_keep_last_keeps_the_newest_checkpoints_paramfsm_saved(rt, tmp_path):
    (tmp_path / "notes").mkdir()  # not a checkpoint: never removed
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    for step in range(1, 5):
        ck.save(rt, tmp_path / f"step-{step}", keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["notes", "step-3", "step-4"]
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep me"
    ck.save(rt, tmp_path / "step-4", keep_last=1)  # saving over the newest keeps it, and only it
    assert sorted(os.listdir(tmp_path)) == ["notes", "step-4"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_keep_last_takes_a_whole_number_of_at_least_one(rt, tmp_path, bad):
    with pytest.raises(ArgumentError, match=re.escape(f"keep_last={bad!r}")):
        ck.save(rt, tmp_path / "ck", keep_last=bad)
    assert not os.listdir(tmp_path), "nothing is written before the arguments are checked"


def test_a_save_over_a_checkpoint_replaces_it_and_leaves_nothing_beside(rt, tmp_path):
    ck.save(rt, tmp_path / "ck")
    want = rt.full_state_dict()
    _bump(rt)
    (tmp_path / ".ck.staging-left-by-a-crash").mkdir()
    ck.save(rt, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"], "the next save cleans an unfinished save's staging folder"
    newer = rt.full_state_dict()
    ck.load(rt, tmp_path / "ck")
    got = rt.full_state_dict()
    assert all(torch.equal(got[k], newer[k]) and not torch.equal(got[k], want[k]) for k in want)


def test_a_save_never_replaces_a_folder_that_is_not_a_checkpoint(rt, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.csv").write_text("1,2\n")
    with pytest.raises(ParamFSMError, match=re.escape(f"'{tmp_path / 'mine'}' exists and is not a checkpoint")):
        ck.save(rt, tmp_path / "mine")
    assert os.listdir(tmp_path / "mine") == ["data.csv"] and sorted(os.listdir(tmp_path)) == ["mine"]


def _broken(tmp_path, rt, how: str):
    """A copy of a good checkpoint broken one way; returns its path."""
    good = tmp_path / "good"
    ck.save(rt, good)
    bad = tmp_path / how
    bad.mkdir()
    for file in good.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    data = next(p for p in bad.iterdir() if p.suffix == ".distcp")
    if how == "no-metadata":
        (bad / ".metadata").unlink()
    elif how == "no-data":
        data.unlink()
    elif how == "truncated":
        data.write_bytes(data.read_bytes()[:10])
    elif how == "garbled-metadata":
        (bad / ".metadata").write_bytes(b"not a pickle")
    return bad, data.name


@pytest.mark.parametrize("how, says", [
    ("no-metadata", "has no .metadata (DCP writes it last, so the save that made this folder did not finish"),
    ("no-data", "data file '{bad}/{data}' is missing (.metadata lists it)"),
    ("truncated", "data file '{bad}/{data}' is truncated: 10 bytes, .metadata needs"),
    ("garbled-metadata", "'{bad}/.metadata' cannot be read"),
])
def test_a_load_of_an_incomplete_folder_says_what_is_missing_and_changes_nothing(rt, tmp_path, how, says):
    bad, data = _broken(tmp_path, rt, how)
    before = rt.full_state_dict()
    _bump(rt)
    bumped = rt.full_state_dict()
    with pytest.raises(ParamFSMError, match=re.escape(says.format(bad=bad, data=data))) as caught:
        ck.load(rt, bad)
    assert "Nothing was loaded" in str(caught.value) and "(rank 0)" in str(caught.value)
    assert isinstance(caught.value, Exception)
    got = rt.full_state_dict()
    assert all(torch.equal(got[k], bumped[k]) for k in got), "a failed load changed the model"
    rt.model(torch.randn(2, 4))  # no values guard: nothing was written
    ck.load(rt, tmp_path / "good")
    got = rt.full_state_dict()
    assert all(torch.equal(got[k], before[k]) for k in got)


def test_a_load_of_a_missing_folder_names_the_unfinished_save_beside_it(rt, tmp_path):
    (tmp_path / ".ck.staging-1").mkdir()
    with pytest.raises(ParamFSMError, match=re.escape(
            f"'{tmp_path / 'ck'}' does not exist; .ck.staging-1 beside it is a save that did not finish "
            "(never loaded). Nothing was loaded")):
        ck.load(rt, tmp_path / "ck")


def test_a_missing_folder_whose_swap_was_interrupted_loads_the_checkpoint_moved_aside(rt, tmp_path):
    ck.save(rt, tmp_path / "ck")
    want = rt.full_state_dict()
    os.rename(tmp_path / "ck", tmp_path / ".ck.retired-1")  # the first of the two renames, then a crash
    _bump(rt)
    ck.load(rt, tmp_path / "ck")
    got = rt.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)
    ck.save(rt, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_the_two_rename_swap_replaces_a_checkpoint(rt, tmp_path, monkeypatch):
    monkeypatch.setattr(folders, "use_exchange", False)
    ck.save(rt, tmp_path / "ck")
    _bump(rt)
    want = rt.full_state_dict()
    ck.save(rt, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    _bump(rt)
    ck.load(rt, tmp_path / "ck")
    got = rt.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)


class _Killed(BaseException):
    """The process dies at a save's named point: nothing after it runs, no cleanup either."""


def _kill_at(point):
    def hook(reached):
        if reached == point:
            raise _Killed(point)
    return hook


@pytest.mark.parametrize("point", ["retired", "committed", "manifest_written"])
def test_latest_finds_what_load_finds_after_a_kill_inside_the_two_rename_swap(rt, tmp_path, monkeypatch, point):
    """A kill between the two renames leaves no ``step-2``, only ``.step-2.retired-<token>``: ``load`` reads it
    under its name, so ``latest`` must return it too (``--resume auto`` would otherwise start from step 0)."""
    monkeypatch.setattr(folders, "use_exchange", False)
    ck.save(rt, tmp_path / "step-1")
    _bump(rt)
    ck.save(rt, tmp_path / "step-2")
    want = rt.full_state_dict()
    _bump(rt)
    monkeypatch.setattr(folders, "fault_hook", _kill_at(point))
    with pytest.raises(_Killed):
        ck.save(rt, tmp_path / "step-2")
    monkeypatch.setattr(folders, "fault_hook", None)
    found = ck.latest(tmp_path)
    assert found == tmp_path / "step-2", (found, sorted(os.listdir(tmp_path)))
    if point != "committed":  # a kill after the second rename leaves the new checkpoint there
        _bump(rt)
        ck.load(rt, found)
        got = rt.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in got)
    ck.save(rt, tmp_path / "step-3", keep_last=1)  # the moved-aside checkpoint counts, and goes, like any other
    assert sorted(os.listdir(tmp_path)) == ["step-3"], "keep_last left the killed save's leftovers"


def test_extra_files_are_saved_inside_the_checkpoint_and_replaced_with_it(rt, tmp_path):
    ck.save(rt, tmp_path / "ck", extra_files={"meta.pt": b"first", "notes.txt": b"a"})
    assert (tmp_path / "ck" / "meta.pt").read_bytes() == b"first"
    assert (tmp_path / "ck" / "notes.txt").read_bytes() == b"a"
    ck.load(rt, tmp_path / "ck")  # the extra files do not disturb a load
    ck.save(rt, tmp_path / "ck", extra_files={"meta.pt": b"second"})
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert (tmp_path / "ck" / "meta.pt").read_bytes() == b"second"
    assert not (tmp_path / "ck" / "notes.txt").exists(), "the folder is the new save's, whole"


def test_a_failed_save_keeps_the_previous_extra_files(rt, tmp_path):
    ck.save(rt, tmp_path / "ck", extra_files={"meta.pt": b"first"})

    def fail(point):
        if point == "manifest_written":
            raise OSError(28, "No space left on device")

    folders.fault_hook = fail
    try:
        with pytest.raises(ParamFSMError, match="was not replaced"):
            ck.save(rt, tmp_path / "ck", extra_files={"meta.pt": b"second"})
    finally:
        folders.fault_hook = None
    assert (tmp_path / "ck" / "meta.pt").read_bytes() == b"first"
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.parametrize("files, error", [
    ({".metadata": b"x"}, ArgumentError), ({"paramfsm.json": b"x"}, ArgumentError),
    ({"__0_0.distcp": b"x"}, ArgumentError), ({"a/b": b"x"}, ArgumentError), ({".hidden": b"x"}, ArgumentError),
    ({"": b"x"}, ArgumentError), ({"meta.pt": "text"}, TypeError), ([("meta.pt", b"x")], TypeError),
])
def test_extra_files_are_checked_before_anything_is_written(rt, tmp_path, files, error):
    with pytest.raises(error, match="extra_files"):
        ck.save(rt, tmp_path / "ck", extra_files=files)
    assert not os.listdir(tmp_path)


def test_the_manifest_names_the_format_world_optimizer_layout_and_shapes(rt, tmp_path):
    before = time.time_ns()
    ck.save(rt, tmp_path / "ck", optimizer=torch.optim.SGD(rt.model.parameters(), lr=0.1))
    manifest = json.loads((tmp_path / "ck" / folders.MANIFEST).read_text())
    assert before <= manifest.pop("saved_ns") <= time.time_ns()
    shapes = {name: list(p.shape) for name, p in mlp(width=8, depth=2, d_in=4, d_out=3).named_parameters()}
    assert manifest == {"format": "paramfsm-checkpoint", "version": 1, "world": 1, "optimizer": True,
                        "layout": "model", "shapes": shapes}
    assert folders.read_manifest(tmp_path / "ck")["shapes"] == shapes


def test_two_folders_swap_in_one_step_where_the_system_can(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from-a").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "from-b").write_text("b")
    assert folders._exchange(tmp_path / "a", tmp_path / "b") is True
    assert os.listdir(tmp_path / "a") == ["from-b"] and os.listdir(tmp_path / "b") == ["from-a"]
    with pytest.raises(FileNotFoundError) as missing:
        folders._exchange(tmp_path / "a", tmp_path / "nowhere")
    assert (missing.value.errno, missing.value.strerror, missing.value.filename) == (
        2, os.strerror(2), str(tmp_path / "nowhere"))
    monkeypatch.setattr(folders, "use_exchange", False)
    assert folders._exchange(tmp_path / "a", tmp_path / "b") is False
    assert os.listdir(tmp_path / "a") == ["from-b"]  # nothing moved


def test_a_save_clears_what_earlier_saves_left_and_makes_missing_parents(rt, tmp_path):
    path = tmp_path / "runs" / "deep" / "ck"
    ck.save(rt, path)  # the parents are made
    left = [path.parent / f".ck.{kind}-old" for kind in ("staging", "removed", "retired")]
    for folder in left:
        folder.mkdir()
        (folder / "junk").write_text("x")
    ck.save(rt, path)
    assert sorted(os.listdir(path.parent)) == ["ck"], "a leftover of an unfinished save survived the next save"


def test_a_retired_checkpoint_is_kept_while_no_checkpoint_replaces_it(rt, tmp_path):
    """With no ``ck``, ``.ck.retired-*`` is the checkpoint a crash moved aside: it is put back, never removed."""
    ck.save(rt, tmp_path / "ck")
    os.rename(tmp_path / "ck", tmp_path / ".ck.retired-1")
    ck.save(rt, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_extra_files_refusals_say_what_was_wrong_word_for_word():
    assert folders.check_extra_files(None) == {}
    good = {"a.bin": b"x", "b.bin": bytearray(b"y"), "c.bin": memoryview(b"z")}
    assert folders.check_extra_files(good) == good
    with pytest.raises(TypeError) as info:
        folders.check_extra_files([("meta.pt", b"x")])
    assert str(info.value) == "paramfsm.checkpoint.save(extra_files=list): expected a dict of file name -> bytes"
    with pytest.raises(ArgumentError) as info:
        folders.check_extra_files({"__0_0.distcp": b"x"})
    assert str(info.value) == (
        "paramfsm.checkpoint.save(extra_files=...): '__0_0.distcp' is not a file name the checkpoint can hold (a "
        "plain name, not hidden, not paramfsm.json, .metadata or a DCP data file)")
    with pytest.raises(TypeError) as info:
        folders.check_extra_files({"meta.pt": "text"})
    assert str(info.value) == "paramfsm.checkpoint.save(extra_files=...): the value of 'meta.pt' is a str; expected bytes"


def test_what_a_folder_that_is_no_checkpoint_holds_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert folders.problem(empty).endswith("or it is not a checkpoint; it holds nothing)")
    full = tmp_path / "full"
    full.mkdir()
    for name in "gfedcba":
        (full / name).write_text(name)
    assert folders.problem(full).endswith("it holds ['a', 'b', 'c', 'd', 'e'])"), "the first five, sorted"
    (full / ".metadata").write_bytes(b"not a pickle")
    assert re.fullmatch(rf"'{re.escape(str(full / '.metadata'))}' cannot be read \([A-Z]\w+: .+\)",
                        folders.problem(full), re.S) and "NoneType" not in folders.problem(full)


def test_an_unfinished_save_written_in_place_is_replaced_and_a_file_is_not(rt, tmp_path):
    """A folder of only DCP's names (a save that wrote in place and was killed before ``.metadata``) is what
    earlier saves left: a save replaces it. A file of that name is never replaced."""
    old = tmp_path / "ck"
    old.mkdir()
    for name in ("__0_0.distcp", ".metadata.tmp", "__junk", "paramfsm.json"):
        (old / name).write_bytes(b"x")
    ck.save(rt, old)
    assert folders.problem(old) is None and not (old / "__junk").exists()
    plain = tmp_path / "notes"
    plain.write_text("mine")
    with pytest.raises(ParamFSMError) as info:
        ck.save(rt, plain)
    assert str(info.value).startswith(
        f"paramfsm.checkpoint.save: '{plain}' exists and is not a checkpoint (no .metadata); it is never replaced. "
        "What to do: save to a new or empty folder, or remove it")
    assert plain.read_text() == "mine"


def test_a_checkpoint_moved_aside_is_loaded_then_put_back_and_both_are_logged(rt, tmp_path, caplog):
    ck.save(rt, tmp_path / "ck")
    retired = tmp_path / ".ck.retired-1"
    os.rename(tmp_path / "ck", retired)
    with caplog.at_level("WARNING", logger="paramfsm.checkpoint.folders"):
        ck.load(rt, tmp_path / "ck")
        ck.save(rt, tmp_path / "ck")
    said = [r.getMessage() for r in caplog.records if r.name == "paramfsm.checkpoint.folders"]
    assert said == [f"loading {retired}: a save over {tmp_path / 'ck'} was interrupted before it finished",
                    f"restored {tmp_path / 'ck'} from {retired} (a save over it was interrupted)"]


def test_a_load_of_nothing_says_what_to_do_word_for_word(rt, tmp_path):
    with pytest.raises(ParamFSMError) as info:
        ck.load(rt, tmp_path / "ck")
    assert str(info.value) == (
        f"paramfsm.checkpoint.load: '{tmp_path / 'ck'}' does not exist. Nothing was loaded. What to do: load a complete "
        "checkpoint (paramfsm.checkpoint.latest(parent) finds the newest one) (rank 0)")


def test_a_kill_while_pruning_leaves_nothing_the_next_save_keeps(rt, tmp_path, monkeypatch):
    ck.save(rt, tmp_path / "step-1")
    ck.save(rt, tmp_path / "step-2")
    monkeypatch.setattr(folders, "fault_hook", _kill_at("pruning"))
    with pytest.raises(_Killed):
        ck.save(rt, tmp_path / "step-3", keep_last=1)
    monkeypatch.setattr(folders, "fault_hook", None)
    left = sorted(os.listdir(tmp_path))
    assert left[0].startswith(".step-1.removed-") and left[1:] == ["step-2", "step-3"], left
    ck.save(rt, tmp_path / "step-1")  # the name whose removal was cut short is saved again
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2", "step-3"]


def test_an_incomplete_staging_folder_is_never_committed(rt, tmp_path):
    ck.save(rt, tmp_path / "ck")
    before = sorted(os.listdir(tmp_path / "ck"))
    folders.staging(tmp_path / "ck", "t1").mkdir()  # the data never arrived
    with pytest.raises(ParamFSMError) as info:
        folders.commit(tmp_path / "ck", "t1")
    assert str(info.value).startswith(
        f"paramfsm.checkpoint.save to '{tmp_path / 'ck'}': the written checkpoint is incomplete ('"
        f"{folders.staging(tmp_path / 'ck', 't1')}' has no .metadata")
    assert str(info.value).endswith(f"; '{tmp_path / 'ck'}' was not replaced")
    assert sorted(os.listdir(tmp_path / "ck")) == before and folders.problem(tmp_path / "ck") is None


def test_a_save_logs_each_leftover_it_removes(rt, tmp_path, caplog):
    for leftover in (".ck.staging-1", ".ck.removed-2"):
        (tmp_path / leftover).mkdir()
    with caplog.at_level("INFO", logger="paramfsm.checkpoint.folders"):
        ck.save(rt, tmp_path / "ck")
    said = sorted(r.getMessage() for r in caplog.records if r.name == "paramfsm.checkpoint.folders")
    assert said == sorted(f"removing {tmp_path / name}, left by a save that did not finish"
                          for name in (".ck.staging-1", ".ck.removed-2"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_save_where_no_folder_can_be_made_says_so_and_writes_nothing(rt, tmp_path):
    (tmp_path / "file").write_text("mine")
    path = tmp_path / "file" / "ck"
    with pytest.raises(ParamFSMError) as info:
        ck.save(rt, path)
    assert re.fullmatch(
        re.escape(f"paramfsm.checkpoint.save: cannot create a folder beside '{path}' (") + r"[A-Z][^)]+" +
        re.escape(f"); nothing was written. What to do: check that '{path.parent}' is a writable folder with free "
                  "space (rank 0)"), str(info.value)), str(info.value)
    assert (tmp_path / "file").read_text() == "mine"
