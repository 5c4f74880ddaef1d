"""``paramfsm.plan``: the peak bytes per rank of each phase, before launch, and the bound it keeps in training.

The plan rehearses two steps of the model's meta twin on a fake process group; a real run on gloo ranks,
counted the same way (``paramfsm.planning.measure.peaks``), must stay at or under the plan in every phase,
and the plan within 1.15x of it. The prefetch depth and the bucket size are part of both (a plan that
ignored ``prefetch=2`` would fall under the measured forward peak).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paramfsm
from paramfsm.errors import ArgumentError, ParamFSMError
from paramfsm.planning.measure import measured_steps
from paramfsm.planning.rehearsal import tensors_of
from paramfsm.planning.rehearsal import KINDS, PHASES, TIER_KINDS
from paramfsm.testing.models import mlp

WIDTH, DEPTH, BATCH = 256, 6, 4
#: The plan may hold at most this much over the measured peak of a phase.
TIGHT = 1.15


def stack() -> nn.Module:
    """Linear layers large enough to be units of their own (256 KiB each), as benchmarks/memory.py's stack."""
    return mlp(width=WIDTH, depth=DEPTH, d_in=WIDTH, d_out=WIDTH)


def llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


MODELS = {"stack": (stack, lambda device: torch.ones(BATCH, WIDTH, device=device)),
          "llama": (llama, lambda device: {"input_ids": torch.ones(BATCH, 16, dtype=torch.long, device=device)})}


def _meta(name: str):
    build, example = MODELS[name]
    with torch.device("meta"):
        model = build()
    return model, example("meta")


def test_a_plan_gives_each_phase_its_peak_by_kind_and_where_it_is_reached():
    model, x = _meta("stack")
    plan = paramfsm.plan(model, 4, bucket_bytes=1, example_input=x)
    assert [p.phase for p in plan.phases] == list(PHASES)
    shards = plan.phase("init").kinds["shards"]
    assert shards == sum(-(-p.numel() // 4) * 4 for p in model.parameters())  # every shard, padded, fp32
    for peak in plan.phases:
        assert set(peak.kinds) == set(KINDS + TIER_KINDS) and peak.total == sum(peak.kinds[k] for k in KINDS), peak
    forward = plan.phase("forward")
    assert forward.kinds["gathered"] + forward.kinds["inflight"] >= 2 * WIDTH * WIDTH * 4, forward  # prefetched
    assert forward.unit and forward.event, forward
    step = plan.phase("step")
    assert step.kinds["optimizer_state"] >= 2 * shards and step.kinds["shard_grads"] == shards, step  # AdamW
    assert plan.activations and plan.activations_source.startswith("saved for backward")
    assert plan.peak == plan.with_activations(max(plan.phases, key=plan.with_activations))
    assert plan.gathered_bytes and plan.reduced_bytes
    report = json.loads(json.dumps(plan.to_dict()))
    assert report["phases"]["backward"]["total"] == plan.phase("backward").total and report["peak"] == plan.peak
    text = str(plan)
    assert "forward" in text and "peak:" in text and "activations:" in text, text


def test_a_plan_changes_nothing_and_leaves_no_process_group():
    torch.manual_seed(0)
    model = stack()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    plan = paramfsm.plan(model, 2, example_input=torch.ones(BATCH, WIDTH, device="meta"), optimizer="sgd")
    assert not dist.is_initialized()
    after = dict(model.named_parameters())
    assert all(after[n] is p and torch.equal(p, v) for n, (p, v) in before.items())
    assert plan.phase("step").kinds["optimizer_state"] == plan.phase("init").kinds["shards"]  # one momentum buffer


def test_a_real_example_input_is_rehearsed_as_its_meta_twin():
    model = stack()
    on_host = paramfsm.plan(model, 2, example_input=torch.ones(BATCH, WIDTH), optimizer="sgd")
    on_meta = paramfsm.plan(model, 2, example_input=torch.ones(BATCH, WIDTH, device="meta"), optimizer="sgd")
    assert on_host.activations and on_host.activations == on_meta.activations
    assert [peak.total for peak in on_host.phases] == [peak.total for peak in on_meta.phases]


def test_a_budget_says_whether_the_plan_fits_and_what_to_move_when_it_does_not():
    model, x = _meta("stack")
    plan = paramfsm.plan(model, 2, example_input=x, budget="1GiB")
    assert plan.fits("1GiB") and plan.budget == 1 << 30 and "fits" in str(plan)
    small = paramfsm.plan(model, 2, example_input=x, budget=plan.peak - 1)
    assert not small.fits(small.budget) and small.to_dict()["fits"] is False
    assert "1 B over" in str(small) and "What to do:" in str(small) and "Offload(optimizer='cpu'" in str(small)
    found = small.placement  # the least costly placement that fits, rehearsed like the plan
    assert found["fits"] and found["peak"] <= small.budget and found["placement"] in str(small), found
    tight = paramfsm.plan(model, 2, example_input=x, budget=plan.phase("init").total)
    assert tight.placement["fits"] is False and tight.placement["over"] > 0 and "No placement tried fits" in str(tight)


def test_options_a_plan_cannot_rehearse_are_refused_not_guessed():
    model, x = _meta("stack")
    with pytest.raises(ParamFSMError, match="does not rehearse group"):
        paramfsm.plan(model, 2, example_input=x, group=object())
    with pytest.raises(ArgumentError, match="2-D mesh"):
        paramfsm.plan(model, 2, example_input=x, mesh=(2, 2))
    with pytest.raises(ArgumentError, match="unknown option"):
        paramfsm.plan(model, 2, example_input=x, prefetch_depth=2)
    with pytest.raises(ArgumentError, match="world_size"):
        paramfsm.plan(model, example_input=x)
    with pytest.raises(ArgumentError, match="optimizer"):
        paramfsm.plan(model, 2, example_input=x, optimizer="lion")


class HeadFirst(nn.Module):
    """Its first module holding parameters is not the first its forward runs: a guessed input does not fit."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)
        self.body = nn.Linear(16, 8)

    def forward(self, x):
        return self.head(self.body(x))


def test_without_an_example_input_forward_and_backward_are_not_rehearsed_and_the_plan_says_so():
    with torch.device("meta"):
        model = HeadFirst()
    plan = paramfsm.plan(model, 2, optimizer=8)
    assert [p.phase for p in plan.phases] == ["init", "step", "checkpoint"]
    assert plan.phase("step").kinds["optimizer_state"] == 2 * plan.phase("init").kinds["shards"]
    assert plan.activations is None and "example_input" in str(plan)


def test_a_model_whose_first_layer_is_linear_is_planned_on_a_guessed_batch_of_one():
    model, _ = _meta("stack")
    plan = paramfsm.plan(model, 2, bucket_bytes=1)
    given = paramfsm.plan(model, 2, bucket_bytes=1, example_input=torch.empty(1, WIDTH, device="meta"))
    assert [p.phase for p in plan.phases] == list(PHASES)
    assert [p.total for p in plan.phases] == [p.total for p in given.phases]
    assert f"guessed input of shape (1, {WIDTH})" in plan.activations_source, plan.activations_source


def measured_job(rank, world, name, options):
    """A model built on the meta device, sharded and initialised, then two training steps, counted by phase as
    the plan counts them (the plan's init phase is shard() and rt.init_weights() of a meta build too)."""
    build, example = MODELS[name]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build()
    if isinstance(options.get("mesh"), tuple):  # a hybrid mesh's shape, as the plan takes it
        from torch.distributed.device_mesh import init_device_mesh

        options = dict(options, mesh=init_device_mesh("cpu", options["mesh"]))
    rt = paramfsm.shard(model, **options)
    found = measured_steps(rt, model, example("cpu"))
    rt.close()
    return found


def peak_memory_job(rank, world, name, options):
    """:func:`measured_job`'s steps with no phase marked by hand: ``rt.reset_peak_memory()`` and the runtime's
    own ``rt.peak_memory()``."""
    build, example = MODELS[name]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build()
    rt = paramfsm.shard(model, **options)
    rt.reset_peak_memory()
    rt.init_weights(getattr(model, "_init_weights", None))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        out = model(**example("cpu")) if name == "llama" else model(example("cpu"))
        torch.stack([t.float().mean() for t in tensors_of(out)]).sum().backward()
        opt.step()
        opt.zero_grad()
    found = {phase: peak["total"] for phase, peak in rt.peak_memory().items()}
    held = rt.memory()
    rt.close()
    return found, held


CASES = [pytest.param("stack", {"bucket_bytes": 1, "prefetch": 1}, id="stack-prefetch1"),
         pytest.param("stack", {"bucket_bytes": 1, "prefetch": 2}, id="stack-prefetch2"),
         pytest.param("stack", {}, id="stack-defaults"),
         pytest.param("llama", {}, id="llama-defaults"),
         pytest.param("stack", {"offload": paramfsm.Offload(params="cpu", grads="cpu", optimizer="cpu")},
                      id="stack-offload-cpu"),
         pytest.param("llama", {"offload": paramfsm.Offload(optimizer="disk", path="DISK")}, id="llama-offload-disk")]


def _on_disk(options: dict, folder) -> dict:
    """``options`` with an Offload's ``path="DISK"`` placeholder set to ``folder``."""
    offload = options.get("offload")
    if offload is None or offload.path != "DISK":
        return options
    import attrs

    return dict(options, offload=attrs.evolve(offload, path=str(folder)))


def _bounds(plan, results) -> None:
    for peak in plan.phases:
        if peak.phase == "checkpoint":
            continue  # the measured loop zeroes the gradients there; the plan's checkpoint phase keeps them
        measured = max(result[peak.phase] for result in results)
        assert measured <= peak.total <= TIGHT * measured, (peak.phase, peak.total, measured)


@pytest.mark.slow
@pytest.mark.parametrize("name,options", CASES)
def test_the_plan_bounds_every_phase_of_two_real_ranks(ranks2, name, options, tmp_path):
    options = _on_disk(options, tmp_path)
    model, x = _meta(name)
    _bounds(paramfsm.plan(model, 2, example_input=x, **options), ranks2.run(measured_job, name, options, timeout=120))


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [CASES[2], CASES[4], CASES[5]])
def test_the_runtime_keeps_its_plan_in_every_phase_it_counts_itself(ranks2, name, options, tmp_path):
    options = _on_disk(options, tmp_path)
    model, x = _meta(name)
    results = ranks2.run(peak_memory_job, name, options, timeout=120)
    assert all(set(found) == {"init", "forward", "backward", "step"} for found, _ in results), results
    for found, held in results:
        assert all(held[f"peak_{phase}"] == total for phase, total in found.items())
    _bounds(paramfsm.plan(model, 2, example_input=x, **options), [found for found, _ in results])


@pytest.mark.slow
@pytest.mark.parametrize("name,options", CASES[1:2] + CASES[5:])
def test_the_plan_bounds_every_phase_of_three_real_ranks(ranks3, name, options, tmp_path):
    options = _on_disk(options, tmp_path)
    model, x = _meta(name)
    _bounds(paramfsm.plan(model, 3, example_input=x, **options), ranks3.run(measured_job, name, options, timeout=120))


@pytest.mark.slow
def test_the_plan_bounds_every_phase_of_a_hybrid_mesh(ranks4):
    """Two replicas of two shards each: a plan takes the mesh's shape, (replicas, shards)."""
    model, x = _meta("stack")
    options = {"mesh": (2, 2), "bucket_bytes": 1}
    plan = paramfsm.plan(model, 4, example_input=x, **options)
    assert plan.phase("init").kinds["shards"] == paramfsm.plan(model, 2, example_input=x).phase("init").kinds["shards"]
    _bounds(plan, ranks4.run(measured_job, "stack", options, timeout=120))


def planned_in_job(rank, world):
    model, x = _meta("stack")
    return paramfsm.plan(model, example_input=x, bucket_bytes=1).to_dict()


@pytest.mark.slow
def test_a_plan_inside_a_job_runs_apart_and_says_the_same(ranks2):
    model, x = _meta("stack")
    here = paramfsm.plan(model, 2, example_input=x, bucket_bytes=1).to_dict()
    for found in ranks2.run(planned_in_job, timeout=180):
        assert found["phases"] == here["phases"] and found["world_size"] == 2


@pytest.mark.slow
def test_the_command_line_plans_a_hugging_face_config(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 256, "max_position_embeddings": 64}))
    run = lambda *args: subprocess.run([sys.executable, "-m", "paramfsm", "plan", "--hf-config", str(config),  # noqa: E731
                                        "--world", "4", *args], capture_output=True, text=True, timeout=300)
    shown = run("--seq", "32")
    assert shown.returncode == 0, shown.stderr
    assert "world size 4" in shown.stdout and "backward" in shown.stdout and "nothing allocated" in shown.stdout
    over = run("--budget", "1KiB", "--json")
    assert over.returncode == 1, over.stderr
    assert json.loads(over.stdout)["fits"] is False


def budget_job(rank, world, peak):
    """shard(memory_budget=) one byte under the plan's peak; the refused call changes nothing; then rt.plan()."""
    torch.manual_seed(0)
    model = stack()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        paramfsm.shard(model, memory_budget=peak - 1)
        refused = None
    except ParamFSMError as exc:
        refused = str(exc)
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    rt = paramfsm.shard(model)  # (a budget at the peak fits: test_a_budget_says_...)
    live = rt.plan().to_dict()
    rt.close()
    return refused, unchanged, live


@pytest.mark.slow
def test_shard_refuses_a_memory_budget_its_plan_exceeds_before_changing_anything(ranks2):
    """A model with no example input: the plan feeds its first Linear a guessed batch, and the refusal says so."""
    twin, _ = _meta("stack")
    planned = paramfsm.plan(twin, 2).to_dict()
    for refused, unchanged, live in ranks2.run(budget_job, planned["peak"], timeout=300):
        assert refused is not None and "memory_budget=" in refused and "1 B over" in refused, refused
        assert "nothing was changed" in refused and "What to do:" in refused, refused
        assert "guessed input of shape (1, 256)" in refused, refused  # the table, activations line included
        assert unchanged, "the refused shard() changed the model"
        assert live["phases"] == planned["phases"], "rt.plan() differs from the plan of the model it shards"


def test_the_command_lines_offload_spec_reads_each_tier_and_refuses_anything_else():
    from paramfsm.cli import CommandError
    from paramfsm.planning.command import _offload

    assert _offload("params=cpu,optimizer=cpu") == paramfsm.Offload(params="cpu", optimizer="cpu")
    with pytest.raises(CommandError, match="--offload"):
        _offload("optimizer=tape")


def agreeing_job(rank, world):
    """After every transition of two real steps, the sampler's running totals against rt.memory()'s count."""
    from paramfsm.sharding import memory
    from paramfsm.planning.sampler import Sampler

    torch.manual_seed(0)
    model = stack()
    rt = paramfsm.shard(model, bucket_bytes=1, prefetch=2)
    opt = torch.optim.AdamW(model.parameters())
    differ = []

    class Checking(Sampler):
        def sample(self, unit=None, event=None):
            super().sample(unit, event)
            counted, held = self.counted(), memory.memory(rt)
            for kind in ("shards", "shard_grads", "gathered", "inflight", "deferred", "unsynced_grads"):
                if counted[kind] != held[kind]:
                    differ.append((self.last, kind, counted[kind], held[kind]))

    ctx = rt.scheduler.ctx
    ctx.trace = checking = Checking(rt, ctx.trace, optimizer=opt)
    for _ in range(2):
        model(torch.ones(BATCH, WIDTH)).mean().backward(retain_graph=False)
        checking.sample("", "backward end")
        opt.step()
        opt.zero_grad()
    ctx.trace = checking.trace
    rt.close()
    return differ[:5], len(checking.peaks)


@pytest.mark.slow
def test_the_samplers_running_totals_agree_with_rt_memory_after_every_transition(ranks2):
    for differ, phases in ranks2.run(agreeing_job, timeout=120):
        assert differ == [] and phases == 1, differ


@pytest.mark.slow
def test_the_command_line_plans_a_model_a_function_builds_with_its_offload(tmp_path):
    (tmp_path / "my_models.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef build():\n"
        "    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))\n"
        "    return model, torch.empty(8, 256, device='meta')\n")
    shown = subprocess.run([sys.executable, "-m", "paramfsm", "plan", "--model", "my_models:build", "--world", "2",
                            "--offload", "params=cpu,optimizer=cpu", "--json"], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    found = json.loads(shown.stdout)
    assert set(found["phases"]) == set(PHASES) and found["traffic_per_step"]["offload_tiers"] > 0, found
    shards = 4 * 256 * 257 * 4 // 2  # every Linear's weight and bias, fp32, half per rank
    assert found["phases"]["init"]["kinds"]["tier_cpu"] == shards, found
    assert found["phases"]["checkpoint"]["kinds"]["tier_cpu"] >= 3 * shards, found  # and AdamW's two moments
    missing = subprocess.run([sys.executable, "-m", "paramfsm", "plan", "--model", "my_models", "--world", "2"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert missing.returncode == 2 and "MODULE:FUNCTION" in missing.stderr, missing.stderr
