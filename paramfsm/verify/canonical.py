"""The canonical training-loop patterns ``paramfsm verify`` runs before its random programs.

Each entry is a :class:`~paramfsm.verify.ops.Config` and a tuple of intents ``(kind, a, b, flag)``, the
vocabulary of :mod:`paramfsm.verify.programs`, whose :func:`~paramfsm.verify.programs.canonical` normalises
them for a subject. Each pattern is the loop behind one or more bugs of the fault catalogue
(:mod:`paramfsm.verify.faults`), so every run checks them first, whatever the seed draws.
"""

from __future__ import annotations

from paramfsm.verify.ops import Config

#: Training-loop patterns behind the bugs of :mod:`paramfsm.verify.faults`, as intents (kind, a, b, flag)
#: with a configuration. They run before the random programs (see :func:`paramfsm.verify.programs.canonical`).
CANONICAL: tuple[tuple[Config, tuple], ...] = (
    (Config(), (("multi_loss", 0, 0, False),)),  # forward, two losses, zero_grad/backward(retain)/backward
    (Config(), (("multi_loss", 1, 4, True),)),  # the same through rt.backward, checkpointed, three losses
    (Config(), (("multi_loss", 0, 2, False),)),  # both backward passes retain; the graph is dropped
    (Config(), (("multi_loss", 2, 3, False),)),  # eval mode, rt.flush() between the backward passes
    (Config(retain="regather"), (("multi_loss", 0, 0, True), ("iteration", 1, 0, False))),
    (Config(max_deferred_bytes=4096), (("multi_loss", 0, 4, False),)),
    (Config(), (("iteration", 0, 0, False), ("forward", 4, 1, False), ("forward", 1, 2, False),
                ("backward", 0, 3, True), ("step", 0, 0, False), ("gathered", 0, 1, True))),
    (Config(bucket_bytes=1, prefetch=2), (("accumulate", 0, 2, False), ("forward", 2, 0, False),
                                          ("iteration", 1, 1, True), ("penalty", 0, 0, True),
                                          ("penalty", 0, 0, False))),
    # fp16 and the scaler: two scaled backward passes over a retained graph, unscale, a clip whose max_norm is
    # above the total norm, a step; then a forced overflow in the last rank's slice of a gradient and a step
    # every rank must skip.
    (Config(param_dtype="float16"), (("multi_loss", 0, 0, False), ("clip", 2, 0, False), ("step", 0, 0, False),
                                     ("zero_grad", 0, 0, False), ("backward", 0, 6, False),
                                     ("overflow", 0, 7, False), ("step", 0, 0, False))),
    # bf16: a frozen parameter, per-block reentrant checkpointing with a retained second backward, a clip,
    # unfreezing, a DCP round trip and a perturbed full-state-dict round trip, then an iteration.
    (Config(param_dtype="bfloat16"), (("requires_grad", 1, 0, False), ("forward", 5, 0, False),
                                      ("backward", 0, 1, True), ("backward", 0, 1, False), ("clip", 1, 1, False),
                                      ("step", 0, 0, False), ("requires_grad", 1, 0, False),
                                      ("state_dict", 1, 0, True), ("state_dict", 1, 0, False),
                                      ("iteration", 0, 2, False))),
    # Accumulation, every unit kept from its forward to its backward: a no_grad forward (it keeps nothing); the
    # sync switch: a forward with sync off whose backward runs with it back on (it synchronises), an iteration
    # with sync off (kept, then rt.sync_gradients() before the step); two micro-batches under rt.no_sync()
    # and a synchronising backward outside the window, a step; three in eval mode through rt.backward, the
    # first a two-loss retained micro-batch whose graph is dropped, then rt.sync_gradients() and a step.
    (Config(reshard_after_forward=False), (("forward", 1, 3, False), ("grad_sync", 0, 0, False),
                                           ("forward", 0, 2, False), ("loss", 0, 2, False),
                                           ("grad_sync", 0, 0, True), ("backward", 0, 2, False),
                                           ("grad_sync", 0, 0, False), ("iteration", 0, 1, False),
                                           ("grad_sync", 0, 0, True), ("no_sync", 0, 1, False),
                                           ("no_sync", 5, 5, True))),
    # User loops (paramfsm.verify.user_loop_intents). A step between a retained backward and the next forward
    # of a unit that backward left deferred: the unit run again on its saved inputs must compute with the
    # stepped weights (its graph is stale: only its output and loss are compared), then again on detached
    # inputs, through a backward and a step.
    (Config(), (("forward", 0, 0, False), ("backward", 0, 0, True), ("step", 0, 0, False),
                ("sub_forward", 1, 0, False), ("sub_forward", 1, 0, True), ("backward", 1, 0, False),
                ("step", 0, 0, False))),
    # In-place writes inside rt.gathered: one unit's parameter while a retained graph keeps it deferred, then
    # every unit's, then an iteration on the written weights.
    (Config(), (("iteration", 0, 0, False), ("forward", 0, 1, False), ("backward", 0, 1, True),
                ("gathered_write", 1, 0, False), ("gathered_write", 0, 1, True), ("iteration", 0, 2, False))),
    # In-place ops on a view of a unit's output (h = unit(x)[...]; h += 0.5) through the saved inputs, then on
    # detached inputs with a retained backward through rt.backward, and a step.
    (Config(), (("forward", 0, 0, False), ("sub_forward", 2, 4, False), ("backward", 0, 4, False),
                ("sub_forward", 0, 4, True), ("backward", 1, 5, True), ("step", 0, 0, False))),
    # Two GAN iterations in one sharded root, the fake batch not detached (D's backward retains the graph,
    # D steps, D runs again on the fake batch, G's backward goes through it; one optimizer per part).
    (Config(), (("gan", 1, 0, False), ("gan", 0, 1, True))),
    # Eval segments: under inference_mode between a retained backward and the final one, under no_grad after
    # the step, then an iteration.
    (Config(), (("forward", 0, 0, False), ("backward", 0, 0, True), ("evaluate", 1, 1, True),
                ("backward", 0, 0, False), ("step", 0, 0, False), ("evaluate", 0, 2, False),
                ("iteration", 0, 3, False))),
    # A DCP checkpoint with the optimizer state saved after an iteration and restored while a retained graph is
    # alive; a full state dict saved, an iteration, the state dict loaded back, an iteration.
    (Config(), (("iteration", 0, 0, False), ("save_restore", 0, 0, False), ("iteration", 1, 1, False),
                ("forward", 0, 2, False), ("backward", 0, 2, True), ("save_restore", 0, 0, True),
                ("save_restore", 1, 0, False), ("iteration", 0, 3, False), ("save_restore", 1, 0, True),
                ("iteration", 2, 1, True))),
    # Offload to disk: shards, their gradients and optimizer state paged in for each gather, accumulation and
    # unit's step, out after it, beside another run sharing the folder. An iteration, two micro-batches adding
    # into the paged-out gradients, two losses over a retained graph and a step, an in-place write inside
    # rt.gathered, a DCP save with the optimizer state, an iteration, that checkpoint loaded back by plain DCP in
    # place into the runtime's state dicts, a GAN iteration (one optimizer per part), then a full state dict
    # kept with torch's own optimizer state dicts, two iterations alike (the second pages in the first unit's
    # step values ahead, in the recorded order), both loaded back, and that iteration again: opt.load_state_dict
    # replaced the offloaded optimizer state, and the tier's old copy must never be read into it.
    (Config(offload="disk"), (("iteration", 0, 0, False), ("accumulate", 0, 1, False),
                              ("multi_loss", 0, 0, False), ("step", 0, 0, False),
                              ("gathered_write", 0, 1, True), ("save_restore", 0, 0, False),
                              ("iteration", 1, 1, False), ("save_restore", 0, 1, True),
                              ("gan", 0, 1, True), ("save_restore", 1, 1, False), ("iteration", 2, 2, False),
                              ("iteration", 2, 2, False), ("save_restore", 1, 1, True),
                              ("iteration", 2, 2, False))),
    # A loss that reads another output on each rank (each rank's backward differentiates its own): rank 0's
    # from one batch's output, rank 1's from another's (the same units in the same order: it must train like
    # plain torch), a step; rank 0's from the root output, rank 1's from a unit run again on that forward's
    # saved inputs; then rank 0's from one unit and rank 1's from another, each run on detached inputs. Where
    # the ranks' backward passes reach different units, every rank must raise RankDesync (the program stops).
    (Config(), (("forward", 0, 0, False), ("forward", 0, 1, False), ("rank_loss", 0, 0, False),
                ("step", 0, 0, False), ("forward", 0, 2, False), ("rank_loss", 1, 0, False), ("step", 0, 0, False),
                ("rank_loss", 2, 1, True))),
    # opt.step(closure), as every Lightning step is: two micro-batches under rt.no_sync(), the closure's
    # backward the last micro-batch (it synchronises them); a retained backward, then a closure that zeroes
    # the gradients and runs a checkpointed forward and its backward through rt.backward; an iteration.
    (Config(), (("closure_step", 1, 1, False), ("forward", 0, 0, False), ("backward", 0, 0, True),
                ("closure_step", 2, 0, True), ("iteration", 0, 3, False))),
    # The whole model one unit (the default units merge a small model into its root): a backward broken off
    # inside a user's autograd.Function after some gradients were accumulated, then rt.reset() and an
    # iteration; again, the next forward recovering by itself; then a unit module called on its own (its
    # unit is the root) on a forward's saved inputs, and on detached ones, through backward passes and a step.
    (Config(units="one"), (("iteration", 0, 0, False), ("interrupt", 1, 1, True), ("iteration", 0, 2, False),
                           ("interrupt", 2, 3, False), ("iteration", 1, 1, False), ("forward", 0, 0, False),
                           ("sub_forward", 1, 0, False), ("sub_forward", 0, 0, True), ("backward", 0, 0, False),
                           ("step", 0, 0, False))),
    # Units kept from forward to backward under a deferral bound below a unit's size, two losses over a
    # retained graph: a unit whose parameter another unit's forward reads (a tied output layer through
    # F.linear) is released by the bound inside the retained backward, and the reader's next backward must
    # find it gathered again.
    (Config(reshard_after_forward=False, max_deferred_bytes=4096), (("multi_loss", 0, 0, False),
                                                                     ("step", 0, 0, False),
                                                                     ("multi_loss", 0, 1, True))),
    # paramfsm #53. A whole-parameter optimizer (Adafactor: its update reads each parameter's shape) over
    # accumulated gradients, clipped by torch's own clip_grad_norm_ over the shards, saved with its state and
    # restored; then an iteration.
    (Config(optimizer="adafactor", clip_plain=True), (("iteration", 0, 0, False), ("accumulate", 1, 1, False),
                                                      ("clip", 0, 0, False), ("step", 0, 0, False),
                                                      ("save_restore", 0, 0, True))),
    # Gradients accumulated over backward passes into a bounded CPU tier, zero_grad(set_to_none=False) between
    # steps, and a step pre-hook decaying the learning rate (once per step, whatever the units).
    (Config(offload="cpu-bounded", zero_grad_to_none=False, step_hooks=True),
     (("iteration", 0, 0, False), ("accumulate", 0, 1, False), ("accumulate", 0, 2, False))),
    # A write to a weight inside forward (a layer clamping its own weight): refused on every rank.
    (Config(), (("iteration", 0, 0, False), ("write_in_forward", 0, 1, False))),
    # paramfsm #53, item 6. Each block compiled (the README's recipe): an iteration, then an eval segment between
    # a backward and its step recompiles the blocks while the parameters hold gradients; the step, an iteration.
    # (A batch norm under param_dtype, frozen_norm_mlp's, runs in the bf16 pattern above.)
    (Config(compiled=True), (("iteration", 0, 0, False), ("forward", 0, 1, False),
                                                     ("backward", 0, 1, False), ("evaluate", 1, 2, False),
                                                     ("step", 0, 0, False), ("iteration", 0, 3, False))),
    # An optimizer subclass whose step calls super().step() (its parent's step wrapped by torch's hooks too),
    # under an offloaded optimizer: three iterations, each step once.
    (Config(offload="cpu", optimizer="subclass"), (("iteration", 0, 0, False), ("iteration", 1, 1, False),
                                                   ("iteration", 2, 2, False))),
    # A shard() refused for its offload bound first, then training under offload with a step pre-hook.
    (Config(offload="cpu", step_hooks=True, refused_shard=True), (("iteration", 0, 0, False),
                                                                  ("iteration", 1, 1, False))),
    # paramfsm #57, cases 8 and 9. A write inside rt.gathered that differs by rank, in the first element only:
    # refused on every rank, nothing written back.
    (Config(), (("iteration", 0, 0, False), ("rank_write", 0, 0, False))),
    # A module whose parameters sit in its child, attached to the root after shard(): the next forward raises
    # ModelChanged on every rank.
    (Config(), (("iteration", 0, 0, False), ("attach", 0, 1, False))),
)
