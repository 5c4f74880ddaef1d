"""Lightning on a model sharded by paramfsm: :class:`ParamFSMStrategy`.

A ``LightningModule`` trains sharded with one changed argument::

    from paramfsm.integrations.lightning import ParamFSMStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ParamFSMStrategy(),
                        precision="bf16-mixed", gradient_clip_val=1.0, accumulate_grad_batches=2)
    trainer.fit(module, train_loader, val_loader, ckpt_path=None)

It follows Lightning's ``ModelParallelStrategy`` (one process per device,
launched by Lightning or by torchrun; ``configure_model`` on the meta device)
and its ``FSDPStrategy`` (the whole ``LightningModule`` is the sharded root):

* **configure_model** runs under ``torch.device("meta")``: layers built there
  allocate nothing, and :func:`paramfsm.shard` gives each rank its shards on
  the strategy's device, filled by ``rt.init_weights()`` (``reset_parameters``
  module by module, what plain torch runs at construction). A module whose
  parameters were all built in ``__init__`` is sharded as it is. One with some
  parameters on meta and others not is refused, naming both.
* **The steps** (``training_step``, ``validation_step``, ``test_step``,
  ``predict_step``) run as the forward of the sharded root, so the root's
  own parameters (and every small layer merged into it) are gathered for
  them; ``self(x)`` inside is an ordinary nested call.
* **Optimizers** from ``configure_optimizers`` over ``self.parameters()``
  step the shards (:mod:`paramfsm.optim`).
* **gradient_clip_val** with the norm algorithm clips by the global norm
  (``rt.clip_grad_norm_``); the value algorithm clips each shard's elements.
* **accumulate_grad_batches** runs the micro-batches before the last under
  ``rt.no_sync()``: one reduce-scatter per optimizer step.
* **precision**: ``"32-true"`` and ``"bf16-mixed"`` (autocast). Refused:
  ``"16-mixed"`` (Lightning's GradScaler decides per rank whether to skip a
  step) and the ``-true`` half precisions (they cast the module itself; pass
  ``shard_options={"param_dtype": torch.bfloat16}`` instead).
* **Checkpoints.** ``trainer.save_checkpoint(path)`` and ``ModelCheckpoint``
  write a folder: the model's and the optimizer's shards as a sharded DCP
  checkpoint (:func:`paramfsm.checkpoint.save`, atomic, reloadable at any
  world size) and Lightning's own state (loops, callbacks, schedulers) as
  ``meta.pt`` inside it, in the same atomic swap. ``ckpt_path=`` resumes from
  such a folder.
* **Step numbers.** Before every training batch, ``rt.set_step`` names the
  optimizer step it belongs to, numbered by the batch's place in the data
  (see [Note: step numbers from the place in the data]), so a rank that
  skips batches raises ``RankDesync`` on every rank.

``strategy.runtime`` is the :class:`~paramfsm.runtime.Runtime`. It lives as
long as the strategy: a later ``trainer.validate`` or ``fit`` with the same
module reuses it, and ``strategy.runtime.close()`` returns the plain model.
"""

from __future__ import annotations

import contextlib
import io
import logging
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import paramfsm
from paramfsm import checkpoint, optim
from paramfsm.errors import ParamFSMError

logger = logging.getLogger(__name__)

#: Lightning's state beside the shards, under the name Lightning gives it in a sharded checkpoint folder.
META_FILE = "meta.pt"


class ParamFSMStrategy(ParallelStrategy):
    """Shards the ``LightningModule`` with :func:`paramfsm.shard`; see the module docstring.

    ``shard_options``: keyword arguments of :func:`paramfsm.shard` (``units``,
    ``param_dtype``, ``offload``, ...; ``device`` is the strategy's).
    ``process_group_backend``: None picks gloo on the CPU and NCCL on CUDA.
    """

    strategy_name = "paramfsm"

    def __init__(self, shard_options: dict | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **kwargs) -> None:
        super().__init__(**kwargs)
        options = dict(shard_options or {})
        if "device" in options:
            raise ParamFSMError("ParamFSMStrategy(shard_options={'device': ...}): the strategy shards onto its "
                                "own device (Trainer(accelerator=..., devices=...)); drop 'device'")
        self.shard_options = options
        self.runtime = None
        self.num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    # ------------------------------------------------------------------ processes
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ the model
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        with torch.device("meta") if empty_init else contextlib.nullcontext(), \
                self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self):
        """``configure_model`` builds on the meta device: nothing is allocated until :meth:`setup` shards it."""
        with torch.device("meta"):
            yield

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        self._check_precision()
        module = self.lightning_module
        if self.runtime is None or self.runtime.model is not module:
            self.runtime = self._shard(module)
        self.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _shard(self, module):
        placed = {name: p.device.type for name, p in module.named_parameters()}
        on_meta = [name for name, kind in placed.items() if kind == "meta"]
        if on_meta and len(on_meta) < len(placed):
            real = next(name for name, kind in placed.items() if kind != "meta")
            raise ParamFSMError(
                f"ParamFSMStrategy (rank {self.global_rank}): '{on_meta[0]}' of {type(module).__name__} was built "
                f"in configure_model (on the meta device) but '{real}' was built in __init__ (on "
                f"{placed[real]}), so neither way of sharding fits both. What to do: build every layer in "
                "configure_model, or every layer in __init__")
        options = dict(self.shard_options)
        if on_meta:
            options["device"] = self.root_device
        else:
            module.to(self.root_device)
        logger.info("sharding %s on rank %d with %s", type(module).__name__, self.global_rank, options)
        rt = paramfsm.shard(module, **options)
        if on_meta:
            rt.init_weights()
        return rt

    def model_to_device(self) -> None:
        """The shards are on the strategy's device from :meth:`setup` on; moving the model would move nothing."""

    # ------------------------------------------------------------------ precision and clipping
    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        name = getattr(plugin, "precision", "32-true")
        fine = type(plugin) is Precision or (type(plugin) is MixedPrecision and plugin.scaler is None)
        if not fine:
            raise ParamFSMError(
                f"ParamFSMStrategy (rank {self.global_rank}): precision={name!r} is not supported. "
                + ("Lightning's GradScaler would decide on each rank alone whether to skip a step, so the "
                   "shards would diverge. " if name == "16-mixed" else "It converts the module itself. ")
                + "What to do: use precision='bf16-mixed' or '32-true', or shard in low precision with "
                  "ParamFSMStrategy(shard_options={'param_dtype': torch.bfloat16})")
        plugin.clip_grad_by_norm = self._clip_grad_by_norm  # [Note: clipping by the global norm]

    def _clip_grad_by_norm(self, optimizer, clip_val) -> None:
        """[Note: clipping by the global norm]

        Lightning's precision plugin clips ``optimizer``'s parameters with
        ``torch.nn.utils.clip_grad_norm_``. Once the optimizer has stepped, those
        are this rank's shards, whose norm is only this rank's part of the
        norm: every rank would scale by a different factor, silently. So the
        strategy's plugin clips through ``rt.clip_grad_norm_`` (the norm over
        every rank's shards, one small collective) instead; the value algorithm
        clips elementwise and is right on shards as it is.
        """
        self.runtime.clip_grad_norm_(float(clip_val))

    # ------------------------------------------------------------------ the loop
    def _as_root_forward(self, method: str, *args, **kwargs):
        """``module.<method>(...)`` run as the forward of the sharded root.

        [Note: a step is the root's forward]
        Lightning calls ``training_step`` itself, never ``module(...)``, so the
        root's forward hooks would not run: the parameters of the root unit
        (the module's own, and the small layers merged into it) would stay
        ungathered. The step is run as ``module(*args)`` with ``forward``
        pointing at the step for that one call (Lightning's own strategies do
        the same through their wrapper module). The step's own ``self(x)``
        finds the real ``forward`` again: the patch is undone as the step
        starts.
        """
        module = self.lightning_module
        step = getattr(module, method)
        before = module.__dict__.get("forward")  # an instance forward (a compiled one) is put back

        def forward(*call_args, **call_kwargs):
            self._restore_forward(module, before)
            return step(*call_args, **call_kwargs)

        module.forward = forward
        try:
            return module(*args, **kwargs)
        finally:
            self._restore_forward(module, before)

    @staticmethod
    def _restore_forward(module, before) -> None:
        if before is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = before

    def training_step(self, *args, **kwargs):
        with self.precision_plugin.train_step_context():
            return self._as_root_forward("training_step", *args, **kwargs)

    def validation_step(self, *args, **kwargs):
        with self.precision_plugin.val_step_context():
            return self._as_root_forward("validation_step", *args, **kwargs)

    def test_step(self, *args, **kwargs):
        with self.precision_plugin.test_step_context():
            return self._as_root_forward("test_step", *args, **kwargs)

    def predict_step(self, *args, **kwargs):
        with self.precision_plugin.predict_step_context():
            return self._as_root_forward("predict_step", *args, **kwargs)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """Name the optimizer step this batch belongs to, by its place in the data.

        [Note: step numbers from the place in the data]
        ``trainer.global_step`` counts the optimizer steps this rank took, and
        no count of a rank's own work tells a step it skipped from one it took:
        a rank that skips one and takes the next would carry the number its
        peers carry for the one it skipped, and the two would silently pair.
        So a batch is numbered by where it is in the data, which every rank
        walks alike: batch ``batch_idx`` of epoch ``e`` is at
        ``e * trainer.num_training_batches + batch_idx`` (the count of batches
        taken when the loader has no length), and belongs to optimizer step
        ``place // accumulate_grad_batches``. Without skips that is
        ``trainer.global_step`` whenever an epoch is a whole number of
        accumulation windows. A rank that skips the rest of an epoch
        (``on_train_batch_start`` returning -1) or a batch then carries a
        number its peers do not: ``RankDesync`` on every rank.
        """
        trainer = self.lightning_module.trainer
        per_epoch = trainer.num_training_batches
        if per_epoch == float("inf"):
            place = trainer.fit_loop.total_batch_idx
        else:
            place = trainer.current_epoch * int(per_epoch) + batch_idx
        self.runtime.set_step(place // max(trainer.accumulate_grad_batches, 1))

    @contextlib.contextmanager
    def block_backward_sync(self):
        """The backward passes of the micro-batches before the last keep their gradients (``rt.no_sync()``)."""
        with self.runtime.no_sync():
            yield

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards and the optimizer must exist before a checkpoint is read into them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint reads the optimizer's shards itself

    def lightning_module_state_dict(self) -> dict:
        """The model as this rank's DTensor shards (what DCP saves), never gathered whole."""
        return self.runtime.sharded_state_dict()

    def optimizer_state(self, optimizer) -> dict:
        return {}  # written by save_checkpoint with the model's shards (paramfsm.checkpoint)

    def save_checkpoint(self, checkpoint_dict: dict, filepath, storage_options=None) -> None:
        """The shards as a sharded DCP checkpoint folder at ``filepath``, Lightning's state in it. Collective."""
        if storage_options is not None:
            raise ParamFSMError("ParamFSMStrategy.save_checkpoint(storage_options=...) is not supported: the "
                                "shards are written by paramfsm.checkpoint, not by a CheckpointIO")
        path = Path(self.broadcast(str(filepath)))
        rest = {key: value for key, value in checkpoint_dict.items() if key not in ("state_dict", "optimizer_states")}
        buffer = io.BytesIO()
        if self.is_global_zero:
            torch.save(rest, buffer)
        checkpoint.save(self.runtime, path, optimizer=self._one_optimizer(),
                        extra_files={META_FILE: buffer.getvalue()} if self.is_global_zero else None)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Read the shards (and the optimizer's, when fitting) from a folder :meth:`save_checkpoint` wrote;
        returns Lightning's state. Collective."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / META_FILE).is_file():
            raise ParamFSMError(f"ckpt_path='{path}' (rank {self.global_rank}) has no {META_FILE}: it was not saved "
                                "by ParamFSMStrategy. What to do: resume from a folder its save_checkpoint wrote")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        opt = self._one_optimizer() if fitting else None
        if opt is not None:
            optim.map_optimizer(opt)
        checkpoint.load(self.runtime, path, optimizer=opt)
        return torch.load(path / META_FILE, map_location="cpu", weights_only=bool(weights_only))

    def load_model_state_dict(self, checkpoint_dict, strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` has read the shards."""

    def load_optimizer_state_dict(self, checkpoint_dict) -> None:
        """Nothing: :meth:`load_checkpoint` has read the optimizer's shards."""

    def _one_optimizer(self):
        if len(self.optimizers) > 1:
            raise ParamFSMError(f"ParamFSMStrategy checkpoints one optimizer over the model; configure_optimizers "
                                f"returned {len(self.optimizers)} (rank {self.global_rank})")
        return self.optimizers[0] if self.optimizers else None

    def teardown(self) -> None:
        """Lightning's teardown; the runtime stays (see the module docstring)."""
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
