"""Hugging Face Accelerate on a model sharded by paramfsm: a drop-in :class:`Accelerator`.

An Accelerate training script runs under paramfsm with one changed line::

    from paramfsm.integrations.accelerate import Accelerator   # was: from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Launched as usual (``accelerate launch --num_processes 2 script.py``, or
torchrun). It is ``accelerate.Accelerator`` with these changes:

* **prepare(model)** shards the model with :func:`paramfsm.shard` (options
  from ``shard_options=``; a model built on the meta device is sharded onto
  ``accelerator.device``; ``Accelerator(runtime=rt)`` takes a model sharded
  before, by ``rt = paramfsm.shard(model)``), and
  prepares it as Accelerate prepares a model for evaluation: no DDP (see
  [Note: no DDP around a sharded model] in :mod:`paramfsm.integrations.hf`)
  and no device move, while ``mixed_precision="bf16"`` autocast still wraps
  the forward. ``accelerator.runtime`` is the runtime.
* **accumulate() / no_sync()** run the micro-batches before the last of a
  window under ``rt.no_sync()``: one reduce-scatter per optimizer step.
* **clip_grad_norm_** is ``rt.clip_grad_norm_`` (the global norm over shards).
* **Step numbers.** Every batch a prepared data loader yields while the model
  is in training mode names its optimizer step with ``rt.set_step`` (see
  [Note: step numbers from the data loader]). ``prepare`` returns each data
  loader as a :class:`SteppedLoader` around Accelerate's (its ``loader``).
* **get_state_dict / save_model** return and write full tensors, from
  ``rt.full_state_dict(rank0_only=True)``: rank 0 holds them (on the CPU),
  as Accelerate's FSDP full state dict does; every rank calls them.
* **save_state / load_state** write and read the model and optimizer as a
  sharded DCP checkpoint (:mod:`paramfsm.checkpoint`, folder :data:`SHARDS_DIR`,
  reloadable at any world size); schedulers, RNG states, samplers and
  registered objects go through Accelerate's own code.

``unwrap_model`` returns the sharded model (Accelerate's autocast wrapper
removed, as usual); ``gather_for_metrics`` and the rest are Accelerate's.
Refused with :class:`~paramfsm.errors.ParamFSMError`: ``mixed_precision="fp16"``
(Accelerate's GradScaler would decide on each rank alone whether to skip a
step; use bf16, or ``shard_options={"param_dtype": torch.bfloat16}``) and a
DeepSpeed, FSDP or Megatron plugin (each shards the model itself).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import accelerate
import torch

import paramfsm
from paramfsm import checkpoint, optim
from paramfsm.errors import ParamFSMError

logger = logging.getLogger(__name__)

#: Sub-folder of a ``save_state`` folder holding every rank's shards of the model and the optimizer.
SHARDS_DIR = "paramfsm-shards"
#: The data loader's count of training batches, saved beside the shards (see [Note: step numbers from the data loader]).
STEPS_FILE = "paramfsm-steps.json"


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` for a model paramfsm shards; see the module docstring for what changes."""

    def __init__(self, *args, shard_options: dict | None = None, runtime=None, **kwargs):
        for plugin in ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin"):
            if kwargs.get(plugin) is not None:
                raise ParamFSMError(f"paramfsm's Accelerator takes no {plugin}: paramfsm shards the model itself; "
                                    "drop the plugin (or use accelerate.Accelerator with it, without paramfsm)")
        if kwargs.get("mixed_precision") == "fp16":
            raise ParamFSMError("paramfsm's Accelerator: mixed_precision='fp16' scales the loss with Accelerate's "
                                "GradScaler, which would decide on each rank alone whether to skip a step (the "
                                "shards would diverge); use mixed_precision='bf16', or "
                                "shard_options={'param_dtype': torch.bfloat16}")
        super().__init__(*args, **kwargs)
        if runtime is not None and shard_options:
            raise ParamFSMError("paramfsm's Accelerator: pass shard_options= (prepare shards the model) or runtime= "
                                "(a model already sharded), not both")
        self.shard_options = dict(shard_options or {})
        self.runtime = runtime
        self.trained_batches = 0

    # ------------------------------------------------------------------ prepare
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        """Shard ``model`` (once), then prepare it without DDP and without a device move."""
        if self.runtime is not None and model is not self.runtime.model:
            raise ParamFSMError(f"paramfsm's Accelerator shards one model ({type(self.runtime.model).__name__}, rank "
                                f"{self.runtime.rank}); prepare another ({type(model).__name__}) with a second "
                                "Accelerator, or make both submodules of one model")
        if self.runtime is None:
            self.runtime = self._shard(model, device_placement)
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def _shard(self, model, device_placement):
        options = dict(self.shard_options)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if self.num_processes == 1 and launched > 1:
            raise ParamFSMError(f"this process is one of {launched} (WORLD_SIZE), but Accelerate runs it alone "
                                f"(rank {os.environ.get('RANK', '?')}), so each would train its own unsharded copy: "
                                "without a GPU, pass Accelerator(cpu=True), which makes Accelerate join the processes torchrun started")
        if self.num_processes == 1 and not torch.distributed.is_initialized():
            options.setdefault("group", "single")  # a plain `python script.py`: Accelerate made no process group
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta:
            options.setdefault("device", self.device)
        elif device_placement if device_placement is not None else self.device_placement:
            model.to(self.device)
        logger.info("sharding %s on rank %d with %s", type(model).__name__, self.process_index, options)
        return paramfsm.shard(model, **options)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Accelerate's prepared loader, behind a :class:`SteppedLoader` that names each training batch's step."""
        return SteppedLoader(super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch), self)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        inner = dataloader.loader if isinstance(dataloader, SteppedLoader) else dataloader
        return SteppedLoader(super().skip_first_batches(inner, num_batches), self)

    def _name_step(self) -> None:
        """Called for every batch a prepared loader yields. [Note: step numbers from the data loader]

        No count a rank keeps of its own work can tell a step it skipped
        (``continue`` before the forward) from one it took, so the steps are
        numbered by what every rank does alike: take the next batch. A batch
        taken while the model is in training mode is batch ``n`` of the run;
        it belongs to optimizer step ``n // gradient_accumulation_steps``,
        which ``rt.set_step`` names before the batch reaches the loop. A rank
        that drops a batch still took it, so its next forward carries the next
        step and meets its peers' current one: ``RankDesync`` on every rank.
        Batches taken in evaluation mode are not counted. ``save_state``
        saves the count and ``load_state`` restores it.
        """
        rt = self.runtime
        if rt is None or not rt.model.training:
            return
        rt.set_step(self.trained_batches // max(self.gradient_accumulation_steps, 1))
        self.trained_batches += 1

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self, model):
        """Backward passes inside keep full gradients locally, for ``rt.no_sync()`` (Accelerate's own
        ``no_sync`` would do nothing for a model it did not wrap in DDP)."""
        if self.runtime is not None and model is self.runtime.model:
            with self.runtime.no_sync():
                yield
        else:
            with super().no_sync(model):
                yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The global norm over every rank's shard gradients, clipped to ``max_norm`` (``parameters`` is the
        sharded model's, as Accelerate's signature asks; the runtime clips all of them)."""
        if self.runtime is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        return self.runtime.clip_grad_norm_(max_norm, norm_type)

    # ------------------------------------------------------------------ full tensors
    def get_state_dict(self, model, unwrap=True):
        """Full tensors of the sharded model on rank 0 (CPU), ``{}`` elsewhere. Collective."""
        if self.runtime is None or model is not self.runtime.model:
            return super().get_state_dict(model, unwrap)
        return self.runtime.full_state_dict(rank0_only=True)

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, output_dir=None, safe_serialization=True, **save_model_func_kwargs):
        """Accelerate's ``save_state``, with the model and optimizers as one sharded DCP checkpoint. Collective."""
        if self.runtime is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        with self._without_models():
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        checkpoint.save(self.runtime, os.path.join(location, SHARDS_DIR), optimizer=self._one_optimizer())
        if self.is_main_process:
            with open(os.path.join(location, STEPS_FILE), "w", encoding="utf-8") as handle:
                json.dump({"trained_batches": self.trained_batches}, handle)
        self.wait_for_everyone()
        return location

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """Accelerate's ``load_state``, with the model and optimizers from the sharded DCP checkpoint. Collective."""
        if self.runtime is None:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        if input_dir is None:
            raise ParamFSMError(f"load_state: pass the folder save_state wrote (rank {self.runtime.rank})")
        shards = os.path.join(input_dir, SHARDS_DIR)
        if not os.path.isdir(shards):
            raise ParamFSMError(f"'{input_dir}' has no {SHARDS_DIR}/ (rank {self.runtime.rank}): it was not saved "
                                "by paramfsm's Accelerator; resume from a folder its save_state wrote")
        with self._without_models():
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        opt = self._one_optimizer()
        if opt is not None:
            optim.map_optimizer(opt)
        checkpoint.load(self.runtime, shards, optimizer=opt)
        with open(os.path.join(input_dir, STEPS_FILE), encoding="utf-8") as handle:
            self.trained_batches = json.load(handle)["trained_batches"]

    @contextlib.contextmanager
    def _without_models(self):
        """Accelerate's save/load code with no model or optimizer to write: the shards go through DCP."""
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def _one_optimizer(self):
        """The torch optimizer inside Accelerate's wrapper (paramfsm checkpoints one optimizer per model)."""
        if len(self._optimizers) > 1:
            raise ParamFSMError(f"save_state/load_state: {len(self._optimizers)} optimizers were prepared (rank "
                                f"{self.runtime.rank}); paramfsm checkpoints one optimizer over the model")
        if not self._optimizers:
            return None
        wrapped = self._optimizers[0]
        return getattr(wrapped, "optimizer", wrapped)


class SteppedLoader:
    """A data loader :meth:`Accelerator.prepare` returned: Accelerate's own, whose every batch is numbered first.

    Iterating it iterates Accelerate's loader (so its sharding, its end-of-data
    bookkeeping for ``gather_for_metrics`` and its checkpointed position hold
    as they are) and calls :meth:`Accelerator._name_step` before each batch
    reaches the loop. Every other attribute is the wrapped loader's
    (``len``, ``batch_size``, ``set_epoch``); ``loader`` is the wrapped loader
    itself, for code that needs a ``torch.utils.data.DataLoader``.
    """

    def __init__(self, loader, accelerator: Accelerator):
        self.loader, self.accelerator = loader, accelerator

    def __iter__(self):
        for batch in self.loader:
            self.accelerator._name_step()
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        if name in ("loader", "accelerator"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
