"""Does the planner rank pp × tp × dp plans the way 4 gloo processes run them?

    .venv/bin/python bench/planner_processes.py [--rounds 3] [--steps 3] [--warmup 1]
                                                [--save run.json | --replay run.json]

A *sleep-kernel* transformer-like stack on 4 processes (gloo, CPU): 4 processes on 2 cores cannot
compute like 4 devices, but sleeping ones overlap like devices do. Each block is
``x + down(act(up(norm(x))))`` with ``up: d -> h``, ``down: h -> d`` (the pair smpart's tensor
parallelism splits column / row), and

- ``act`` (a GELU) sleeps ``UNIT_S`` seconds per sample per unit of its input's width in the
  forward and twice that in the backward: ``h`` wide on one device, ``h / tp`` on a tensor-parallel
  rank, so tensor parallelism divides it;
- ``norm`` sleeps ``NORM_S`` per sample per unit of ``d``: no weights, nothing to split, the same on
  every rank of a tensor-parallel group (about 15 % of the model's time: what tensor parallelism
  cannot divide).

The blocks' widths differ, so where the stages are cut matters. The planner sees the model as
``smpart.trace`` does (structure, data edges, and what tensor parallelism splits where the tracer
records it), with each node's measured time set to its sleep: the act's sleep is charged to the
block's ``up`` projection (the layer whose output it is proportional to, and which the swap-in
splits), the norm's to the norm. For 13 strategies (pp, tp, dp, micro-batches) with pp·tp·dp = 4
it predicts the step time of its best stage split; each plan's own ``plan.config`` (stage pins
included) then runs on 4 spawned processes (one launch for everything: ``smpart.init`` →
steps → ``smpart.shutdown`` per configuration), each data-parallel replica feeding its slice of
the global batch, with ``OMP_NUM_THREADS=1`` as torchrun sets it. Rounds alternate the plans (the
order rotates); each round's figure is the median of rank 0's warm steps, and a plan's measured
time is its least loaded round (``--estimate median``: the median round).

**Calibration, once, on a separate model** (6 blocks of other widths, sleeping half as long per
unit; ``--calibration-sleep 0`` for idle layers as `bench/planner_fidelity.py` calibrates). The
planner's fixed-cost knobs are fitted on 8 configurations of it, by non-negative least squares on
the relative error, the Jacobian being finite differences of the planner's own predictions:
``microbatch_overhead_s`` (per micro-batch per stage), ``message_latency_s`` (per boundary
crossing), the intra-node bandwidth (tensor-parallel all-reduces and boundary bytes),
``grad_bytes_per_param`` / bandwidth (the data-parallel sync) and ``collective_latency_s`` (per
tensor-parallel collective call: on gloo each costs milliseconds whatever its size, and the
calls grow with the micro-batches while the bytes do not). The scored model never enters the
calibration.

Prints the calibration figures, the table of plans with predicted (cost model alone, calibrated)
and measured step times, and Spearman's rank correlation of each prediction with the
measurement (goal >= 0.9). ``--save`` writes the measurements; ``--replay`` scores the planner of
the checkout at hand against them without running anything (after a change to the cost model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.planner_fidelity import spearman  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402
from smpart.planner import Cluster, DeviceType, Node  # noqa: E402
from smpart.planner.cluster import GBPS, GIB  # noqa: E402

WORLD = 4
GLOBAL_BATCH = 16
D = 32
#: Hidden widths of the scored model's blocks, and its sleeps (forward seconds per sample per unit
#: of width; the backward sleeps twice as long).
WIDTHS = (64, 64, 128, 256, 64, 128, 32, 32)
UNIT_S = 32e-6
NORM_S = 14e-6
#: The calibration model: other widths, other depth; its sleeps as a fraction of the scored one's.
CALIBRATION_WIDTHS = (96, 48, 96, 48, 96, 48)
CALIBRATION_SLEEP = 0.5

#: (pp, tp, dp, micro-batches) scored; pp·tp·dp = 4.
STRATEGIES = [
    (4, 1, 1, 1), (4, 1, 1, 2), (4, 1, 1, 4), (4, 1, 1, 8),
    (2, 2, 1, 2), (2, 2, 1, 8),
    (2, 1, 2, 1), (2, 1, 2, 4),
    (1, 4, 1, 1), (1, 4, 1, 4),
    (1, 2, 2, 2),
    (1, 1, 4, 1), (1, 1, 4, 4),
]
#: Idle configurations the fixed costs are fitted on.
CALIBRATION = [
    (1, 1, 4, 1), (1, 1, 4, 4), (4, 1, 1, 1), (4, 1, 1, 8),
    (1, 4, 1, 1), (1, 4, 1, 4), (2, 2, 1, 2), (2, 1, 2, 2),
]

DEVICE = DeviceType("sleeper", 1.0, 8 * GIB)
#: The cost model alone: what a user would write for 4 CPU processes on one box (loopback gloo,
#: a few Gbit/s), float32 gradients, no fixed costs.
NOMINAL = {"bandwidth": 10 * GBPS, "microbatch_overhead_s": 0.0, "message_latency_s": 0.0,
           "grad_bytes_per_param": 4.0}


# ================================================================================= the model
_OVERSHOOT = [None]
#: How much slower this process's emulated device is than the reference one: every sleep is
#: stretched by it (`bench/mixed_devices.py` sets it per rank to play slower device types).
SLOWDOWN = [1.0]


def _sleep(seconds: float) -> None:
    """``time.sleep`` less its typical overshoot on this machine (measured once per process), so
    that thousands of short sleeps add up to what was asked; stretched by `SLOWDOWN`."""
    seconds *= SLOWDOWN[0]
    if seconds <= 0:
        return
    if _OVERSHOOT[0] is None:
        over = []
        for _ in range(15):
            start = time.perf_counter()
            time.sleep(1e-3)
            over.append(time.perf_counter() - start - 1e-3)
        _OVERSHOOT[0] = statistics.median(over)
    time.sleep(max(0.0, seconds - _OVERSHOOT[0]))


class Sleep(torch.autograd.Function):
    """Identity that sleeps ``seconds × batch × width`` forward and twice that backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = 2 * seconds * x.shape[0] * x.shape[-1]
        if x.device.type != "meta":
            _sleep(seconds * x.shape[0] * x.shape[-1])
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.seconds)
        return grad, None


class SleepGELU(nn.GELU):
    """A GELU that also sleeps in proportion to its input's width (``h / tp`` on a tp rank); a
    GELU to the tensor-parallel rule, so the block's up/down pair still splits."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        return Sleep.apply(super().forward(x), self.seconds)


class SleepNorm(nn.Module):
    """Work on the whole ``d``-wide activation that tensor parallelism leaves replicated."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        return Sleep.apply(x, self.seconds)


class Block(nn.Module):
    def __init__(self, hidden: int, unit_s: float, norm_s: float) -> None:
        super().__init__()
        self.norm = SleepNorm(norm_s)
        self.up = nn.Linear(D, hidden)
        self.act = SleepGELU(unit_s)
        self.down = nn.Linear(hidden, D)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class SleepStack(nn.Module):
    def __init__(self, widths=WIDTHS, unit_s: float = UNIT_S, norm_s: float = NORM_S) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(h, unit_s, norm_s) for h in widths)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


#: A model: (hidden widths, UNIT_S, NORM_S).
SCORED = (WIDTHS, UNIT_S, NORM_S)


def build(spec: tuple) -> SleepStack:
    torch.manual_seed(0)  # every rank builds the same weights
    return SleepStack(*spec)


def costed_tree(spec: tuple):
    """``smpart.trace``'s tree of the model, each node's measured time (per sample, forward and
    backward) set to the sleeps it stands for."""
    model = build(spec)
    tree = smpart.trace(model, (torch.zeros(1, D),))
    for node in tree.nodes():
        node.time_s = 0.0
    for i, block in enumerate(model.blocks):
        tree.node(f"blocks.{i}.up").time_s = 3 * block.act.seconds * block.up.out_features
        tree.node(f"blocks.{i}.norm").time_s = 3 * block.norm.seconds * D
    tree.compute_unit = "time"
    return tree


# ================================================================================= the planner
def predictions(tree, wanted, *, bandwidth: float, microbatch_overhead_s: float, message_latency_s: float,
                grad_bytes_per_param: float, collective_latency_s: float = 0.0
                ) -> dict[tuple[int, int, int, int], Any]:
    """The planner's best plan of each wanted (pp, tp, dp, micro-batches) on 4 identical devices."""
    cluster = Cluster([Node(DEVICE, WORLD, bandwidth)])
    plans = smpart.plan(tree, cluster, GLOBAL_BATCH, top=100_000, tp_degrees=[1, 2, 4],
                        reference_flops=DEVICE.flops * 0.4, efficiency=0.4, bytes_per_param=None,
                        microbatch_overhead_s=microbatch_overhead_s, message_latency_s=message_latency_s,
                        grad_bytes_per_param=grad_bytes_per_param, collective_latency_s=collective_latency_s)
    out: dict[tuple[int, int, int, int], Any] = {}
    for plan in plans:  # fastest first: keep each strategy's best placement
        out.setdefault((plan.pp, plan.tp, plan.dp, plan.microbatches), plan)
    missing = [s for s in wanted if s not in out]
    if missing:
        raise SystemExit(f"the planner has no plan for {missing}")
    return {s: out[s] for s in wanted}


@dataclass
class Calibration:
    microbatch_overhead_s: float
    message_latency_s: float
    bandwidth: float
    grad_bytes_per_param: float
    collective_latency_s: float

    def options(self) -> dict[str, float]:
        return dict(self.__dict__)


BIG = 1e30  # "infinite" bandwidth: a knob at zero costs nothing
#: The knobs fitted, as a vector: o (per micro-batch), α (per boundary crossing), u = 1 / bandwidth,
#: v = grad_bytes_per_param / bandwidth and λ (per tensor-parallel collective call), with the step
#: of each finite difference.
KNOBS = ("per micro-batch", "per boundary crossing", "1 / bandwidth", "grad bytes / bandwidth",
         "per collective call")
STEPS = np.array([1e-3, 1e-3, 1e-6, 4e-6, 1e-3])


def calibration_of(x: np.ndarray) -> Calibration:
    o, alpha, u, v, lam = (float(value) for value in x)
    bandwidth = 1 / u if u > 0 else BIG
    return Calibration(o, alpha, bandwidth, v * bandwidth, lam)


def fit(tree, measured: dict[tuple[int, int, int, int], float],
        iterations: int = 3) -> tuple[Calibration, dict]:
    """Non-negative least squares (relative error) of the planner's fixed-cost knobs.

    The planner's step time is piecewise linear in ``x`` = (o, α, u, v, λ): each column of the
    Jacobian is a finite difference of the planner's own predictions, taken around the current
    ``x`` (the best stage split can move as ``x`` does, hence a few Gauss-Newton rounds).
    Returns the knobs and the fitted times.
    """
    wanted = list(measured)
    y = np.array([measured[s] for s in wanted])
    weights = 1 / y

    def predict(x: np.ndarray) -> np.ndarray:
        plans = predictions(tree, wanted, **calibration_of(x).options())
        return np.array([plans[s].time_s for s in wanted])

    x = np.zeros(len(STEPS))
    for _ in range(iterations):
        at = predict(x)
        jacobian = np.stack([(predict(x + step * np.eye(len(STEPS))[k]) - at) / step
                             for k, step in enumerate(STEPS)], axis=1)
        target = y - at + jacobian @ x
        x = _nnls(jacobian * weights[:, None], target * weights)
    return calibration_of(x), dict(zip(wanted, predict(x), strict=True))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, by trying every set of free variables (5 knobs: 32 sets)."""
    best = None
    for active in itertools.product((False, True), repeat=a.shape[1]):
        cols = [j for j, on in enumerate(active) if on]
        x = np.zeros(a.shape[1])
        if cols:
            x[cols] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (x < 0).any():
            continue
        residual = float(np.sum((a @ x - b) ** 2))
        if best is None or residual < best[0]:
            best = (residual, x)
    return best[1]


# ================================================================================= the runs
def run_config(rank: int, spec: tuple, config: smpart.Config, warmup: int, steps: int,
               global_batch: int = GLOBAL_BATCH, emulated: list[tuple[str, float]] | None = None
               ) -> list[float]:
    """Rank 0's warm step times of ``kind`` under ``config`` (every rank runs it). Each data-parallel
    replica takes its share of the global batch (`smpart.ReplicaBatchSampler`). ``emulated[rank]``:
    the device type this rank plays (declared as ``SMPART_DEVICE_TYPE``) and its slowdown."""
    if emulated is not None:
        os.environ["SMPART_DEVICE_TYPE"], SLOWDOWN[0] = emulated[rank]
    smpart.init(config.replace(timeout_s=120.0))
    try:
        model = smpart.DistributedModel(build(spec))
        x = torch.randn(global_batch, D, generator=torch.Generator().manual_seed(1))
        x = x[next(iter(smpart.ReplicaBatchSampler(global_batch, global_batch)))]

        @smpart.step
        def train_step(model, x):
            loss = model(x).square().mean()
            model.backward(loss)
            return loss

        for _ in range(warmup):
            train_step(model, x)
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            train_step(model, x)
            times.append(time.perf_counter() - start)
        return times
    finally:
        smpart.shutdown()
        SLOWDOWN[0] = 1.0
        os.environ.pop("SMPART_DEVICE_TYPE", None)


def measure_round(pool: RankPool, spec: tuple, configs: dict, r: int, warmup: int, steps: int,
                  per_round: dict) -> None:
    """One round: each configuration's median warm step appended to ``per_round`` (the order
    rotates from round to round)."""
    keys = list(configs)
    shift = r * 5 % len(keys)
    for key in keys[shift:] + keys[:shift]:
        times = pool.run(run_config, spec, configs[key], warmup, steps)[0]
        per_round.setdefault(key, []).append(statistics.median(times))


def settle(per_round: dict, how: str) -> dict:
    """One figure per configuration: the least loaded round (``min``) or the median round."""
    pick = min if how == "min" else statistics.median
    return {k: pick(v) for k, v in per_round.items()}


def label(s: tuple[int, int, int, int]) -> str:
    return f"pp={s[0]} tp={s[1]} dp={s[2]} m={s[3]}"


def split_of(plan) -> str:
    if plan.pp == 1:
        return "-"
    bounds = [*plan.starts, len(plan.layers)]
    return "·".join(f"{bounds[j + 1] - bounds[j]}" for j in range(plan.pp)) + f"/{len(plan.layers)}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--calibration-sleep", type=float, default=CALIBRATION_SLEEP,
                        help="the calibration model's sleeps, as a fraction of the scored model's "
                             "(0: idle layers, as bench/planner_fidelity.py calibrates)")
    parser.add_argument("--estimate", choices=("min", "median"), default="min",
                        help="per plan, the least loaded round's median step (default) or the median round")
    parser.add_argument("--save", metavar="JSON", help="also write the measurements here")
    parser.add_argument("--replay", metavar="JSON",
                        help="run nothing: score this planner against measurements saved by --save")
    args = parser.parse_args()
    console = Console(width=150)
    started = time.perf_counter()
    torch.set_num_threads(1)
    # As torchrun does for several processes per node. Without it, torch.set_num_threads(1) in a
    # rank does not reach smpart's stage threads: their OpenMP teams take every core and the idle
    # workers spin, which on 2 cores slows every other rank (data parallelism with one
    # micro-batch: 650-1370 ms a step instead of ~400).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    saved = json.loads(Path(args.replay).read_text()) if args.replay else None
    if saved:
        console.print(f"replaying {args.replay}: measured at load average {saved['load']}")
        args.calibration_sleep = saved["calibration_sleep"]
    else:
        console.print(f"uptime: load average {_load()} on {os.cpu_count()} cores")

    calibration_spec = (CALIBRATION_WIDTHS, UNIT_S * args.calibration_sleep, NORM_S * args.calibration_sleep)
    calibration_tree = costed_tree(calibration_spec)
    scored_tree = costed_tree(SCORED)
    recorded = getattr(scored_tree, "tp_degrees", ())
    console.print("tensor-parallel split shares in the traced tree: " + (
        f"degrees {list(recorded)}" if recorded else "none (the planner divides everything by tp)"))
    nominal = predictions(scored_tree, STRATEGIES, **NOMINAL)
    calibration_plans = predictions(calibration_tree, CALIBRATION, **NOMINAL)

    if saved:
        idle_rounds = _keyed(saved["calibration"])
        calibration, fitted = fit(calibration_tree, settle(idle_rounds, args.estimate))
        calibrated = predictions(scored_tree, STRATEGIES, **calibration.options())
        rounds = _keyed(saved["scored"])
        run_splits = _keyed(saved["splits"])
    else:
        # Calibration and scored runs alternate round by round, so that both see the same load;
        # the plans to run are fixed after the first calibration round (a final fit over all
        # rounds may move a stage boundary: flagged below).
        idle_rounds, rounds = {}, {}
        calibration_configs = {s: p.config for s, p in calibration_plans.items()}
        console.print(f"calibration model: {len(CALIBRATION_WIDTHS)} blocks (widths "
                      f"{list(CALIBRATION_WIDTHS)}, sleeps x{args.calibration_sleep:g}), {len(CALIBRATION)} "
                      f"configurations; scored model: {len(WIDTHS)} blocks (widths {list(WIDTHS)}), "
                      f"{len(STRATEGIES)} plans; global batch {GLOBAL_BATCH}")
        with RankPool(WORLD) as pool:
            for r in range(args.rounds):
                measure_round(pool, calibration_spec, calibration_configs, r, args.warmup, args.steps,
                              idle_rounds)
                if r == 0:
                    first, _ = fit(calibration_tree, settle(idle_rounds, args.estimate))
                    run_plans = predictions(scored_tree, STRATEGIES, **first.options())
                measure_round(pool, SCORED, {s: p.config for s, p in run_plans.items()}, r, args.warmup,
                              args.steps, rounds)
                console.print(f"  round {r + 1}/{args.rounds} done ({time.strftime('%H:%M:%S')}, "
                              f"load {_load()})", style="dim")
        calibration, fitted = fit(calibration_tree, settle(idle_rounds, args.estimate))
        calibrated = predictions(scored_tree, STRATEGIES, **calibration.options())
        run_splits = {s: split_of(p) for s, p in run_plans.items()}
        if args.save:
            Path(args.save).write_text(json.dumps({
                "load": _load(), "calibration_sleep": args.calibration_sleep,
                "calibration": _unkeyed(idle_rounds), "scored": _unkeyed(rounds),
                "splits": _unkeyed(run_splits)}, indent=1))
    idle = settle(idle_rounds, args.estimate)
    measured = settle(rounds, args.estimate)
    table = Table(title="calibration model: measured vs the planner with the fitted fixed costs (ms)")
    for column in ("configuration", "cost model", "measured", "fitted"):
        table.add_column(column, justify="right")
    for s in CALIBRATION:
        table.add_row(label(s), ms(calibration_plans[s].time_s), ms(idle[s]), ms(fitted[s]))
    console.print(table)
    console.print(f"fitted fixed costs: {describe(calibration)}")

    table = Table(title=f"planner vs 4 gloo processes: sleep-kernel model, global batch {GLOBAL_BATCH}, "
                        f"step times in ms (measured: {args.estimate} over {args.rounds} rounds)")
    for column in ("pp", "tp", "dp", "m", "split", "cost model", "calibrated", "measured", "rounds",
                   "meas. / calib."):
        table.add_column(column, justify="right")
    for s in STRATEGIES:
        plan = calibrated[s]
        table.add_row(*map(str, s), split_of(plan), ms(nominal[s].time_s), ms(plan.time_s), ms(measured[s]),
                      " ".join(ms(t) for t in rounds[s]), f"{measured[s] / plan.time_s:.2f}")
    console.print(table)
    y = [measured[s] for s in STRATEGIES]
    for name, times in (("cost model alone", {s: p.time_s for s, p in nominal.items()}),
                        ("with the calibrated fixed costs", {s: p.time_s for s, p in calibrated.items()})):
        predicted = [times[s] for s in STRATEGIES]
        ceiling = spearman(predicted, np.lexsort((y, predicted)).argsort())
        console.print(f"{name}: Spearman over {len(STRATEGIES)} plans [bold]{spearman(predicted, y):.3f}[/] "
                      f"(goal >= 0.9; best possible with its ties {ceiling:.3f})")
    changed = [label(s) for s in STRATEGIES if split_of(calibrated[s]) != run_splits[s]]
    if changed:
        console.print(f"[yellow]the calibrated planner splits {', '.join(changed)} differently from the "
                      f"runs[/]: their measured times are of the split run")
    console.print(f"whole bench: {time.perf_counter() - started:.0f} s; load average now {_load()}")


def describe(c: Calibration) -> str:
    bandwidth = "∞" if c.bandwidth >= BIG / 10 else f"{c.bandwidth / 1e6:.3g} MB/s"
    return (f"microbatch_overhead_s [bold]{c.microbatch_overhead_s * 1e3:.2f} ms[/], message_latency_s "
            f"[bold]{c.message_latency_s * 1e3:.2f} ms[/], intra-node bandwidth [bold]{bandwidth}[/], "
            f"data-parallel sync [bold]{c.grad_bytes_per_param / c.bandwidth * 1e9:.3g} ns[/] per parameter "
            f"(grad_bytes_per_param / bandwidth), collective_latency_s "
            f"[bold]{c.collective_latency_s * 1e3:.2f} ms[/]")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _keyed(saved: dict) -> dict:
    return {tuple(int(v) for v in key.split(",")): value for key, value in saved.items()}


def _unkeyed(values: dict) -> dict:
    return {",".join(map(str, key)): value for key, value in values.items()}


if __name__ == "__main__":
    main()
