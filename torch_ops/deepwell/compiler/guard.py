"""Run-time guardrails of the backend's quantized GEMM sites (option `fallback`, interval and
threshold from option `guardrails`): the compiled-graph twin of deepwell.Linear's
(nn/guardrails.py), with the same Rust rule (`guardrail_check`) and the same records
(`deepwell.policy_report()`).

What the backend returns for a graph with quantized sites, under fallback "safe" or "error", is a
`GuardedGraph`: a callable holding the graph's Inductor compilation (`plain`) and, from its first
statistics call on, a second one (`observed`) whose quantized sites also reduce their input and
output (non-finite counts, NaN-propagating amax: `site_stats`) into one float64 [sites, 4] tensor
returned as an extra graph output. Every `interval`-th call runs `observed`, queues the copy of
that tensor to pinned host memory behind the step's work and records a CUDA event; the host reads
it (and applies the rule per site) at the next statistics call, or at once with `poll(block=True)`.
So the other calls cost one counter and one comparison, the training loop never waits for the
device, and a fallback takes effect at most `2 * interval` calls after the event.

A site that trips the rule falls back to bf16 for the whole process: its record (one per weight
parameter, `RECORDS`) runs bf16 from then on and names the call and why, a warning says so, and
every guarded graph computing with that weight (this graph, its eval-mode twin, a graph Dynamo
compiles later) is planned again with the site bf16 (the decision's rule is "Guardrail") and
compiled again, at its next call. fallback="error" raises instead. The Trainer's checkpoints keep
the fallen-back sites by parameter name (`fallback_state`, `restore_fallbacks`), so a resumed run
starts with them bf16.

Saturation is not counted (the rule gets `saturated = 0`): the recipes the backend runs derive each
scale from the tensor's current amax, so nothing clips by construction (nn/guardrails.py `_clipped`),
where a deepwell.Linear's counter exists for a stale scale.

Compiling later. Both later compilations (`observed`, and `plain` after a fallback) start from a
copy of the graph Dynamo handed the backend, made before rewriting, and run `compile_fx` on its
placeholders' fake values inside Dynamo's tracing context of the first compilation (kept alive by
the graph): a graph with symbolic shapes stays symbolic, and no real input is kept. They run the
same ops as the first compilation (plus reductions, or a bf16 GEMM for a deepwell op), so they add
no guard Dynamo would have to check.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..core.policy import LayerDecision
from ..nn.guardrails import GuardrailConfig, LayerRecord, check, register
from ..ops.fp8_tensor import amax_of
from ..plan.options import Fallback

#: weight parameter -> the record of the quantized site(s) computing with it: planned recipe and
#: why, the recipe it runs, each fallback. Keyed by identity and weakly: a model's records die with it.
RECORDS = WeakIdKeyDictionary()
#: Bumped whenever a record's running recipe changes; a graph built at another value checks its sites.
_VERSION = [0]
#: Every guarded graph alive (`graphs_of`).
GRAPHS: weakref.WeakSet = weakref.WeakSet()


def version() -> int:
    """Changes whenever a compiled site's running recipe changes (a fallback, a restored checkpoint)."""
    return _VERSION[0]


def site_stats(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """float64 [input_nonfinite, output_nonfinite, amax_input, amax_output] of one site's call (a
    graph node of the observed variant; amax NaN-propagating, as the rule expects)."""
    x, y = x.detach(), y.detach()
    return torch.stack([
        (~torch.isfinite(x)).sum().double(), (~torch.isfinite(y)).sum().double(),
        amax_of(x).double(), amax_of(y).double(),
    ])


def add_stats_output(gm: torch.fx.GraphModule, sites: list[tuple[str, torch.fx.Node, torch.fx.Node]]) -> list[str]:
    """Makes `gm` the observed variant: each (name, x, y) of `sites` whose node is still in the
    graph gets a `site_stats` row, and the graph returns their stack after its own outputs. Returns
    the rows' site names (none: the graph is left as it was)."""
    live = set(gm.graph.nodes)
    if not isinstance(gm.graph.output_node().args[0], (tuple, list)):  # Dynamo's graphs return a tuple
        return []
    rows = [(name, x, y) for name, x, y in sites if y in live and (not isinstance(x, torch.fx.Node) or x in live)]
    if not rows:
        return []
    out = gm.graph.output_node()
    with gm.graph.inserting_before(out):
        stats = [gm.graph.call_function(site_stats, (x, y)) for _, x, y in rows]
        stacked = gm.graph.call_function(torch.stack, (stats,))
    out.args = ((*out.args[0], stacked),)
    gm.graph.lint()
    gm.recompile()
    return [name for name, _, _ in rows]


def fallen_back(record: LayerRecord) -> bool:
    return record.active_recipe == "bf16" and record.recipe != "bf16"


def fallback_decision(record: LayerRecord) -> LayerDecision:
    """The plan's decision for a site whose guard fell back: bf16, naming the planned recipe and the event."""
    event = record.events[-1] if record.events else "restored from a checkpoint"
    return LayerDecision("bf16", False, f"guardrail fallback from {record.recipe}: {event}", "Guardrail")


def record_for(weight: torch.Tensor | None, name: str, planned: LayerDecision) -> LayerRecord | None:
    """The record of the site computing with `weight`, made (and listed in `policy_report()`) at
    its first quantized plan."""
    if weight is None or planned.recipe == "bf16":
        return None
    record = RECORDS.get(weight)
    if record is None:
        record = LayerRecord(name, planned.recipe, planned.reason, planned.recipe)
        RECORDS[weight] = record
        register(record)
    return record


class GuardedGraph:
    """One Dynamo graph's compilations and guard state (see the module docs). `build(observed)`
    makes a variant from a fresh copy of the graph: (plan, compiled callable, {site name: record}
    of its quantized sites, the observed variant's row names)."""

    def __init__(self, build: Callable, fallback: Fallback, config: GuardrailConfig, first: tuple):
        self._build = build
        self.fallback, self.config = fallback, config
        self.calls = 0
        self.observed = None
        self.rows: list[str] = []
        self._pending: tuple | None = None
        self._set(first)
        GRAPHS.add(self)

    def _set(self, built: tuple) -> None:
        self.plan, self.plain, self.records, _ = built
        #: the sites this build runs in bf16 for their guard
        self.forced = {s.name for s in self.plan.sites if s.decision is not None and s.decision.rule == "Guardrail"}
        self.version = _VERSION[0]
        self.observed, self.rows = None, []

    @property
    def watching(self) -> bool:
        """Whether a site of the graph still runs quantized (else nothing is observed)."""
        return any(not fallen_back(r) for r in self.records.values())

    def __call__(self, *args):
        if self.version != _VERSION[0]:
            self._sync()
        self.calls += 1
        if self.calls % self.config.interval or not self.watching:
            return self.plain(*args)
        return self._observe(args)

    def _sync(self) -> None:
        """Plans and compiles the graph again when its sites' records changed running recipe since
        it was built (a fallback here or in another graph, a restored checkpoint)."""
        if self.forced != {name for name, r in self.records.items() if fallen_back(r)}:
            self._set(self._build(False))
        self.version = _VERSION[0]

    def _observe(self, args):
        self.poll()
        if self.version != _VERSION[0]:
            self._sync()
        if not self.watching or self._pending is not None:  # statistics still on their way: read them next time
            return self.plain(*args)
        if self.observed is None:
            _, self.observed, _, self.rows = self._build(True)
            if not self.rows:  # every quantized site fused away (fused_mlp): nothing to read
                self.observed = self.plain
        if self.observed is self.plain:
            return self.plain(*args)
        out = self.observed(*args)
        stats, out = out[-1], out[:-1]
        if stats.is_cuda:
            host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            host.copy_(stats, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = stats, None
        self._pending = (self.calls, host, event, self.rows)
        return out

    def poll(self, block: bool = False) -> list[tuple[str, str]]:
        """Applies the rule to the pending statistics once they are on the host (at once with
        `block=True`): the (site, reason) pairs that fell back. The graph is planned again at its
        next call."""
        if self._pending is None:
            return []
        call, host, event, rows = self._pending
        if event is not None and not event.query():
            if not block:
                return []
            event.synchronize()
        self._pending = None
        tripped = []
        for name, (x_nf, y_nf, amax_x, amax_y) in zip(rows, host.tolist()):
            reason = check([x_nf, y_nf, 0, 0, amax_x, amax_y], self.config.saturation_threshold)
            record = self.records.get(name)
            if reason is not None and record is not None and not fallen_back(record):
                tripped.append((name, reason))
        for name, reason in tripped:
            record = self.records[name]
            if self.fallback is Fallback.ERROR:
                raise RuntimeError(
                    f"deepwell backend: guardrail of GEMM site {name!r} ({record.recipe}) at call {call}: {reason} "
                    "(fallback='error'; fallback='safe' runs the site in bf16 instead)")
            record.active_recipe = "bf16"
            record.events.append(f"call {call}: {reason}")
            warnings.warn(f"deepwell backend: GEMM site {name!r} falls back from {record.recipe} to bf16 ({reason}, "
                          f"statistics of call {call}); deepwell.policy_report() lists it", stacklevel=2)
        if tripped:
            _VERSION[0] += 1
        return tripped


def graphs_of(model: torch.nn.Module) -> list[GuardedGraph]:
    """The guarded graphs computing with `model`'s parameters."""
    mine = {id(r) for r in records_of(model).values()}
    return [g for g in list(GRAPHS) if any(id(r) in mine for r in g.records.values())]


def poll_model(model: torch.nn.Module) -> list[tuple[str, str]]:
    """`poll(block=True)` on every guarded graph of `model` (before its state is saved)."""
    return [t for g in graphs_of(model) for t in g.poll(block=True)]


def records_of(model: torch.nn.Module) -> dict[str, LayerRecord]:
    """Parameter name -> record of `model`'s guarded sites."""
    out = {}
    for name, p in model.named_parameters():
        record = RECORDS.get(p)
        if record is not None:
            out[name] = record
    return out


def fallback_state(model: torch.nn.Module) -> dict[str, dict]:
    """What a checkpoint keeps of `model`'s guarded sites: per fallen-back weight (by parameter
    name) its site, planned recipe and events."""
    return {name: {"site": r.name, "recipe": r.recipe, "events": list(r.events)}
            for name, r in records_of(model).items() if fallen_back(r)}


def restore_fallbacks(model: torch.nn.Module, state: dict[str, dict], where: str) -> None:
    """Makes `model`'s fallen-back sites those of `state` (`fallback_state`'s), the others running
    their planned recipe; the graphs are planned again at their next call. `state` must name the
    model's parameters (ValueError naming `where` otherwise)."""
    params = dict(model.named_parameters())
    for name, entry in state.items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("site"), str) and isinstance(entry.get("recipe"), str)
              and entry["recipe"] != "bf16" and isinstance(entry.get("events"), list)
              and all(isinstance(e, str) for e in entry["events"]))
        if not ok:
            raise ValueError(f"{where}: site fallback {name!r} must be {{site, recipe (not bf16), events: [str]}}, got {entry!r:.120}")
        if name not in params:
            raise ValueError(f"{where}: site fallback names {name!r}, which is no parameter of the model")
        record = RECORDS.get(params[name])
        if record is not None and record.recipe != entry["recipe"]:
            raise ValueError(f"{where}: site {entry['site']!r} was planned {entry['recipe']}, but this model's graph plans it {record.recipe}")
    for name, r in records_of(model).items():
        if name not in state and fallen_back(r):
            r.active_recipe, r.events = r.recipe, []
    for name, entry in state.items():
        record = RECORDS.get(params[name])
        if record is None:
            record = LayerRecord(entry["site"], entry["recipe"], "planned (restored from a checkpoint)", entry["recipe"])
            RECORDS[params[name]] = record
            register(record)
        record.active_recipe, record.events = "bf16", list(entry["events"])
    _VERSION[0] += 1
