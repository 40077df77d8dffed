"""smpart on one process per stage against torch.distributed.pipelining, threads and the unsplit model.

The same MLP (8 blocks of Linear 256->1024, GELU, Linear 1024->256, then a head Linear 256->10),
float32, batch 512, 4 micro-batches, cross-entropy, forward + backward + SGD step, split in 2 at
the same layer (blocks 0-3 on stage 0, blocks 4-7 and the head on stage 1), one intra-op thread
per rank (and per process on threads), trained five ways in one run of this script:

- ``smpart procs``: smpart on 2 processes (gloo), ``pipeline="1f1b"`` and ``"gpipe"``; beside
  it ``smpart ref`` (the reference runtime, ``step_programs=False``) and ``smpart framed`` (the
  programs with their tensors as the transport's messages, ``direct_transfers=False``);
- ``torch procs``: torch.distributed.pipelining's ``Schedule1F1B`` / ``ScheduleGPipe`` over two
  hand-built ``PipelineStage``\\ s on the same 2 processes (gloo);
- ``smpart threads``: smpart on threads of this process (2 stages);
- ``unsplit``: the whole model in this process, on the full batch and over the 4 micro-batches
  one after the other (the pipeline's own work without a pipeline);
- diagnostic, ``smpart procs / 1f1b halves``: the same layers and weights grouped into two
  ``nn.Sequential`` halves (`Halves`), so the root makes one cross-stage call per micro-batch
  instead of one per block of stage 1 (``--no-halves`` skips it);
- diagnostic, ``one thread/rank``: the yardstick of `bench.one_thread`, smpart's transport,
  1f1b order and loss on the first rank, with all of a rank's work on one thread and none of
  the runtime (``--no-one-thread`` skips it).

Besides wall-clock medians, the table gives the CPU time every thread of every process of a
configuration used per step: the work done, much less sensitive to the machine's load; the part
of it beside the threads that run the stage and the step body (`COMPUTE_THREADS`): the
transport's threads (receiving, and handling what arrives for an idle stage; completing sends;
heartbeats) and gloo's own; and the time those threads spent ready to run but waiting for a
core. On 2 cores with both ranks computing, every thread beside the computing
ones takes a core from one of them, so the CPU used beside them comes out of the compute, as
wall-clock time.

``--by-thread`` also prints, per rank of each process configuration, where that CPU and waiting
went, thread by thread (the stage's workers, its dispatcher, the transport's receiver and sender,
gloo's socket loops, the main thread, and threads that ended within the step: the drivers).
``--pin`` pins each rank to a core of its own (``sched_setaffinity``): a thread that then waits for
a core waits for a thread of its own rank, so the two runs together tell contention inside a rank
from contention between the ranks. ``--anatomy`` prints, from smpart's step timelines, each
stage's busy time per step beside the same half's forward and backward run alone on one thread
(how much slower the work itself runs inside the runtime), and the hand-offs between the stages:
how long an action waited once its input was made and its stage was free.

The two worker processes are spawned once (`RankPool`) and stay up; the configurations alternate
round by round (the order of the process ones rotates), so a change in the machine's load hits
them alike. Each round of each configuration initialises afresh, warms up, and times ``--steps``
steps on rank 0 (the driver); medians over all rounds. The ideal pipelined step of 2 perfectly
balanced stages is ``(m + 1) / (2 m)`` of the micro-batched unsplit step (``m`` micro-batches).

    .venv/bin/python bench/processes.py [--rounds 3] [--steps 7] [--warmup 3] [--by-thread] [--pin]
                                        [--anatomy]

The workload, torch's pipeline on it and the step timer are `bench/mlp_pipeline.py`'s; the pool of
processes is `bench/rank_pool.py`'s.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smpart  # noqa: E402
from bench.bytecodes import count_bytecodes  # noqa: E402
from bench.mlp_pipeline import (  # noqa: E402
    BATCH,
    BLOCKS,
    HALVES_PINS,
    HIDDEN,
    INTERLEAVED_PINS,
    MICROBATCHES,
    PINS,
    STAGES,
    WIDTH,
    Halves,
    make_batch,
    make_model,
    run_torch,
    run_unsplit,
    smpart_step,
    timed,
)
from bench.one_thread import run_one_thread  # noqa: E402
from bench.rank_pool import RankPool  # noqa: E402


def run_smpart(rank: int | None, schedule: str, warmup: int, steps: int,
               halves: bool = False, reference: bool = False, framed: bool = False,
               count: bool = False) -> dict[str, Any]:
    """smpart's step on whatever this process is (a rank of the pool, or threads when ``rank`` is
    None); step times are those of the driver (rank 0). ``reference``: every step on the
    reference runtime (step programs off); ``framed``: programs whose tensors stay the transport's
    messages (``direct_transfers=False``); schedule ``interleaved``: 1f1b over virtual stages;
    ``count``: the bytecodes of one step after ``warmup`` (`bench.bytecodes`) instead of times."""
    interleaved = schedule == "interleaved"
    pins = HALVES_PINS if halves else INTERLEAVED_PINS if interleaved else PINS
    smpart.init(pipeline_parallel_degree=STAGES, microbatches=MICROBATCHES, pin=pins, timeout_s=120,
                pipeline="1f1b" if interleaved else schedule, virtual_stages=2 if interleaved else 1,
                step_programs=not reference, direct_transfers=not framed)
    try:
        model = smpart.DistributedModel(Halves(make_model()) if halves else make_model())
        opt = smpart.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        x, y = make_batch()
        outputs: list[Any] = []

        def one_step() -> None:
            out = smpart_step(model, x, y)
            opt.step()
            opt.zero_grad()
            outputs.append(out)

        if count:
            counted = count_bytecodes(one_step, warmup)
            if rank is not None:
                dist.barrier()
            return {"bytecodes": counted}
        usage: dict[str, float] = {}
        times = timed(one_step, warmup, steps, usage)
        last = outputs[-1:]
        if rank is not None:
            dist.barrier()  # every rank has measured before any shuts down (a closed peer's receiver ends)
        stages = smpart.partition_of(model).module_stages()
        assert all(stages[name] == stage for name, stage in pins.items() if name), "pins not honoured"
        return {"times": times, "bytes_sent": dict(last[0].timeline.bytes_sent),
                "loss": last[0].reduce_mean().item(),
                "anatomy": anatomy([out.timeline for out in outputs[-steps:]]), **usage}
    finally:
        smpart.shutdown()


def anatomy(timelines: list[Any]) -> dict[str, list[float]]:
    """Where a 2-stage step's time goes, from its timelines (seconds): each stage's busy time
    per step (its actions' spans), and each hand-off between the stages: how long an action waited
    after both its input was made on the other stage and its own stage finished its previous
    action (forward 0 -> 1, backward 1 -> 0)."""
    busy: list[list[float]] = [[], []]
    forward: list[float] = []
    backward: list[float] = []
    for timeline in timelines:
        actions = {stage: _actions(timeline, stage) for stage in (0, 1)}
        for stage in (0, 1):
            busy[stage].append(sum(e["end_s"] - e["start_s"] for e in timeline.events if e["stage"] == stage))
        for mb in range(timeline.microbatches):
            forward.append(_waited(actions[1], actions[0], ("F", mb)))
            backward.append(_waited(actions[0], actions[1], ("B", mb)))
    return {"busy0": busy[0], "busy1": busy[1], "forward": forward, "backward": backward}


def _actions(timeline: Any, stage: int) -> list[tuple[tuple[str, int], float, float]]:
    """A stage's actions in order, ``((kind, micro-batch), start, end)``: the spans of one action
    (stage 1's forward is a span per block called) merged."""
    merged: list[tuple[tuple[str, int], float, float]] = []
    for e in (e for e in timeline.events if e["stage"] == stage):
        key = (e["kind"][0].upper(), e["microbatch"])
        if merged and merged[-1][0] == key:
            merged[-1] = (key, merged[-1][1], e["end_s"])
        else:
            merged.append((key, e["start_s"], e["end_s"]))
    return merged


def _waited(mine: list[tuple[tuple[str, int], float, float]],
            theirs: list[tuple[tuple[str, int], float, float]], key: tuple[str, int]) -> float:
    i = next(i for i, action in enumerate(mine) if action[0] == key)
    made = next(end for k, _, end in theirs if k == key)
    free = mine[i - 1][2] if i > 0 else 0.0
    return max(0.0, mine[i][1] - max(made, free))


def pure_compute(steps: int) -> list[float]:
    """Each half's forward and backward over the 4 micro-batches, one thread, nothing else: thread
    CPU seconds per step, medians of ``steps``."""
    halves = Halves(make_model())
    x, y = make_batch()
    inputs = [halves.first(xs).detach() for xs in x.chunk(MICROBATCHES)]
    result = []
    for half, feed in ((halves.first, list(x.chunk(MICROBATCHES))), (halves.second, inputs)):
        per_step = []
        for _ in range(steps):
            start = time.thread_time()
            for xs in feed:
                out = half(xs.requires_grad_() if half is halves.second else xs)
                out.backward(torch.ones_like(out))
            per_step.append(time.thread_time() - start)
        result.append(statistics.median(per_step))
    return result


def _print_anatomy(anatomies: dict[str, list[dict[str, list[float]]]], compute: list[float]) -> None:
    print("\nanatomy of smpart's step on processes (ms per step; medians over every round's timed steps):")
    print(f"  each half's forward + backward alone, one thread, thread CPU: stage 0 {_ms(compute[0])}, "
          f"stage 1 {_ms(compute[1])}")
    for schedule, rounds in anatomies.items():
        merged = {key: [v for each in rounds for v in each[key]] for key in rounds[0]}
        steps = len(merged["busy0"])
        busy = [statistics.median(merged[f"busy{s}"]) for s in (0, 1)]
        hand = {k: (statistics.median(merged[k]), sorted(merged[k])[int(0.9 * len(merged[k]))],
                    sum(merged[k]) / steps) for k in ("forward", "backward")}
        print(f"  {schedule}: stages busy {_ms(busy[0])} / {_ms(busy[1])} (x {busy[0] / compute[0]:.2f} / "
              f"x {busy[1] / compute[1]:.2f} the work alone); hand-offs, median / p90 / total per step: "
              f"forward 0->1 {hand['forward'][0] * 1e3:.2f} / {hand['forward'][1] * 1e3:.2f} / "
              f"{hand['forward'][2] * 1e3:.1f}, backward 1->0 {hand['backward'][0] * 1e3:.2f} / "
              f"{hand['backward'][1] * 1e3:.2f} / {hand['backward'][2] * 1e3:.1f}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f}"


def _print_roles(roles: dict[tuple[str, str], list[list[dict[str, list[float]]]]]) -> None:
    """Per process configuration and rank: each kind of thread's CPU and time waiting for a core,
    ms per step (medians over the rounds)."""
    print("\nby thread, per rank (ms per step, medians over the rounds): CPU / waited for a core")
    for (name, schedule), per_rank in roles.items():
        for rank, rounds in enumerate(per_rank):
            kinds = sorted({kind for each in rounds for kind in each},
                           key=lambda kind: -statistics.median(each.get(kind, [0.0])[0] for each in rounds))
            cells = []
            for kind in kinds:
                used = statistics.median(each.get(kind, [0.0, 0.0])[0] for each in rounds)
                wait = statistics.median(each.get(kind, [0.0, 0.0])[1] for each in rounds)
                if used >= 0.05e-3:
                    cells.append(f"{kind} {_ms(used)}" + ("" if math.isnan(wait) else f" / {_ms(wait)}"))
            print(f"  {name + ' ' + schedule:<24} rank {rank}: " + ", ".join(cells))


def print_bytecodes(warmup: int) -> None:
    """The ``--bytecodes`` table: each rank's main thread, one step after ``warmup``."""
    table = Table(title=f"Python bytecodes of one step on each rank's main thread (MLP, {STAGES} processes, "
                        f"{MICROBATCHES} micro-batches)")
    for column in ("configuration", "schedule", *(f"rank {r}" for r in range(STAGES)), "÷ torch's"):
        table.add_column(column, justify="left" if column in ("configuration", "schedule") else "right")
    with RankPool(STAGES) as pool:
        for schedule in ("1f1b", "gpipe"):
            counting = (False, False, False, True)  # run_smpart's halves, reference, framed, count
            theirs = [r["bytecodes"] for r in pool.run(run_torch, schedule, warmup, 0, True)]
            ours = [r["bytecodes"] for r in pool.run(run_smpart, schedule, warmup, 0, *counting)]
            ratio = sum(ours) / sum(theirs)
            table.add_row("torch procs", schedule, *(f"{n:,}" for n in theirs), "1.00")
            table.add_row("smpart procs", schedule, *(f"{n:,}" for n in ours), f"{ratio:.2f}")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-halves", dest="halves", action="store_false",
                        help="skip the diagnostic run of the same layers grouped in two halves")
    parser.add_argument("--no-one-thread", dest="one_thread", action="store_false",
                        help="skip the one-thread-per-rank yardstick (bench/one_thread.py)")
    parser.add_argument("--by-thread", action="store_true",
                        help="also print where each rank's CPU and waiting went, thread by thread")
    parser.add_argument("--pin", action="store_true",
                        help="pin each rank (of the process configurations) to a core of its own")
    parser.add_argument("--no-interleaved", dest="interleaved", action="store_false",
                        help="skip virtual stages (smpart's virtual_stages=2, torch's "
                             "ScheduleInterleaved1F1B)")
    parser.add_argument("--bytecodes", action="store_true",
                        help="count the Python bytecodes of one step on each rank's main thread, smpart's "
                             "programs beside torch's schedules, instead of timing")
    parser.add_argument("--anatomy", action="store_true",
                        help="also print smpart's stages' busy time beside their work alone, and the "
                             "hand-offs between them, from the steps' timelines")
    a = parser.parse_args()
    torch.set_num_threads(1)
    if a.bytecodes:
        print_bytecodes(a.warmup)
        return
    proc_configs = [("smpart procs", "1f1b"), ("torch procs", "1f1b"), ("smpart procs", "gpipe"),
                    ("torch procs", "gpipe"), ("smpart ref", "1f1b"), ("smpart ref", "gpipe"),
                    ("smpart framed", "1f1b"), ("smpart framed", "gpipe")]
    if a.interleaved:
        proc_configs += [("smpart procs", "interleaved"), ("torch procs", "interleaved")]
    if a.halves:
        proc_configs.append(("smpart procs", "1f1b halves"))
    if a.one_thread:
        proc_configs.append(("one thread/rank", "1f1b"))
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}  # CPU seconds per step, all processes of the config
    beside: dict[tuple[str, str], list[float]] = {}  # the part of it outside the compute threads
    waited: dict[tuple[str, str], list[float]] = {}  # seconds per step threads waited for a core
    extra: dict[tuple[str, str], dict[str, Any]] = {}
    per_round: dict[tuple[str, str], list[float]] = {}  # each round's median step of the process configs
    roles: dict[tuple[str, str], list[list[dict[str, list[float]]]]] = {}  # per config, rank: every round's
    anatomies: dict[str, list[dict[str, list[float]]]] = {}  # smpart procs, per schedule: every round's
    print(f"MLP {BLOCKS} x ({WIDTH}->{HIDDEN}->{WIDTH}) + head, batch {BATCH}, {MICROBATCHES} micro-batches, "
          f"2 stages, 1 intra-op thread per process; {a.rounds} rounds x {a.steps} timed steps "
          f"(after {a.warmup} warm-up) per configuration{'; each rank on a core of its own' * a.pin}")
    with RankPool(STAGES, pin=a.pin) as pool:
        for r in range(a.rounds):
            order = proc_configs[r % len(proc_configs):] + proc_configs[:r % len(proc_configs)]
            for name, schedule in order:
                fn = {"smpart": run_smpart, "torch": run_torch, "one": run_one_thread}[name.split()[0]]
                args = (schedule.split()[0], a.warmup, a.steps) + ((True,) if "halves" in schedule else ())
                if name == "smpart ref":
                    args += (False, True)
                if name == "smpart framed":
                    args += (False, False, True)
                results = pool.run(fn, *args)
                result = results[0]
                times.setdefault((name, schedule), []).extend(result["times"])
                per_round.setdefault((name, schedule), []).append(statistics.median(result["times"]))
                cpu.setdefault((name, schedule), []).append(sum(r["cpu"] for r in results))
                beside.setdefault((name, schedule), []).append(sum(r["beside"] for r in results))
                waited.setdefault((name, schedule), []).append(sum(r["waited"] for r in results))
                for rank, each in enumerate(results):
                    roles.setdefault((name, schedule), [[] for _ in results])[rank].append(each["roles"])
                extra[(name, schedule)] = result
                if name == "smpart procs":
                    anatomies.setdefault(schedule, []).append(result["anatomy"])
            for schedule in ("1f1b", "gpipe"):
                result = run_smpart(None, schedule, a.warmup, a.steps)
                times.setdefault(("smpart threads", schedule), []).extend(result["times"])
                cpu.setdefault(("smpart threads", schedule), []).append(result["cpu"])
                waited.setdefault(("smpart threads", schedule), []).append(result["waited"])
                extra[("smpart threads", schedule)] = result
            for microbatched in (False, True):
                key = ("unsplit", "4 micro-batches" if microbatched else "full batch")
                used: dict[str, float] = {}
                times.setdefault(key, []).extend(run_unsplit(a.warmup, a.steps, microbatched, used))
                cpu.setdefault(key, []).append(used["cpu"])
            print(f"  round {r + 1}/{a.rounds} done", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    micro = med[("unsplit", "4 micro-batches")]
    ideal = micro * (MICROBATCHES + STAGES - 1) / (MICROBATCHES * STAGES)
    print(f"\n{'configuration':<16} {'schedule':<16} {'median ms':>9} {'min ms':>8} {'max ms':>8} "
          f"{'/ ideal':>8} {'n':>4} {'CPU ms/step':>11} {'beside ms/step':>14} {'waited ms/step':>14}")

    def column(values: dict[tuple[str, str], list[float]], key: tuple[str, str]) -> str:
        return _ms(statistics.median(values[key])) if key in values else ""

    for key, values in times.items():
        print(f"{key[0]:<16} {key[1]:<16} {_ms(med[key]):>9} {_ms(min(values)):>8} {_ms(max(values)):>8} "
              f"{med[key] / ideal:8.3f} {len(values):>4} {column(cpu, key):>11} {column(beside, key):>14} "
              f"{column(waited, key):>14}")
    print("(CPU ms/step: CPU time of every thread of every process of the configuration, per step: "
          "the work done, whatever the machine's load. beside ms/step: the part of it outside the "
          "threads that run the stage and the step body: the transport's threads and gloo's own. "
          "waited ms/step: time those threads were ready to run but waited for a "
          "core, from /proc/self/task/*/schedstat)")
    print(f"ideal 2-stage step ((m + 1) / 2m x the micro-batched unsplit step): {ideal * 1e3:.1f} ms")
    for schedule, torch_name in (("1f1b", "Schedule1F1B"), ("gpipe", "ScheduleGPipe")):
        ratio = med[("smpart procs", schedule)] / med[("torch procs", schedule)]
        # The two ran next to each other in every round: their ratio round by round is blind to
        # the machine's speed drifting between rounds.
        paired = [ours / theirs for ours, theirs in zip(per_round[("smpart procs", schedule)],
                                                         per_round[("torch procs", schedule)], strict=True)]
        print(f"smpart processes / torch {torch_name}: {ratio:.3f}  (goal <= 1.0); round by round: "
              f"{', '.join(f'{r:.3f}' for r in paired)} (median {statistics.median(paired):.3f})")
        reference = [ours / theirs for ours, theirs in zip(per_round[("smpart ref", schedule)],
                                                            per_round[("torch procs", schedule)],
                                                            strict=True)]
        print(f"  the reference runtime (step programs off) / torch {torch_name}: "
              f"{med[('smpart ref', schedule)] / med[('torch procs', schedule)]:.3f}; round by round "
              f"{', '.join(f'{r:.3f}' for r in reference)}")
        framed = [ours / theirs for ours, theirs in zip(per_round[("smpart framed", schedule)],
                                                         per_round[("torch procs", schedule)], strict=True)]
        print(f"  programs with framed transfers (direct_transfers=False) / torch {torch_name}: "
              f"{med[('smpart framed', schedule)] / med[('torch procs', schedule)]:.3f}; round by round "
              f"{', '.join(f'{r:.3f}' for r in framed)}")
    if ("smpart procs", "interleaved") in med:
        ours_v, theirs_v = ("smpart procs", "interleaved"), ("torch procs", "interleaved")
        paired = [o / t for o, t in zip(per_round[ours_v], per_round[theirs_v], strict=True)]
        print(f"smpart processes, virtual_stages=2 / torch ScheduleInterleaved1F1B: "
              f"{med[ours_v] / med[theirs_v]:.3f}; round by round {', '.join(f'{r:.3f}' for r in paired)}; "
              f"torch interleaved / torch 1F1B: {med[theirs_v] / med[('torch procs', '1f1b')]:.3f}")
    for schedule in ("1f1b", "gpipe"):
        ratio = med[("smpart procs", schedule)] / med[("smpart threads", schedule)]
        print(f"smpart processes / smpart threads ({schedule}): {ratio:.3f}")
    sent = extra[("smpart procs", "1f1b")]["bytes_sent"]
    print(f"smpart bytes between stages per step (processes, 1f1b): {sent}; activation "
          f"{BATCH} x {WIDTH} x 4 B = {BATCH * WIDTH * 4} each way")
    if ("one thread/rank", "1f1b") in med:
        paired = [ours / theirs for ours, theirs in zip(per_round[("one thread/rank", "1f1b")],
                                                         per_round[("torch procs", "1f1b")], strict=True)]
        ratio = med[("one thread/rank", "1f1b")] / med[("torch procs", "1f1b")]
        print(f"diagnostic, smpart's transport and 1f1b order on one thread per rank (bench/one_thread.py) / "
              f"torch Schedule1F1B: {ratio:.3f}; round by round {', '.join(f'{r:.3f}' for r in paired)} "
              f"(median {statistics.median(paired):.3f})")
    if a.by_thread:
        _print_roles(roles)
    if a.anatomy:
        _print_anatomy(anatomies, pure_compute(max(a.steps, 5)))
    if ("smpart procs", "1f1b halves") in med:
        ratio = med[("smpart procs", "1f1b halves")] / med[("torch procs", "1f1b")]
        print(f"diagnostic, the same layers in two halves (one cross-stage call per micro-batch) / torch "
              f"Schedule1F1B: {ratio:.3f}; bytes {extra[('smpart procs', '1f1b halves')]['bytes_sent']}")


if __name__ == "__main__":
    main()
