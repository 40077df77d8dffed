"""When a step runs its program, and what sends it back to the reference runtime.

A model's programs are kept per *key*: the step function, the micro-batch count and schedule,
each micro-batch's inputs (structure, shapes, dtypes, plain values but numbers and listed
strings), the caller's grad mode and autocast, and every module's train/eval flag. A number the
step takes (a loss scale, the step's index) or a string in a list (sample ids) may change inside a
program: every rank has it (under ``torchrun`` the first rank's, `BeginProgram`), and what it
changes beyond the glue's own arithmetic is checked as any other difference (another sequence of
calls, a call with another signature). A key's life:

1. unseen: the step runs on the reference runtime, which records the templates of its calls
   (`templates.Recorder`);
2. recorded: the step runs in the discovery order (a program without a schedule yet), which
   records what every rank's glue does in one micro-batch;
3. built: every later step with that key runs the scheduled program (`actions.build`).

So batches of a few sequence lengths each get their program and keep it. What the key does not
cover (a module attribute the glue branches on, a routing decision that moves tensors between
ranks, an output whose shape depends on the data) is checked as the program runs: the rank that
sees the glue do something else than the program raises `glue.Diverged` before it sends or waits
for anything of it, every rank of the step gives up the program, undoes the step (gradients,
the buffers the model changes, the random state: `Snapshot`) and runs it on the reference
runtime, which records again. A key that diverges twice is not tried again, nor a model whose
keys diverged four times: its steps run on the reference runtime, and the timeline says why.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from smpart.runtime.model import DistributedModel
from smpart.runtime.placement.place import module_stages, placed_buffers, ranks_of, subtree_stages, within
from smpart.runtime.program.templates import UNPREDICTABLE, signature

#: A key that diverged this many times runs on the reference runtime from then on.
KEY_DIVERGENCES = 2
#: A model whose keys diverged this many times in all runs on the reference runtime from then on.
MODEL_DIVERGENCES = 4
#: At most this many keys get a program (a step whose plain arguments change every step would
#: otherwise record every step).
MAX_KEYS = 16

#: The step's numbers enter its key by type only (`step_key`, `_as_keyed`).
_NUMBER_KINDS = {int: "<int>", float: "<float>"}


@dataclass
class Decision:
    """How a step runs: ``program`` None and ``discover`` False: on the reference runtime (which
    records when ``record``); else the program, or the discovery order."""

    key: Any
    reason: str
    record: bool = False
    discover: bool = False
    program: Any = None

    @property
    def reference(self) -> bool:
        return self.program is None and not self.discover


class ModelPrograms:
    """A placed model's programs under one ``init``: templates, keys, programs, divergences."""

    def __init__(self, model: Any, partition: Any, stage_of_rank: Any = None,
                 recomputed: Collection[str] = ()) -> None:
        self.model_id = model.model_id
        stages = module_stages(model.module, partition)
        self.size = ranks_of(partition)
        #: (model id, name) -> the buffers, as placed, of each module every rank computes for itself
        #: (`placement.place.recomputed_modules`): its calls run as glue, on every rank.
        self.recomputed = {(model.model_id, name): placed_buffers(model.module.get_submodule(name))
                           for name in recomputed}
        self.whole = {key: stage for key, stage in whole_modules(model.model_id, stages).items()
                      if not within(key[1], recomputed)}
        #: The model's modules, whose train/eval flags are part of every step's key; its parameters
        #: and buffers, for `Snapshot`.
        self.modules = list(model.module.modules())
        self.parameters = list(model.module.parameters())
        self.buffers = list(model.module.named_buffers())
        #: The shapes of glue operations on placeholders, by what decides them (`glue._meta_key`).
        self.meta_cache: dict = {}
        #: Per rank: the placeholders of the last step, by place in a micro-batch's glue (`glue`).
        self.kept_placeholders: dict[int, dict] = {}
        self.owners = tensor_owners(model.module, stages)
        for buffers in self.recomputed.values():  # held by every rank
            for *_, tensor, _version in buffers:
                self.owners.pop(id(tensor), None)
        self.templates: dict[tuple, Any] = {}
        #: Modules whose calls' shapes differed between the micro-batches of a step (routing by data).
        self.varies: set[tuple[int, str]] = set()
        self.recorded: set[Any] = set()
        self.programs: dict[Any, Any] = {}
        self.divergences: dict[Any, int] = {}
        self.last_divergence: dict[Any, str] = {}
        self.total_divergences = 0
        self.disabled: str | None = None
        self.mutable_buffers: set[str] | None = None
        #: Under torchrun, on the first stage's rank: how many templates the other ranks have, and
        #: for each key the program and the input templates sent to them (`BeginProgram`).
        self.sent_to_ranks = 0
        self.sent_programs: dict[Any, Any] = {}
        self.sent_inputs: dict[Any, list] = {}
        #: On the other ranks: for each key, the input templates last received.
        self.inputs: dict[Any, list] = {}
        #: Under torchrun, each rank's routes, noted in a key's last framed run (`routes`); on the
        #: first stage's rank, the keys whose last run's routes agreed on every rank: direct next.
        self.routes: dict[Any, Any] = {}
        self.direct: set[Any] = set()
        #: The program built or run last (`smpart.program_of`).
        self.last: Any = None

    # ================================================================ deciding
    def decide(self, key: Any, enabled: bool) -> Decision:
        if not enabled:
            return Decision(key, "step programs are off (Config.step_programs, SMPART_PROGRAMS=0)")
        if self.disabled is not None:
            return Decision(key, self.disabled)
        if self.divergences.get(key, 0) >= KEY_DIVERGENCES:
            return Decision(
                key,
                f"this kind of step diverged from its program {KEY_DIVERGENCES} times (last: "
                f"{self.last_divergence.get(key, '?')})",
            )
        program = self.programs.get(key)
        if program is not None:
            self.last = program
            return Decision(key, "", program=program)
        if key in self.recorded:
            return Decision(key, "", discover=True)
        if len(self.recorded) >= MAX_KEYS:
            return Decision(
                key,
                f"{MAX_KEYS} kinds of step (input shapes, strings and bools the step takes) have programs "
                "already; this one runs on the reference runtime",
            )
        return Decision(
            key,
            "recording: the first step of this kind (inputs' shapes, modes) runs on the reference runtime",
            record=True,
        )

    def learn_templates(self, key: Any, templates: dict[tuple, Any]) -> None:
        for call, template in templates.items():
            if call[0] == "demoted":  # a module placed whole that calls another stage: glue
                self.whole.pop(call[1:], None)
            elif call[0] == "varies":
                self.varies.add(call[1:])
            if call[0] in ("demoted", "varies"):
                self.templates[call] = template  # kept, for the other ranks (`BeginProgram`)
                continue
            known = self.templates.get(call)
            if known is None or template == UNPREDICTABLE:
                self.templates[call] = template
            elif known != template:
                self.templates[call] = UNPREDICTABLE
        self.recorded.add(key)

    def diverged(self, key: Any, why: str) -> None:
        self.last_divergence[key] = why
        self.divergences[key] = self.divergences.get(key, 0) + 1
        self.total_divergences += 1
        self.programs.pop(key, None)
        self.recorded.discard(key)
        if self.total_divergences >= MODEL_DIVERGENCES:
            self.disabled = (
                f"this model's steps diverged from their programs {self.total_divergences} times "
                f"(last: {why})"
            )

    def cannot(self, key: Any, why: str) -> None:
        """A program cannot run this kind of step at all (found while discovering it)."""
        self.divergences[key] = KEY_DIVERGENCES
        self.recorded.discard(key)
        self.reasons = getattr(self, "reasons", {})
        self.reasons[key] = why

    def reason_for(self, key: Any) -> str | None:
        return getattr(self, "reasons", {}).get(key)


def whole_modules(model_id: int, stages: dict[str, int]) -> dict[tuple[int, str], int]:
    """(model id, name) -> stage, for every module whose whole subtree is on one stage."""
    return {(model_id, name): next(iter(found)) for name, found in subtree_stages(stages).items()
            if len(found) == 1}


def tensor_owners(model: nn.Module, stages: dict[str, int]) -> dict[int, int]:
    """id(parameter or buffer) -> the bit of the stage holding it."""
    owners: dict[int, int] = {}
    for name, module in model.named_modules():
        stage = stages.get(name, 0)
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and id(tensor) not in owners:
                owners[id(tensor)] = 1 << stage
    return owners


def step_key(fn: Any, pieces: list[tuple[tuple, dict]], config: Any, ambient: Any, model: Any) -> Any:
    """What a program depends on, as a hashable key."""
    def inputs(piece: tuple) -> tuple:
        args, kwargs = piece
        return signature(([_as_keyed(a) for a in args], {k: _as_keyed(v) for k, v in kwargs.items()}))

    programs = getattr(model, "_programs", None)
    modules = programs.modules if programs is not None else list(model.module.modules())
    modes = bytes(m.training for m in modules)
    return (
        getattr(fn, "__qualname__", repr(fn)),
        id(fn),
        len(pieces),
        config.pipeline,  # the name as configured: an alias keys alike every step
        config.active_microbatches,
        tuple(inputs(p) for p in pieces),
        ambient,
        modes,
    )


def _as_keyed(value: Any, listed: bool = False) -> Any:
    """A step argument as its key sees it: the model as nothing; a number by its type, and a
    string in a list or tuple (sample ids, file names) too; a string on its own, a bool, by value:
    they tend to choose a path, which keeps a program of its own."""
    kind = type(value)
    if isinstance(value, DistributedModel | nn.Module):
        return None
    if kind in _NUMBER_KINDS:
        return _NUMBER_KINDS[kind]
    if kind is str:
        return "<str>" if listed else value
    if kind is list or kind is tuple:
        return kind(_as_keyed(v, True) for v in value)
    if kind is dict:
        return {k: _as_keyed(v, listed) for k, v in value.items()}
    if value is None or isinstance(value, torch.Tensor):
        return value
    # a namedtuple, a registered container: its numbers by type
    return pytree.tree_map(lambda leaf: _NUMBER_KINDS.get(type(leaf), leaf), value)


class Snapshot:
    """What a program step may change before it finds it must run on the reference runtime:
    gradients, the buffers the model changes in its forward (BatchNorm's statistics), the random
    state. Taken before every program step, put back when one gives up."""

    def __init__(self, programs: ModelPrograms) -> None:
        self.grads = []
        for param in programs.parameters:
            grad = param.grad
            self.grads.append((param, None if grad is None else grad.detach().clone()))
        self.buffers = {}
        mutable = programs.mutable_buffers
        for name, buffer in programs.buffers:
            if buffer.device.type == "meta" or (mutable is not None and name not in mutable):
                continue
            self.buffers[name] = (buffer, buffer._version, buffer.detach().clone())
        self.rng = torch.get_rng_state()
        self.cuda_rng = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    def changed_buffers(self) -> set[str]:
        """The buffers whose contents changed since the snapshot (the model's mutable ones)."""
        return {name for name, (buffer, version, _) in self.buffers.items() if buffer._version != version}

    def restore(self) -> None:
        with torch.no_grad():
            for param, grad in self.grads:
                param.grad = grad
            for buffer, version, value in self.buffers.values():
                if buffer._version != version:
                    buffer.copy_(value)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
