"""Offload files a run leaves behind when it is killed are removed; a live run's never are.

A disk tier's file holds a lock for its owner's life (see [Note: an offload file's owner] in
``paramfsm.engine.storage.tier_files``). A process killed with a reserved file leaves it at its full size; the
next disk tier opened in that folder removes it, and so does ``paramfsm offload clean PATH``, while a file
another live process holds stays.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from paramfsm import cli
from paramfsm.engine.storage.tiers import DiskTier

#: A process that opens a disk tier, reserves 1 MiB in it, and then dies (``os._exit``: no cleanup at all) or
#: waits until its stdin closes (a live run).
OWNER = textwrap.dedent("""\
    import os, sys, torch
    from paramfsm.engine.storage.tiers import DiskTier
    tier = DiskTier(sys.argv[1], rank=0)
    tier.place("w", torch.zeros(1 << 18), "w")
    print(tier.path, flush=True)
    if sys.argv[2] == "die":
        os._exit(9)
    sys.stdin.read()
    tier.close()
""")


def _owner(folder, how):
    return subprocess.Popen([sys.executable, "-c", OWNER, str(folder), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


@pytest.fixture
def killed_and_live(tmp_path):
    """The file of a killed run and the file of a live one, in one folder."""
    live = _owner(tmp_path, "live")  # first: a tier opened after the killed run's death would remove its file
    live_file = live.stdout.readline().strip()
    killed = _owner(tmp_path, "die")
    dead_file = killed.stdout.readline().strip()
    killed.wait(timeout=60)
    assert os.path.getsize(dead_file) >= 1 << 20 and os.path.exists(live_file)
    yield dead_file, live_file
    live.communicate("", timeout=60)
    assert not os.path.exists(live_file), "the live run removes its own file when it closes"


def test_a_new_disk_tier_removes_the_files_of_killed_runs_and_keeps_live_ones(tmp_path, killed_and_live, caplog):
    dead_file, live_file = killed_and_live
    tier = DiskTier(tmp_path, rank=1)
    try:
        assert not os.path.exists(dead_file), "the killed run's file is still there"
        assert os.path.exists(live_file) and os.path.exists(tier.path)
        assert "removed 1 offload file(s)" in caplog.text and str(tmp_path) in caplog.text
        slot = tier.place("x", torch.arange(4.0), "x")  # this tier works as ever
        tier.write(slot, torch.arange(4.0), 1, "x")
        out = torch.empty(4)
        tier.read(slot, out, "x")
        assert torch.equal(out, torch.arange(4.0))
    finally:
        tier.close()


def test_offload_clean_removes_the_files_of_killed_runs_and_keeps_live_ones(tmp_path, killed_and_live, capsys):
    dead_file, live_file = killed_and_live
    (tmp_path / "notes.txt").write_text("not ours")
    assert cli.main(["offload", "clean", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"removed {dead_file}" in out and live_file not in out, out
    assert int(out.strip().splitlines()[-1].split()[0]) >= 1 << 20, out
    assert not os.path.exists(dead_file) and os.path.exists(live_file)
    assert (tmp_path / "notes.txt").read_text() == "not ours"


def test_offload_clean_of_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["offload", "clean", str(tmp_path / "nowhere")]) == 2
    assert "not a folder" in capsys.readouterr().err
