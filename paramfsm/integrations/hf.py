"""Hugging Face transformers on a sharded model: ``generate`` across ranks, the Trainer, saving and loading.

* :func:`generate` (also ``rt.generate``): ``model.generate`` with
  ``synced_gpus`` on, so ranks with different prompts stay in step.
* :class:`ShardedTrainer`: ``transformers.Trainer`` for a model sharded by
  :func:`paramfsm.shard`, launched with torchrun (see its docstring for what
  it changes and what it refuses).
* :func:`load_pretrained`: a ``save_pretrained`` directory into a sharded model.

Saving needs no helper: ``model.save_pretrained(d, state_dict=rt.full_state_dict(rank0_only=True))``
on rank 0 (``full_state_dict`` is collective: every rank calls it) writes the
same keys and bytes as a plain save of the unsharded model.

The Trainer needs ``accelerate``; the ``hf`` extra brings it, with transformers and safetensors.
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist
import transformers
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from paramfsm import checkpoint, optim
from paramfsm.sharding import meta
from paramfsm.errors import ParamFSMError
from paramfsm.sharding.rank_errors import agreed, groups_of

logger = logging.getLogger(__name__)

#: Sub-folder of a Trainer checkpoint holding every rank's shards of the model and the optimizer
#: (:mod:`paramfsm.checkpoint`, reloadable at any world size).
SHARDS_DIR = "paramfsm-shards"
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME


def generate(rt, *args, **kwargs):
    """``rt.model.generate(*args, **kwargs)`` with ``synced_gpus=True`` when the default group has several ranks.

    [Note: generate needs synced_gpus]
    Each decoding step of a sharded model is a forward, and each forward
    all-gathers parameters: every rank must run the same number of steps. With
    different prompts per rank, one rank meets its end-of-sequence token or
    stopping criterion first and leaves the loop while the others wait in an
    all-gather that never completes. ``synced_gpus=True`` makes a finished rank
    keep running forwards (its output is discarded) until every rank is done,
    deciding with one all-reduce per step over the default process group.
    transformers turns it on by itself only for DeepSpeed ZeRO-3 and FSDP: it
    checks ``is_deepspeed_zero3_enabled()`` and ``is_fsdp_managed_module(model)``,
    which reads FSDP's private ``_is_fsdp_managed_module`` attribute (also read
    by torch.compile, which would then treat the model as an FSDP module). No
    public switch exists, so paramfsm passes the argument instead. An explicit
    ``synced_gpus=`` is kept. Collective: every rank of the default group calls it.
    """
    generate_fn = getattr(rt.model, "generate", None)
    if generate_fn is None:
        raise ParamFSMError(f"rt.generate: the sharded {type(rt.model).__name__} has no generate() method; "
                            "it needs a Hugging Face model with a generation head (GenerationMixin)")
    if kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = dist.is_initialized() and dist.get_world_size() > 1
    return generate_fn(*args, **kwargs)


def load_pretrained(rt, directory) -> None:
    """Load the weights of a ``save_pretrained`` directory (safetensors) into a sharded model. Every rank calls it.

    Each rank reads only its slice of each tensor, one tensor at a time
    (:mod:`paramfsm.integrations.safetensors_slices`), from ``model.safetensors``
    or every file of ``model.safetensors.index.json``; every key, shape and byte
    range is checked against the headers and the files' sizes before any value
    is written, so a bad checkpoint raises on every rank alike; a file only one
    rank cannot read raises on every rank too (the outcome is agreed at the
    end, the load's only collective: one flag all-reduce). A checkpoint
    of another dtype than the model's is converted as ``from_pretrained``
    converts it (``tensor.to(dtype)``). A tied parameter
    is loaded from the one key the file keeps. The keys must be the model's own
    state-dict keys: for a checkpoint in another layout, load it with
    ``from_pretrained`` and shard the model again.

    [Note: buffers a model computes itself]
    Non-persistent buffers (rotary ``inv_freq``) are in no checkpoint; the model
    computes them when it is built, which on the meta device computes nothing.
    Transformers recomputes them in ``_init_weights`` (as its own ``from_pretrained``
    does for a model built on meta), so for every module that owns such a buffer,
    still unset, and no parameter of its own, ``model._init_weights(module)`` runs
    here. A buffer still unset after that is named by the forward's guard
    (:mod:`paramfsm.sharding.meta`).
    """
    from paramfsm.integrations import safetensors_slices

    directory = os.fspath(directory)
    with agreed(groups_of(rt), "load_pretrained"):  # a file one rank cannot read ([Note: an error one rank meets])
        single, index = os.path.join(directory, SAFE_WEIGHTS_NAME), os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
        if os.path.isfile(single):
            files = [single]
        elif os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                files = [os.path.join(directory, name)
                         for name in sorted(set(json.load(handle)["weight_map"].values()))]
        else:
            raise ParamFSMError(f"no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in '{directory}' (rank "
                                f"{rt.rank}); save with model.save_pretrained(d, state_dict=rt.full_state_dict())")
        safetensors_slices.load_files(rt, files, directory)
        recompute_buffers(rt)


def recompute_buffers(rt) -> None:
    """Run the model's own ``_init_weights`` on parameter-free modules whose meta-built buffers are unset."""
    init = getattr(rt.model, "_init_weights", None)
    if init is None:
        return
    owners = {id(entry[1]): entry[1] for entry in rt._values.buffers
              if not any(True for _ in entry[1].parameters(recurse=False))}
    unset = set(meta.unset_buffers(rt._values))
    with torch.no_grad():
        for module in owners.values():
            if any(entry[0] in unset for entry in rt._values.buffers if entry[1] is module):
                init(module)


class ShardedTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a model sharded by :func:`paramfsm.shard`; launch with torchrun.

    ``ShardedTrainer(model=model, args=args, ..., runtime=rt)``, with
    ``rt = paramfsm.shard(model)`` called on every rank first. Each rank trains
    on its own micro-batches (the Trainer shards the data loader); gradients are
    averaged over ranks by paramfsm's reduce-scatter, as DDP averages them, so
    the Trainer's loss scaling (``average_tokens_across_devices``) holds as is.
    What it changes:

    * **No DDP, no device move.** Accelerate prepares the model as for
      evaluation (see [Note: no DDP around a sharded model]), so ``args.bf16``
      autocast still applies; it must already be on ``args.device`` when sharded.
    * **Optimizer.** The Trainer's own (AdamW over its weight-decay param
      groups) is built over the model's parameters and steps the shards
      (:mod:`paramfsm.optim` maps it at its first step).
    * **Clipping** through ``rt.clip_grad_norm_`` (the global norm over shards).
    * **Step numbers.** Each micro-batch's ``training_step`` first calls
      ``rt.set_step(state.global_step)``, so every collective carries the
      optimizer step it belongs to: a rank that skips a step (a
      ``training_step`` override that returns early for a bad batch) raises
      :class:`~paramfsm.errors.RankDesync` on every rank, naming the steps,
      instead of pairing its next step with its peers' current one.
    * **Gradient accumulation** (``args.gradient_accumulation_steps``): every
      micro-batch but the last of a window runs under ``rt.no_sync()``, so an
      optimizer step costs one reduce-scatter per bucket, not one per micro-batch.
    * **Saving.** The model file comes from ``rt.full_state_dict(rank0_only=True)``,
      written by rank 0 (``save_model`` is collective: every rank calls it, as
      the Trainer itself does). A checkpoint also holds :data:`SHARDS_DIR`, every
      rank's shards of the model and the optimizer, instead of rank 0's
      ``optimizer.pt`` (which would hold only rank 0's shard of the moments).
    * **Loading.** ``train(resume_from_checkpoint=...)`` and
      ``load_best_model_at_end`` load through :func:`load_pretrained` and
      :mod:`paramfsm.checkpoint`.

    Refused with :class:`~paramfsm.errors.ParamFSMError`: ``args.fp16`` (the
    Trainer's GradScaler decides per rank whether to skip a step; use
    ``args.bf16`` or ``paramfsm.shard(..., param_dtype=torch.bfloat16)``) and
    ``model_init`` (a new model per trial would not be sharded).
    """

    def __init__(self, model=None, args=None, *more, runtime=None, **kwargs):
        if runtime is None:
            raise ParamFSMError("ShardedTrainer(model=model, args=args, ..., runtime=rt): pass the runtime "
                                "that rt = paramfsm.shard(model) returned")
        model = runtime.model if model is None else model
        if model is not runtime.model:
            raise ParamFSMError(f"ShardedTrainer: the model ({type(model).__name__}) is not the one the runtime "
                                f"shards ({type(runtime.model).__name__}); pass the model given to paramfsm.shard")
        if kwargs.get("model_init") is not None:
            raise ParamFSMError("ShardedTrainer does not take model_init (a model built per trial is not sharded); "
                                "shard the model and pass it as model=")
        if args is not None and args.fp16:
            raise ParamFSMError("ShardedTrainer: args.fp16 scales the loss with the Trainer's own GradScaler, which "
                                "would decide on each rank alone whether to skip a step (the shards would diverge); "
                                "use args.bf16, or paramfsm.shard(model, param_dtype=torch.bfloat16)")
        self.runtime = runtime
        super().__init__(model, args, *more, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator, made to prepare the sharded model without DDP and without moving it.

        [Note: no DDP around a sharded model]
        Under torchrun, Accelerate wraps every trainable model in
        DistributedDataParallel, which would all-reduce the gradients paramfsm
        already reduce-scatters, and moves it with ``model.to(device)``, which a
        sharded model refuses (its parameters hold no data). The Trainer has no
        switch for either, so this trainer's Accelerator prepares the sharded
        model as it prepares a model for evaluation: no DDP, no device placement.
        """
        super().create_accelerator_and_postprocess()
        accelerator, sharded = self.accelerator, self.runtime.model
        prepare_model = accelerator.prepare_model

        def prepare_sharded(model, device_placement=None, evaluation_mode=False):
            if model is sharded:
                return prepare_model(model, device_placement=False, evaluation_mode=True)
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        accelerator.prepare_model = prepare_sharded
        no_sync, runtime = accelerator.no_sync, self.runtime

        def no_sync_sharded(model):
            """The Trainer's micro-batches before the last of an accumulation window: one reduce-scatter per
            optimizer step (Accelerate's no_sync would do nothing for a model it did not wrap in DDP)."""
            if model is sharded:
                return runtime.no_sync()
            return no_sync(model)

        accelerator.no_sync = no_sync_sharded

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step, after naming the optimizer step it belongs to (see the class docstring)."""
        self.runtime.set_step(self.state.global_step)
        return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------ device, clipping
    def _move_model_to_device(self, model, device) -> None:
        shard = next(iter(self.runtime.shard_parameters()), None)
        if shard is not None and not _same_device(shard.device, torch.device(device)):
            raise ParamFSMError(f"the sharded model is on {shard.device} but the Trainer trains on {device} "
                                f"(rank {self.runtime.rank}); move the model there before paramfsm.shard")

    def _clip_grad_norm(self, model):
        return self.runtime.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.runtime.clip_grad_norm_(float("inf")) if grad_norm is None else grad_norm

    # ------------------------------------------------------------------ saving
    def _save(self, output_dir=None, state_dict=None) -> None:
        """Every rank gathers; rank 0 (each node's first rank with ``save_on_each_node``) writes.

        [Note: save_on_each_node writes on every node]
        ``save_pretrained`` writes the weights on global rank 0 alone whenever
        a process group exists, whatever ``is_main_process`` says, so with
        ``save_on_each_node`` the first rank of every other node would gather
        the full tensors and write a folder without them. Those ranks are the
        Trainer's own writers (``args.should_save``), so for this save the
        model is told to write where the Trainer asks it to.
        """
        if state_dict is None:
            state_dict = self.runtime.full_state_dict(rank0_only=not self.args.save_on_each_node)
        model = self.runtime.model
        local_writer = self.args.should_save and hasattr(model, "should_save_on_this_rank")
        if local_writer:
            model.should_save_on_this_rank = _writes_if_main
        try:
            super()._save(output_dir, state_dict=state_dict)
        finally:
            if local_writer:
                del model.should_save_on_this_rank

    def _save_optimizer_and_scheduler(self, output_dir) -> None:
        checkpoint.save(self.runtime, os.path.join(output_dir, SHARDS_DIR), optimizer=self._torch_optimizer())
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ------------------------------------------------------------------ loading
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        load_pretrained(self.runtime, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        logger.info("loading the best model from %s", self.state.best_model_checkpoint)
        load_pretrained(self.runtime, self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, resume_from_checkpoint) -> None:
        if resume_from_checkpoint is None:
            return
        shards = os.path.join(resume_from_checkpoint, SHARDS_DIR)
        if not os.path.isdir(shards):
            raise ParamFSMError(f"'{resume_from_checkpoint}' has no {SHARDS_DIR}/ (rank {self.runtime.rank}): "
                                "it was not saved by ShardedTrainer, so it holds no optimizer state of every "
                                "rank; resume from one that was, or load only the weights (load_pretrained)")
        opt = self._torch_optimizer()
        optim.map_optimizer(opt)
        checkpoint.load(self.runtime, shards, optimizer=opt)
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(resume_from_checkpoint, SCHEDULER_NAME), weights_only=True))

    def _torch_optimizer(self):
        """The torch optimizer inside Accelerate's wrapper."""
        return getattr(self.optimizer, "optimizer", self.optimizer)


def _writes_if_main(is_main_process: bool) -> bool:
    """``save_pretrained``'s choice of writer, as the Trainer makes it (see [Note: save_on_each_node writes on
    every node])."""
    return is_main_process


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
