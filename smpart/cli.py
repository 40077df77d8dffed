"""The ``smpart`` command: trace, partition and show models from the shell.

``MODULE:FACTORY`` names a function (importable from the current directory) that returns an
``Example`` (with ``.model``, ``.args``, ``.kwargs``) or a tuple ``(model, args[, kwargs])``::

    smpart partition examples.models:gpt2 --stages 4 --memory-weight 0.5 --json part.json
    smpart partition examples.models:gpt2 --stages 4 --devices V100,V100,A100,A100
    smpart trace examples.models:gpt2
    smpart show part.json
    smpart demo

Each subcommand is one ``_cmd_*`` function plus one ``_add_*`` function registering its
arguments; `COMMANDS` lists the registrations. Anything the user got wrong (a bad
``MODULE:FACTORY``, a module that fails to import, any `SmpartError`) prints one red line and
exits with status 2, never a traceback. torch is imported only by the commands that trace.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from smpart.errors import ConfigError, SmpartError
from smpart.partitioning.api import partition
from smpart.partitioning.result import Partition
from smpart.viz import show, to_html

#: Exit status for input the user can fix.
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 on success, 2 on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args, Console())
    except (SmpartError, OSError) as err:
        Console(stderr=True, soft_wrap=True).print(Text(f"smpart: error: {err}", style="bold red"))
        return EXIT_USAGE
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smpart", description="Split a PyTorch model into pipeline stages, SageMaker style."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


# ==================================================================== partition


def _add_partition(sub: Any) -> None:
    p = sub.add_parser("partition", help="trace a model and cut it into pipeline stages")
    _add_model_arguments(p)
    p.add_argument("--stages", type=int, default=4, help="number of pipeline stages (default 4)")
    p.add_argument(
        "--memory-weight", type=float, default=0.8, help="0 balances compute, 1 balances memory (default 0.8)"
    )
    p.add_argument(
        "--pin", action="append", default=[], metavar="MODULE=STAGE", help="fix a module to a stage (repeat)"
    )
    p.add_argument(
        "--devices", metavar="TYPE,TYPE,...",
        help="each stage's device type, in pipeline order (presets such as V100,V100,A100,A100): "
             "stages balanced by time on their own device, within its memory",
    )
    p.add_argument("--json", metavar="PATH", help="also write the partition as JSON")
    _add_view_arguments(p)
    _add_html_arguments(p)
    p.set_defaults(run=_cmd_partition)


def _cmd_partition(args: argparse.Namespace, console: Console) -> None:
    tree = trace_factory(args.model, device=args.device)
    devices = [d.strip() for d in args.devices.split(",")] if args.devices else None
    part = partition(tree, args.stages, memory_weight=args.memory_weight, pin=parse_pins(args.pin),
                     devices=devices)
    part.meta["model"] = args.model
    _present_partition(part, args, console)
    if args.json:
        part.to_json(args.json)
        console.print(f"partition written to {args.json}")


# ==================================================================== trace


def _add_trace(sub: Any) -> None:
    p = sub.add_parser("trace", help="trace a model and print its costed module tree")
    _add_model_arguments(p)
    _add_view_arguments(p)
    p.set_defaults(run=_cmd_trace)


def _cmd_trace(args: argparse.Namespace, console: Console) -> None:
    show(trace_factory(args.model, device=args.device), console=console, max_depth=args.max_depth)


# ==================================================================== show


def _add_show(sub: Any) -> None:
    p = sub.add_parser("show", help="print a partition saved with --json")
    p.add_argument("path", help="partition JSON file")
    _add_view_arguments(p)
    _add_html_arguments(p)
    p.set_defaults(run=_cmd_show)


def _cmd_show(args: argparse.Namespace, console: Console) -> None:
    _present_partition(Partition.from_json(args.path), args, console)


# ==================================================================== demo


def _add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a small GPT pipelined over 2 stages on the CPU (about a minute)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.set_defaults(run=_cmd_demo)


def _cmd_demo(args: argparse.Namespace, console: Console) -> None:
    from smpart.runtime.demo import run_demo as train_demo

    train_demo(steps=args.steps, console=console)


# ==================================================================== plan


def _add_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="choose pp × tp × dp, micro-batches and stages for a cluster")
    _add_model_arguments(p)
    p.add_argument("--cluster", required=True, metavar="TOML", help="cluster TOML file")
    p.add_argument("--global-batch", type=int, required=True, help="samples per training step")
    p.add_argument("--top", type=int, default=10, help="plans to list (default 10)")
    p.add_argument("--pipeline", choices=("interleaved", "simple"), default="interleaved")
    p.add_argument("--virtual-stages", action="store_true",
                   help="also price 1F1B over two stages per rank (Config.virtual_stages=2)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON instead of a table")
    _add_html_arguments(p)
    p.set_defaults(run=_cmd_plan)


def _cmd_plan(args: argparse.Namespace, console: Console) -> None:
    from smpart.planner import Cluster, plan
    from smpart.tensor_parallel import record_split_shares
    from smpart.tracing.tracer import trace

    cluster = Cluster.from_toml(args.cluster)
    model, example_args, kwargs = load_example(args.model)
    first = example_args[0] if example_args else None
    trace_batch = int(first.shape[0]) if getattr(first, "ndim", 0) >= 1 else 1
    tree = record_split_shares(trace(model, example_args, kwargs, device=args.device), model)
    plans = plan(tree, cluster, args.global_batch, top=args.top, pipeline=args.pipeline,
                 trace_batch=trace_batch, virtual_stages=args.virtual_stages)
    if args.json:
        print(plans.to_json(args.top))
    else:
        plans.show(args.top, console=console)
    if args.html and plans.plans:
        _write_html(plans.best.partition, args.html, open_browser=args.open, plans=plans, model=args.model,
                    console=Console(stderr=True) if args.json else console)


COMMANDS: list[Callable[[Any], None]] = [_add_partition, _add_trace, _add_show, _add_demo, _add_plan]


# ==================================================================== shared pieces


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODULE:FACTORY", help="e.g. examples.models:gpt2")
    p.add_argument("--device", default="meta", help="device to trace on (default meta: no weights allocated)")


def _add_view_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-depth", type=int, default=None, help="expand the tree at most this deep")


def _present_partition(part: Partition, args: argparse.Namespace, console: Console) -> None:
    """Every way a partition is shown from the command line (the terminal view, for now)."""
    show(part, console=console, max_depth=args.max_depth)
    if getattr(args, "html", None):
        _write_html(part, args.html, open_browser=args.open, console=console)


def _add_html_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--html", metavar="PATH", help="also write the interactive explorer (one offline file)")
    p.add_argument("--open", action="store_true", help="open the --html file in the default browser")


def _write_html(
    part: Partition, path: str, *, open_browser: bool, console: Console, plans: Any = None, model: str = ""
) -> None:
    """Write the explorer (with its memory-weight × stages grid) and optionally open it.

    With ``plans``, ``part`` is the best plan's partition (its ``meta`` names each stage's devices
    and their memory, so the page draws every stage against its capacity).
    """
    import webbrowser
    from pathlib import Path

    if model:
        part.meta.setdefault("model", model)
    to_html(part, path, plans=plans)
    console.print(f"explorer written to {path}")
    if open_browser:
        webbrowser.open(Path(path).resolve().as_uri())


def parse_pins(pairs: Sequence[str]) -> dict[str, int]:
    """``["lm_head=3", ...]`` → ``{"lm_head": 3}``."""
    pins: dict[str, int] = {}
    for pair in pairs:
        name, sep, stage = pair.rpartition("=")
        if not sep or not name or not stage.strip().lstrip("-").isdigit():
            raise ConfigError(f"--pin expects MODULE=STAGE (like lm_head=3), got {pair!r}")
        pins[name] = int(stage)
    return pins


def load_example(spec: str, **factory_kwargs: Any) -> tuple[Any, tuple, dict]:
    """Import ``MODULE:FACTORY``, call ``FACTORY(**factory_kwargs)``, return ``(model, args, kwargs)``."""
    module_name, sep, factory_name = spec.partition(":")
    if not sep or not module_name or not factory_name:
        raise ConfigError(f"expected MODULE:FACTORY (like examples.models:gpt2), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module: any failure is theirs to fix
        raise ConfigError(f"cannot import {module_name!r}: {type(err).__name__}: {err}") from err
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError(f"module {module_name!r} has no function {factory_name!r}")
    try:
        made = factory(**factory_kwargs)
    except Exception as err:
        raise ConfigError(f"{spec}() failed: {type(err).__name__}: {err}") from err
    return _unpack_example(made, spec)


def _unpack_example(made: Any, spec: str) -> tuple[Any, tuple, dict]:
    if hasattr(made, "model") and hasattr(made, "args"):
        model, args, kwargs = made.model, made.args, getattr(made, "kwargs", None) or {}
    elif isinstance(made, tuple) and len(made) in (2, 3):
        model, args, kwargs = made[0], made[1], (made[2] if len(made) == 3 else {})
    else:
        raise ConfigError(
            f"{spec}() returned {type(made).__name__}; return an Example or a tuple (model, args[, kwargs])"
        )
    if not isinstance(args, (tuple, list)):
        args = (args,)
    return model, tuple(args), dict(kwargs)


def trace_factory(spec: str, device: str = "meta", factory_kwargs: dict[str, Any] | None = None) -> Any:
    """The costed `ModuleTree` of the model ``MODULE:FACTORY(**factory_kwargs)`` builds."""
    model, args, kwargs = load_example(spec, **(factory_kwargs or {}))
    from smpart.tracing.tracer import trace  # imports torch: only commands that trace pay for it

    return trace(model, args, kwargs, device=device)


if __name__ == "__main__":
    sys.exit(main())
