"""Memory held for retained graphs, on 2 gloo ranks, compared with plain torch.

Extends ``test_runtime.py``'s single flush / single dropped graph: flushes
between every backward of a three-loss retained graph, two live retained
graphs of which one is dropped (the other keeps the shared parameters), a
retained graph dropped mid-training followed by more steps, and
``max_deferred_bytes`` below the model size over several optimizer steps.
"""

from __future__ import annotations

import gc

import pytest
import torch
from patterns_common import Pair, tokens
from patterns_common import ranks2  # noqa: F401 - the fixture: every test here runs under both unit choices

from paramfsm import State
from paramfsm.testing.models import TinyTransformer

VOCAB, SEQ = 32, 8


def _model():
    torch.manual_seed(0)
    return TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ)


def _losses(out):
    return [out.pow(2).mean(), out.tanh().mean(), out.sin().mean()]


def flush_between_job(rank, world, retain):
    """backward(l1, retain) ; flush ; backward(l2, retain) ; flush ; backward(l3): each re-gathers."""
    pair = Pair(_model(), rank, world, retain=retain)
    rt, model, ref = pair.rt, pair.model, pair.ref.model
    regathers = []
    for step in range(2):
        tok = tokens(step, world, 2, SEQ, VOCAB)
        losses, ref_losses = _losses(model(pair.local(tok))), _losses(ref(tok))
        for i in range(3):
            keep = i < 2
            pair.zero_grad()
            before = rt.counters["all_gathers"]
            losses[i].backward(retain_graph=keep)
            ref_losses[i].backward(retain_graph=keep)
            regathers.append(rt.counters["all_gathers"] - before)
            pair.check_grads(f"step {step} backward {i}")
            rt.flush()
            assert rt.deferred_bytes == 0
            pair.assert_states(State.NOT_AVAILABLE, what="after rt.flush()")
        pair.step(f"step {step}")
    report = pair.finish()
    report["regathers"] = regathers
    return report


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_backward_after_each_flush(ranks2, retain):
    report = ranks2.run(flush_between_job, retain)[0]
    assert all(g > 0 for g in report["regathers"]), report["regathers"]


def two_graphs_job(rank, world):
    """Two retained graphs share every unit; dropping one keeps the parameters deferred for the other."""
    pair = Pair(_model(), rank, world)
    rt, model, ref = pair.rt, pair.model, pair.ref.model
    ta, tb = tokens(0, world, 2, SEQ, VOCAB), tokens(1, world, 2, SEQ, VOCAB)
    out_a, out_b = model(pair.local(ta)), model(pair.local(tb))
    ref_a, ref_b = ref(ta), ref(tb)
    pair.zero_grad()
    (out_a.pow(2).mean() + out_b.pow(2).mean()).backward(retain_graph=True)
    (ref_a.pow(2).mean() + ref_b.pow(2).mean()).backward(retain_graph=True)
    pair.check_grads("both graphs")
    held = rt.deferred_bytes
    pair.assert_states(State.DEFERRED_RELEASE, what="after a retained backward")
    del out_a
    gc.collect()
    still = rt.deferred_bytes
    pair.assert_states(State.DEFERRED_RELEASE, what="one retained graph is still alive")
    pair.zero_grad()
    before = rt.counters["all_gathers"]
    out_b.tanh().mean().backward()
    ref_b.tanh().mean().backward()
    reused = rt.counters["all_gathers"] - before
    pair.check_grads("second graph")
    pair.assert_states(State.NOT_AVAILABLE, what="after the final backward")
    report = pair.finish()
    report.update(held=held, still=still, reused_gathers=reused, after=rt.deferred_bytes)
    return report


def test_dropping_one_of_two_retained_graphs(ranks2):
    report = ranks2.run(two_graphs_job)[0]
    assert report["held"] > 0 and report["still"] == report["held"]
    assert report["reused_gathers"] == 0 and report["after"] == 0


def dropped_then_train_job(rank, world, retain):
    """A retained graph dropped without its final backward returns its memory; training goes on."""
    pair = Pair(_model(), rank, world, retain=retain)
    rt, model, ref = pair.rt, pair.model, pair.ref.model
    held = []
    for step in range(3):
        tok = tokens(step, world, 2, SEQ, VOCAB)
        out, ref_out = model(pair.local(tok)), ref(tok)
        pair.zero_grad()
        out.pow(2).mean().backward(retain_graph=True)
        ref_out.pow(2).mean().backward(retain_graph=True)
        pair.check_grads(f"step {step}")
        held.append(rt.deferred_bytes)
        del out, ref_out
        gc.collect()
        assert rt.deferred_bytes == 0, rt.deferred_bytes
        pair.assert_states(State.NOT_AVAILABLE, what="after the retained graph was dropped")
        pair.step(f"step {step}")
    report = pair.finish()
    report["held"] = held
    return report


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_dropped_retained_graph_returns_memory(ranks2, retain):
    held = ranks2.run(dropped_then_train_job, retain)[0]["held"]
    assert all(h > 0 for h in held) if retain == "defer" else held == [0, 0, 0]


def bounded_job(rank, world, bound):
    pair = Pair(_model(), rank, world, max_deferred_bytes=bound)
    rt, model, ref = pair.rt, pair.model, pair.ref.model
    total = sum(rec.nbytes for rec in rt.scheduler.records)
    for step in range(2):
        tok = tokens(step, world, 2, SEQ, VOCAB)
        losses, ref_losses = _losses(model(pair.local(tok))), _losses(ref(tok))
        for i in range(3):
            pair.zero_grad()
            losses[i].backward(retain_graph=i < 2)
            ref_losses[i].backward(retain_graph=i < 2)
            assert rt.deferred_bytes <= bound
            pair.check_grads(f"step {step} backward {i}")
        pair.step(f"step {step}")
    report = pair.finish()
    report.update(peak=rt.scheduler.deferral.peak_bytes, total=total)
    return report


@pytest.mark.parametrize("bound", [0, 3000])
def test_max_deferred_bytes_below_model_size(ranks2, bound):
    report = ranks2.run(bounded_job, bound)[0]
    assert report["peak"] <= bound < report["total"]
    if bound:
        assert report["peak"] > 0
