"""Several passes per optimizer step on 2 gloo ranks, compared with plain torch.

Several forwards before one backward on a combined loss (contrastive / DPO),
forwards interleaved with backward passes, a ``no_grad`` / ``eval`` rollout
inside training (RLHF style), and gradient accumulation over micro-batches,
with and without a retained graph inside a micro-batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from patterns_common import Pair, batch, tokens
from patterns_common import ranks2  # noqa: F401 - the fixture: every test here runs under both unit choices

from paramfsm import State
from paramfsm.testing.models import TinyTransformer, mlp

VOCAB, SEQ = 32, 8


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def contrastive_job(rank, world, retain):
    """Two (and three) forwards of one model, one backward on a loss that mixes their outputs."""
    torch.manual_seed(0)
    pair = Pair(mlp(width=7, depth=3, d_in=4, d_out=4), rank, world, make_optimizer=_adam, retain=retain)
    model, ref = pair.model, pair.ref.model
    for step in range(2):
        a, b, c = batch(step, world, 2, (4,), (4,), (4,))
        za, zb, zc = (model(pair.local(t)) for t in (a, b, c))
        ra, rb, rc = ref(a), ref(b), ref(c)
        pair.assert_states(State.NOT_AVAILABLE, what="between forwards")

        def loss_of(x, y, z):
            # DPO-like margin between a chosen and a rejected pair, plus a cosine term
            margin = (x * y).sum(-1) - (x * z).sum(-1)
            return -F.logsigmoid(margin).mean() - F.cosine_similarity(x, y).mean()

        pair.zero_grad()
        loss_of(za, zb, zc).backward()
        loss_of(ra, rb, rc).backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    return pair.finish()


def interleaved_job(rank, world, retain):
    """f1, f2, backward(l1), f3, backward(l2 + l3): a forward between backward passes of live graphs."""
    torch.manual_seed(0)
    pair = Pair(mlp(width=7, depth=3, d_in=4, d_out=3), rank, world, make_optimizer=_adam, retain=retain)
    model, ref = pair.model, pair.ref.model
    for step in range(2):
        xs = batch(step, world, 2, (4,), (4,), (4,))
        pair.zero_grad()
        o1, o2 = model(pair.local(xs[0])), model(pair.local(xs[1]))
        r1, r2 = ref(xs[0]), ref(xs[1])
        o1.pow(2).mean().backward()
        r1.pow(2).mean().backward()
        pair.assert_states(State.NOT_AVAILABLE, what="after the first backward")
        pair.check_grads(f"step {step} first")
        o3, r3 = model(pair.local(xs[2])), ref(xs[2])
        (o2 * o3).mean().backward()
        (r2 * r3).mean().backward()
        pair.check_grads(f"step {step} second")
        pair.step(f"step {step}")
    return pair.finish()


@pytest.mark.parametrize("job", [contrastive_job, interleaved_job], ids=["contrastive", "interleaved"])
@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_several_forwards(ranks2, job, retain):
    assert ranks2.run(job, retain)[0]["checks"] >= 4


def rollout_job(rank, world):
    """Generate under no_grad in eval mode, then train on the generated targets."""
    torch.manual_seed(0)
    pair = Pair(TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ), rank, world)
    model, ref = pair.model, pair.ref.model
    gathers = []
    for step in range(2):
        prompt = tokens(step, world, 2, SEQ // 2, VOCAB)
        model.eval()
        ref.eval()
        seq, ref_seq = pair.local(prompt), prompt
        with torch.no_grad():
            for _ in range(SEQ // 2):
                before = pair.rt.counters["all_gathers"]
                nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
                gathers.append(pair.rt.counters["all_gathers"] - before)
                pair.assert_states(State.NOT_AVAILABLE, what="right after a no_grad forward")
                seq = torch.cat([seq, nxt], 1)
                ref_seq = torch.cat([ref_seq, ref(ref_seq)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(seq, pair.local(ref_seq)), "rollouts differ from the reference"
        model.train()
        ref.train()
        pair.zero_grad()
        logits, ref_logits = model(seq[:, :-1]), ref(ref_seq[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1)).backward()
        F.cross_entropy(ref_logits.reshape(-1, VOCAB), ref_seq[:, 1:].reshape(-1)).backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    report = pair.finish()
    report["gathers"] = gathers
    return report


def test_no_grad_rollout_inside_training(ranks2):
    report = ranks2.run(rollout_job)[0]
    assert all(g > 0 for g in report["gathers"]), report["gathers"]


def accumulation_job(rank, world, retain, retained_inside):
    """Micro-batches accumulate into the shard gradients; one optimizer step per global batch."""
    torch.manual_seed(0)
    pair = Pair(TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ), rank, world, retain=retain)
    model, ref = pair.model, pair.ref.model
    micro = 3
    for step in range(2):
        pair.zero_grad()
        for m in range(micro):
            tok = tokens(10 * step + m, world, 1, SEQ, VOCAB)
            out, ref_out = model(pair.local(tok)), ref(tok)
            losses = [out.pow(2).mean() / micro, out.tanh().mean() / micro]
            ref_losses = [ref_out.pow(2).mean() / micro, ref_out.tanh().mean() / micro]
            if retained_inside:
                losses[0].backward(retain_graph=True)
                ref_losses[0].backward(retain_graph=True)
                losses[1].backward()
                ref_losses[1].backward()
            else:
                (losses[0] + losses[1]).backward()
                (ref_losses[0] + ref_losses[1]).backward()
            pair.assert_states(State.NOT_AVAILABLE, what=f"after micro-batch {m}")
            pair.check_grads(f"step {step} micro-batch {m}")
        pair.step(f"step {step}")
    return pair.finish()


@pytest.mark.parametrize("retained_inside", [False, True], ids=["plain", "retained_graph_inside"])
@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_gradient_accumulation(ranks2, retain, retained_inside):
    assert ranks2.run(accumulation_job, retain, retained_inside)[0]["checks"] == 8
