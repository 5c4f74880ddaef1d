"""``paramfsm plan``: the memory plan of a model on the command line, before anything is launched.

The model is a Hugging Face config (``--hf-config config.json``: built with
``AutoModelForCausalLM.from_config`` on the meta device) or a ``module:function``
that builds one (``--model``; it may return ``(model, example_input)``), called
under ``torch.device("meta")``. Nothing is allocated (see :mod:`paramfsm.planning`),
so a 70B config plans in seconds. Added to the ``paramfsm`` command line by
:mod:`paramfsm.cli` when named.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

HELP = "the peak memory per rank of each phase of a training step, before launch"


def add_parser(subparsers) -> None:
    """Add ``paramfsm plan`` to the command line."""
    parser = subparsers.add_parser("plan", help=HELP, description=HELP + ". Nothing is allocated: the model is "
                                   "built and rehearsed on the meta device.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", type=Path, metavar="CONFIG",
                        help="a Hugging Face config.json (or the folder holding one): a causal LM built from it, in float32")
    source.add_argument("--model", metavar="MODULE:FUNCTION",
                        help="a function that builds the model (or returns (model, example_input))")
    parser.add_argument("--world", type=int, required=True, metavar="N", help="the number of ranks")
    parser.add_argument("--optimizer", default="adamw",
                        help="sgd, adam, adamw, adafactor, none, or bytes of state per parameter element")
    parser.add_argument("--budget", metavar="SIZE", help="bytes per rank, such as 20GiB: does the plan fit?")
    parser.add_argument("--batch", type=int, default=1, help="--hf-config: sequences per rank (default 1)")
    parser.add_argument("--seq", type=int, default=512, help="--hf-config: tokens per sequence (default 512)")
    parser.add_argument("--param-dtype", choices=("bfloat16", "float16"), help="shard(param_dtype=...)")
    parser.add_argument("--prefetch", type=int, help="shard(prefetch=...)")
    parser.add_argument("--min-unit-bytes", type=int, metavar="BYTES", help="shard(min_unit_bytes=...)")
    parser.add_argument("--offload", metavar="SPEC", help="params=disk,optimizer=cpu,...: shard(offload=...)")
    parser.add_argument("--offload-path", metavar="DIR", help="the folder of the disk tiers (nothing is written "
                        "to it: a plan only names it)")
    parser.add_argument("--json", action="store_true", help="print plan.to_dict() as JSON instead of the table")
    parser.set_defaults(func=_plan)


def _plan(args) -> int:
    import torch

    from paramfsm.cli import CommandError
    from paramfsm.errors import ParamFSMError
    from paramfsm.planning import plan

    start = time.monotonic()
    model, example_input = _hf_model(args) if args.hf_config is not None else _built(args.model)
    options = {name: value for name, value in (
        ("param_dtype", getattr(torch, args.param_dtype) if args.param_dtype else None),
        ("prefetch", args.prefetch), ("min_unit_bytes", args.min_unit_bytes),
        ("offload", _offload(args.offload, args.offload_path) if args.offload else None)) if value is not None}
    optimizer = args.optimizer
    if optimizer == "none":
        optimizer = None
    elif optimizer.replace(".", "", 1).isdigit():
        optimizer = float(optimizer)
    try:
        result = plan(model, args.world, optimizer=optimizer, example_input=example_input, budget=args.budget,
                      **options)
    except ParamFSMError as exc:
        raise CommandError(str(exc), status=2) from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result)
        print(f"planned in {time.monotonic() - start:.1f} s, nothing allocated")
    return 0 if args.budget is None or result.fits(result.budget) else 1


def _hf_model(args):
    import torch

    from paramfsm.cli import CommandError

    try:
        import transformers
    except ImportError:
        raise CommandError("--hf-config needs transformers (pip install transformers)", status=2) from None
    path = args.hf_config
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CommandError(f"no config at {path}", status=2)
    fields = json.loads(path.read_text())
    config = transformers.AutoConfig.for_model(**fields)
    with torch.device("meta"):  # float32 shards, the master weights (--param-dtype: the compute copies)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    length = min(args.seq, getattr(config, "max_position_embeddings", args.seq) or args.seq)
    return model, {"input_ids": torch.zeros(args.batch, length, dtype=torch.long, device="meta")}


def _built(target: str):
    import torch

    from paramfsm.cli import CommandError

    module_name, _, function = target.partition(":")
    if not module_name or not function:
        raise CommandError(f"--model {target!r}: expected MODULE:FUNCTION", status=2)
    sys.path.insert(0, str(Path.cwd()))
    try:
        build = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise CommandError(f"--model {target!r}: {exc}", status=2) from None
    with torch.device("meta"):
        built = build()
    return built if isinstance(built, tuple) else (built, None)


def _offload(spec: str, path: str | None = None):
    """``params=disk,optimizer=cpu`` -> ``paramfsm.Offload(params="disk", optimizer="cpu", path=...)`` (a plan
    writes nothing to ``path``; without one, disk tiers are planned in the current folder's name)."""
    import paramfsm
    from paramfsm.cli import CommandError

    fields = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("params", "grads", "optimizer") or value.strip() not in ("cpu", "disk"):
            raise CommandError(f"--offload {spec!r}: expected params=, grads=, optimizer= each cpu or disk", status=2)
        fields[key.strip()] = value.strip()
    if "disk" in fields.values():
        fields["path"] = path or "."
    return paramfsm.Offload(**fields)
