"""An error one rank meets is raised on every rank within seconds (2 gloo ranks).

Each entry point is made to fail on rank 1 only, as a full disk, an unwritable folder or a missing file fails
on one machine: ``shard()`` whose offload folder rank 1 cannot create, ``rt.full_state_dict()`` whose page-in of one offloaded shard fails on
rank 1, ``load_pretrained`` of a folder only
rank 0 has, ``rt.init_weights(fn)`` whose ``fn`` raises on one rank's module, and a ``rt.gathered()`` block
that raises on one rank. Before, rank 1 raised alone and rank 0 went on into its next collective, which waited for the
collective timeout (see [Note: an error one rank meets] in ``paramfsm.sharding.rank_errors``). The first optimizer step
whose disk is full on one rank is ``tests/test_offload_full_disk.py``.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import paramfsm
from paramfsm.errors import OffloadError, ParamFSMError
from paramfsm.testing.models import mlp


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2

#: Every rank must raise this soon; the collective timeout of the ranks' next collective is far longer.
WITHIN_S = 30


def _next_collective(rank):
    """What every rank does next after the call: a collective, which a rank left behind would wait in."""
    flag = torch.ones(1)
    dist.all_reduce(flag, group=dist.new_group(timeout=datetime.timedelta(seconds=120)))


def shard_job(rank, world, folder):
    torch.manual_seed(0)
    model = mlp(width=16, depth=3, d_in=8, d_out=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = os.path.join(folder, f"rank{rank}")
    if rank == 1:
        open(path, "w").close()  # a file where the folder should be: rank 1 cannot create its tier there
    start = time.monotonic()
    try:
        paramfsm.shard(model, offload=paramfsm.Offload(optimizer="disk", path=path))
        outcome = "no error"
    except ParamFSMError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    _next_collective(rank)
    kept = all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    rt = paramfsm.shard(model)  # the model can be sharded again
    rt.close()
    return outcome, seconds, kept


def test_shard_refused_by_one_ranks_offload_folder_raises_on_every_rank(ranks2, tmp_path):
    for rank, (outcome, seconds, kept) in enumerate(ranks2.run(shard_job, str(tmp_path), timeout=120)):
        assert outcome.startswith("OffloadError: "), (rank, outcome)
        assert "rank 1" in outcome and "offload" in outcome, (rank, outcome)
        assert seconds < WITHIN_S, (rank, seconds)
        assert kept, f"rank {rank}: the refused shard() changed the model"


def load_job(rank, world, root):
    from paramfsm.integrations.hf import load_pretrained

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(transformers))
    rt = paramfsm.shard(model)
    start = time.monotonic()
    try:
        load_pretrained(rt, os.path.join(root, "only-rank0" if rank == 0 else "missing"))
        outcome = "no error"
    except ParamFSMError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    _next_collective(rank)
    rt.close()
    return outcome, seconds


def _config(transformers):
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, vocab_size=31,
                                    max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def test_load_pretrained_of_a_folder_one_rank_lacks_raises_on_every_rank(ranks2, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config(transformers)).save_pretrained(tmp_path / "only-rank0")
    for rank, (outcome, seconds) in enumerate(ranks2.run(load_job, str(tmp_path), timeout=120)):
        assert outcome.startswith("ParamFSMError: ") and "rank 1" in outcome and "model.safetensors" in outcome, \
            (rank, outcome)
        assert seconds < WITHIN_S, (rank, seconds)


def init_job(rank, world):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = mlp(width=16, depth=3, d_in=8, d_out=4)
    rt = paramfsm.shard(model)

    def init(module):
        if isinstance(module, torch.nn.Linear):
            if rank == 1 and module is model[2]:
                raise ValueError("no initialiser for this layer on rank 1")
            torch.nn.init.normal_(module.weight)
            torch.nn.init.zeros_(module.bias)

    start = time.monotonic()
    try:
        rt.init_weights(init)
        outcome = "no error"
    except (ParamFSMError, ValueError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    _next_collective(rank)
    try:
        model(torch.ones(2, 8))
        guarded = "no error"
    except ParamFSMError as exc:
        guarded = str(exc)
    rt.init_weights(lambda m: (torch.nn.init.normal_(m.weight), torch.nn.init.zeros_(m.bias))
                    if isinstance(m, torch.nn.Linear) else None)
    trained = model(torch.ones(2, 8)).sum().item()
    rt.close()
    return outcome, seconds, guarded, trained


def test_init_weights_whose_fn_fails_on_one_rank_raises_on_every_rank(ranks2):
    for rank, (outcome, seconds, guarded, trained) in enumerate(ranks2.run(init_job, timeout=120)):
        want = "ValueError: no initialiser" if rank == 1 else "ParamFSMError: rt.init_weights (module '2') failed on rank 1"
        assert outcome.startswith(want), (rank, outcome)
        assert seconds < WITHIN_S, (rank, seconds)
        assert "rt.init_weights failed part-way" in guarded, (rank, guarded)  # a half-initialised model never runs
        assert trained == trained, "a second init_weights makes the model usable"


def gathered_job(rank, world):
    torch.manual_seed(0)
    model = mlp(width=16, depth=3, d_in=8, d_out=4)
    rt = paramfsm.shard(model)
    before = rt.full_state_dict()
    start = time.monotonic()
    try:
        with torch.no_grad(), rt.gathered():
            model[0].weight.mul_(2.0)  # every rank writes the same, then rank 1 meets an error
            if rank == 1:
                raise ValueError("a bad value on rank 1")
        outcome = "no error"
    except (ParamFSMError, ValueError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    _next_collective(rank)
    after = rt.full_state_dict()
    rt.close()
    return outcome, seconds, all(torch.equal(after[k], v) for k, v in before.items())


def test_an_error_inside_gathered_on_one_rank_raises_on_every_rank_and_writes_nothing(ranks2):
    for rank, (outcome, seconds, kept) in enumerate(ranks2.run(gathered_job, timeout=120)):
        want = "ValueError: a bad value" if rank == 1 else "ParamFSMError: rt.gathered(): the block raised on rank 1"
        assert outcome.startswith(want), (rank, outcome)
        assert seconds < WITHIN_S, (rank, seconds)
        assert kept, f"rank {rank}: a write-back happened after the block raised on a rank"


#: The ranks whose tier fails now (a rank's own disk): read on the calling thread's rank, which in process is
#: the rank's own (its page-in and page-out threads included, ``gloo_ranks.py``).
FAILING: set = set()


def _failing_tier(monkeypatch, what: str, owner_name: str = "2.weight"):
    """Make ``DiskTier.<what>`` fail for ``owner_name`` on the ranks in :data:`FAILING`, as one machine's disk."""
    from paramfsm.engine.storage import tiers

    real = getattr(tiers.DiskTier, what)

    def failing(self, slot, *args):
        if args[-1] == owner_name and dist.get_rank() in FAILING:
            raise self._io_error(owner_name, what, slot.nbytes, OSError(5, "Input/output error"))
        return real(self, slot, *args)

    monkeypatch.setattr(tiers.DiskTier, what, failing)
    FAILING.clear()


def full_state_job(rank, world, folder, rank0_only):
    torch.manual_seed(0)
    model = mlp(width=16, depth=3, d_in=8, d_out=4)
    rt = paramfsm.shard(model, offload=paramfsm.Offload(params="disk", path=os.path.join(folder, f"rank{rank}")))
    if rank == 1:
        FAILING.add(rank)  # rank 1's disk cannot give back one shard
    start = time.monotonic()
    try:
        rt.full_state_dict(rank0_only=rank0_only)
        outcome = "no error"
    except ParamFSMError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        FAILING.discard(rank)
    seconds = time.monotonic() - start
    _next_collective(rank)
    return outcome, seconds


@pytest.mark.parametrize("rank0_only", [False, True])
def test_full_state_dict_whose_page_in_fails_on_one_rank_raises_on_every_rank(ranks2, tmp_path, rank0_only,
                                                                               monkeypatch):
    _failing_tier(monkeypatch, "read")
    for rank, (outcome, seconds) in enumerate(ranks2.run(full_state_job, str(tmp_path), rank0_only, timeout=120)):
        want = "OffloadError: could not read" if rank == 1 else \
            "OffloadError: rt.full_state_dict() failed on rank 1"
        assert outcome.startswith(want), (rank, outcome)
        assert "'2.weight'" in outcome, (rank, outcome)
        assert seconds < WITHIN_S, (rank, seconds)


def later_step_job(rank, world, folder):
    torch.manual_seed(0)
    model = mlp(width=16, depth=3, d_in=8, d_out=4)
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="disk", path=os.path.join(folder, f"rank{rank}")))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    outcomes = []
    for step in range(2):
        model(torch.ones(2, 8)).sum().backward()
        if rank == 1 and step == 1:
            FAILING.add(rank)  # rank 1's disk fails in its second step, after the first
        start = time.monotonic()
        try:
            opt.step()
            outcomes.append(("no error", 0.0))
        except ParamFSMError as exc:
            outcomes.append((f"{type(exc).__name__}: {exc}\n{getattr(exc, '__notes__', [])}", time.monotonic() - start))
        finally:
            FAILING.discard(rank)
        opt.zero_grad()
    _next_collective(rank)
    return outcomes


def test_a_later_offloaded_step_that_fails_on_one_rank_raises_on_every_rank(ranks2, tmp_path, monkeypatch):
    _failing_tier(monkeypatch, "write")
    for rank, outcomes in enumerate(ranks2.run(later_step_job, str(tmp_path), timeout=120)):
        assert outcomes[0] == ("no error", 0.0), (rank, outcomes)
        outcome, seconds = outcomes[1]
        want = "OffloadError: could not write" if rank == 1 else \
            "OffloadError: the offloaded optimizer step failed on rank 1"
        assert outcome.startswith(want), (rank, outcome)
        assert "'2.weight'" in outcome and "load the last checkpoint" in outcome, (rank, outcome)
        if rank == 0:  # what the ranks that finished did, and what to do, word for word
            assert ("The ranks that finished the step stepped every unit and the failed rank did not, so the "
                    "parameters now differ between ranks. What to do: fix the cause, then load the last checkpoint "
                    "(paramfsm.checkpoint.load) before training on.") in outcome, outcome
        assert seconds < WITHIN_S, (rank, seconds)


def test_a_failing_rank_raises_its_own_error_and_the_others_its_class():
    from paramfsm.sharding.rank_errors import agreed

    with pytest.raises(OffloadError, match="disk full"):
        with agreed(None, "a step"):
            raise OffloadError("disk full")
