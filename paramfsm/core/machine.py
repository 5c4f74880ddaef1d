"""The spec as a ``transitions`` Machine: diagrams, a reference for tests, and strict mode.

The Machine is built from the same validated :class:`~paramfsm.core.spec.Spec` as
the compiled table, but through an independent path (pytransitions' own
trigger/condition machinery), so a differential test can hold the two
against each other. It costs microseconds per trigger and kilobytes per
model, so it never sits on the per-parameter hot path; the runtime only uses
it in opt-in strict mode to cross-check live transitions.

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

from pathlib import Path

from transitions import Machine, MachineError

from paramfsm.core.spec import GUARDS, Spec


class MachineModel:
    """The object a transitions Machine drives: the state plus the extended state and effects."""

    def __init__(self, holds: int = 0, keep_graph: bool = False, retained: bool = False):
        self.holds = holds
        self.keep_graph = keep_graph
        self.retained = retained
        self.effects: tuple[str, ...] = ()
        self.outcome = "transition"


def _guard(model: MachineModel, name: str, negated: bool):
    def condition(*_args, **_kwargs) -> bool:
        return GUARDS[name](model.holds, model.keep_graph, model.retained) != negated

    condition.__name__ = ("not_" if negated else "") + name
    return condition


def build_machine(spec: Spec, model: MachineModel | None = None, *, graph: bool = False):
    """Return ``(machine, model)`` mirroring ``spec``.

    Transition rows become transitions; ``ignore`` rows become internal
    transitions; ``error`` rows become internal transitions whose ``before``
    callback raises :class:`transitions.MachineError`, so an error row and a
    missing row both raise.
    """
    model = model or MachineModel()
    rows = []
    for rule in spec.rules:
        conditions = [_guard(model, name, neg) for name, neg in rule.when]
        row = {"trigger": rule.event, "source": rule.src, "conditions": conditions}
        if rule.kind == "transition":
            row["dest"] = rule.dst
            row["after"] = [_apply(model, rule)]
        else:
            row["dest"] = None
            row["before"] = [_mark(model, rule)]
        rows.append(row)
    kwargs = dict(model=model, states=list(spec.states), initial=spec.initial, transitions=rows,
                  auto_transitions=False, send_event=False, ignore_invalid_triggers=False)
    if graph:
        from transitions.extensions import GraphMachine

        machine = GraphMachine(graph_engine="mermaid", show_conditions=True, title=spec.name, **kwargs)
    else:
        machine = Machine(**kwargs)
    return machine, model


def _apply(model: MachineModel, rule):
    def after(*_args, **_kwargs) -> None:
        model.outcome = "transition"
        model.effects = rule.effects
        if rule.holds == "+1":
            model.holds += 1
        elif rule.holds == "-1":
            model.holds -= 1
        elif rule.holds == "0":
            model.holds = 0

    return after


def _mark(model: MachineModel, rule):
    def before(*_args, **_kwargs) -> None:
        model.effects = ()
        model.outcome = rule.kind
        if rule.kind == "error":
            raise MachineError(f"{rule.entry}: {rule.reason}")

    return before


def draw_mermaid(spec: Spec, path: str | Path | None = None) -> str:
    """Render the spec as a mermaid state diagram; write it to ``path`` when given."""
    machine, model = build_machine(spec, graph=True)
    text = model.get_graph().draw(None)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


class CrossCheckedStep:
    """A drop-in for :func:`paramfsm.core.fsm.step` that replays every live step on the Machine.

    Used by ``paramfsm.shard(..., strict=True)``: before the compiled table
    moves a record, the same (state, event, extended state) is triggered on
    one shared transitions Machine, and the two must agree on the outcome,
    the destination, the effects and the hold count. A disagreement means
    the compiled table and the spec diverged; it raises ``AssertionError``
    naming both answers. This costs microseconds per step and is opt-in.
    :meth:`many` does the same for each record of a batched step
    (:func:`paramfsm.core.fsm.step_many`), so strict mode sees every transition.
    """

    def __init__(self, spec: Spec, step_fn, step_many_fn=None):
        self._machine, self._model = build_machine(spec)
        self._step = step_fn
        self._step_many = step_many_fn

    def _expected(self, state: str, holds: int, event: str, keep_graph, retained):
        """The Machine's answer: (state, effects, holds) after ``event``, or "error"."""
        model, machine = self._model, self._machine
        machine.set_state(state, model)
        model.holds, model.keep_graph, model.retained = holds, bool(keep_graph), bool(retained)
        model.effects = ()
        try:
            model.trigger(event)
        except MachineError:
            return "error"
        return model.state, tuple(model.effects), model.holds

    def many(self, table, records, event, ctx, keep_graph=False, retained=False):
        """The same cross-check for :func:`paramfsm.core.fsm.step_many`, record by record.

        When ``step_many`` declines (records in different situations, None), the
        caller steps them one by one through :meth:`__call__`, checked there.
        """
        before = [(rec.state, rec.holds) for rec in records]
        expected = [self._expected(state.name, holds, event, keep_graph, retained) for state, holds in before]
        try:
            effects = self._step_many(table, records, event, ctx, keep_graph, retained)
        except Exception:
            if expected[0] != "error":
                raise AssertionError(f"strict: the compiled table raised for '{event}' in {before[0][0].name} "
                                     f"on '{records[0].name}', the spec's Machine says {expected[0]}") from None
            raise
        if effects is None:
            return None
        for rec, (src, holds), want in zip(records, before, expected):
            got = (rec.state.name, tuple(effects), rec.holds)
            if got != want:
                raise AssertionError(f"strict: '{event}' in {src.name} (holds={holds}, keep_graph={keep_graph}, "
                                     f"retained={retained}) on '{rec.name}': compiled {got}, Machine {want}")
        return effects

    def __call__(self, table, rec, event, ctx, keep_graph=False, retained=False):
        src, holds = rec.state, rec.holds
        expected = self._expected(src.name, holds, event, keep_graph, retained)
        try:
            effects = self._step(table, rec, event, ctx, keep_graph, retained)
        except Exception:
            if expected != "error":
                raise AssertionError(f"strict: the compiled table raised for '{event}' in {src.name} on "
                                     f"'{rec.name}', the spec's Machine says {expected}") from None
            raise
        got = (rec.state.name, tuple(effects), rec.holds)
        if got != expected:
            raise AssertionError(f"strict: '{event}' in {src.name} (holds={holds}, keep_graph={keep_graph}, "
                                 f"retained={retained}) on '{rec.name}': compiled {got}, Machine {expected}")
        return effects
