"""Placement: trace and partition a model once, then put every module where its stage lives.

The runtime never computes a partition of its own: it traces the model on the first
micro-batch's call (`smpart.tracing.tracer.trace`), hands the tree to the partitioner
(`smpart.partitioning.api.partition`) with the configured ``memory_weight`` and pins, and applies the
`Partition` it gets back. Applying means, for every module: move its *own* parameters and buffers
to its stage's device in place (``p.data = p.data.to(device)``, so optimizers already holding
the parameters keep working) and install a `StagedForward` that routes calls to its stage.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from smpart.config import Config
from smpart.devices import DeviceType, as_device_type
from smpart.distributed.launch import Layout, named_device
from smpart.errors import ConfigError, PartitionError
from smpart.partitioning.api import partition
from smpart.partitioning.result import Partition
from smpart.runtime.placement import activation_checkpointing as ac
from smpart.runtime.reference.calls import install, uninstall
from smpart.runtime.reference.stage import StageServer
from smpart.tensor_parallel.layers import is_dtensor
from smpart.tracing.tracer import trace


def choose_devices(config: Config) -> list[torch.device]:
    """Each stage's device: ``config.devices``, else one CUDA device per stage if there are enough,
    else the CPU for every stage."""
    stages = config.pipeline_parallel_degree
    if config.devices:
        return [named_device(d) for d in config.devices[:stages]]
    if torch.cuda.is_available() and torch.cuda.device_count() >= stages:
        return [torch.device("cuda", i) for i in range(stages)]
    return [torch.device("cpu")] * stages


def make_partition(model: nn.Module, args: tuple, kwargs: dict, config: Config,
                   pins: dict[str, int]) -> Partition:
    """Trace ``model`` on one call's arguments and partition it as configured.

    Modules named by ``config.activation_checkpointing`` (or `set_activation_checkpointing`)
    recompute their forward in the backward; they are set up before the trace, so the trace and
    the partition price them as checkpointed. One whose modules the partition spreads over
    several stages is left un-checkpointed, with a warning: recomputing it would call other
    stages from inside a backward segment."""
    names = ac.checkpointed_names(model, config.activation_checkpointing)
    if names:
        ac.apply(model, names)
    partition = _trace_and_partition(model, args, kwargs, config, pins)
    _keep_checkpoints_within_stages(model, names, partition)
    keep_hf_checkpoints_within_stages(model, partition)
    return partition


def _keep_checkpoints_within_stages(model: nn.Module, names: list[str], partition: Partition) -> None:
    stages = module_stages(model, partition)
    for name in names:
        spread = _stages_under(stages, name)
        if len(spread) > 1:
            ac.uncheckpoint(model.get_submodule(name))
            warnings.warn(f"smpart: activation checkpointing of {name!r} is off: the partition put its "
                          f"modules on stages {sorted(spread)}; checkpoint its children instead ({name}.*)",
                          stacklevel=3)


def keep_hf_checkpoints_within_stages(model: nn.Module, partition: Partition) -> None:
    """Hugging Face's gradient checkpointing (``model.gradient_checkpointing_enable()``, a module's
    ``gradient_checkpointing`` flag) recomputes the flagged module's forward in the backward. Where
    the partition spread that module over several stages, the recomputation would call the other
    stages from inside a backward segment, which waits for their turn (a hang): there it is turned
    off, with a warning, as smpart's own checkpointing is. Checked at placement and at every step
    (the flag may be set after the first step); every rank decides alike, from the partition.
    Each step looks at the modules that can hold the flag only (`_flaggable`)."""
    flagged = [name for name, m in _flaggable(model, partition) if _hf_checkpointed(m)]
    if not flagged:
        return
    stages = module_stages(model, partition)
    for name in flagged:
        spread = _stages_under(stages, name)
        if len(spread) > 1:
            model.get_submodule(name).gradient_checkpointing = False
            warnings.warn(f"smpart: Hugging Face's gradient checkpointing of {name or 'the model'!r} is "
                          f"off: the partition put its modules on stages {sorted(spread)}, and recomputing "
                          "it would call other stages from inside the backward. Layers placed whole on one "
                          "stage still recompute", stacklevel=3)


#: model -> (its partition, the modules with a ``gradient_checkpointing`` attribute, named)
_FLAGGABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _flaggable(model: nn.Module, partition: Partition) -> list[tuple[str, nn.Module]]:
    """The modules that can hold Hugging Face's flag: those with the attribute (transformers sets
    the flag only where a module has it: a class attribute of its checkpointing layers), found
    once per model and partition, not at every step (a walk of the whole tree)."""
    known = _FLAGGABLE.get(model)
    if known is None or known[0] is not partition:
        named = [(name, m) for name, m in model.named_modules() if hasattr(m, "gradient_checkpointing")]
        known = _FLAGGABLE[model] = (partition, named)
    return known[1]


def _hf_checkpointed(module: nn.Module) -> bool:
    """Whether Hugging Face checkpoints ``module``'s calls: its flag is set, and it is one of the
    layers that act on it (`GradientCheckpointingLayer`, where transformers has that class; before
    it, the base models that wrap their layers' calls hold the flag)."""
    if getattr(module, "gradient_checkpointing", False) is not True:
        return False
    layers = sys.modules.get("transformers.modeling_layers")
    layer_class = getattr(layers, "GradientCheckpointingLayer", None)
    return layer_class is None or isinstance(module, layer_class)


def _stages_under(stages: dict[str, int], name: str) -> set[int]:
    """The stages of module ``name`` and the modules inside it."""
    prefix = f"{name}." if name else ""
    return {stage for other, stage in stages.items() if other == name or other.startswith(prefix)}


def _trace_and_partition(model: nn.Module, args: tuple, kwargs: dict, config: Config,
                         pins: dict[str, int]) -> Partition:
    real = config.trace_device == "real"
    tree = trace(model, args, kwargs, device=None if real else "meta", measure_time=real,
                 param_memory_factor=config.param_memory_factor)
    devices = stage_device_types(config)
    if devices is not None and config.virtual_stages > 1:  # stage s runs on rank s % pp
        devices = [devices[s % config.pipeline_parallel_degree] for s in range(config.partition_stages)]
    part = partition(tree, config.partition_stages, memory_weight=config.memory_weight, pin=pins,
                     devices=devices)
    if config.virtual_stages > 1:
        part.meta["ranks"] = config.pipeline_parallel_degree
    return part


def ranks_of(partition: Partition) -> int:
    """The pipeline ranks a partition runs on: its stages, or fewer with virtual stages."""
    return int(partition.meta.get("ranks", partition.num_stages))


def stage_device_types(config: Config) -> list[DeviceType] | None:
    """The device type each stage is cut for, from ``config.device_types`` (one per rank): the
    slowest among the stage's ranks (its replicas and tensor-parallel shards); None with one stage
    (nothing to cut) or no types."""
    kinds, pp, tp = config.device_types, config.pipeline_parallel_degree, config.tensor_parallel_degree
    if not kinds or pp == 1:
        return None
    if len(kinds) % (pp * tp):
        raise ConfigError(f"device_types lists {len(kinds)} type(s), not a multiple of "
                          f"pipeline_parallel_degree x tensor_parallel_degree = {pp * tp}; give one per rank")
    layout = Layout(pp, len(kinds) // (pp * tp), tp, config.placement_strategy)
    stages = []
    for stage in range(pp):
        ranks = [layout.rank_of(stage, d, t) for d in range(layout.dp) for t in range(tp)]
        types = [as_device_type(kinds[r]) for r in ranks]
        stages.append(min(types, key=lambda k: (k.tflops, k.memory_bytes)))
    return stages


def module_stages(model: nn.Module, partition: Partition) -> dict[str, int]:
    """The pipeline rank (the runtime's stage) of every module name: its partition stage, modulo
    the ranks with virtual stages; a module the tree does not know goes with its parent."""
    ranks = ranks_of(partition)
    stages: dict[str, int] = {}
    for name, _ in model.named_modules(remove_duplicate=False):
        try:
            stages[name] = partition.stage_of(name) % ranks
        except PartitionError:
            stages[name] = stages.get(name.rpartition(".")[0], 0)
    return stages


def subtree_stages(stages: dict[str, int]) -> dict[str, set[int]]:
    """Module name -> the stages of the modules in its subtree (`module_stages`' names)."""
    spread: dict[str, set[int]] = {}
    for name, stage in stages.items():
        parts = name.split(".") if name else []
        for i in range(len(parts) + 1):
            spread.setdefault(".".join(parts[:i]), set()).add(stage)
    return spread


def within(name: str, modules: Collection[str]) -> bool:
    """Whether module ``name`` is one of ``modules`` or inside one."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def recomputed_modules(model: nn.Module, partition: Partition) -> set[str]:
    """The modules each rank computes for itself in a step program instead of receiving what they
    return: the top-most with no parameters and only derived buffers (non-persistent, such as a
    rotary embedding's inverse frequencies; none on the meta device), called from code that spans
    stages (their parent's modules are on several). What such a module returns depends on its
    arguments alone; sent, it would cross every cut once per micro-batch (Llama's cos and sin
    tables), where torch's pipelines compute it on each stage. The reference runtime still runs
    it on its own stage, and every rank keeps its buffers (`place_on_rank`)."""
    spread = subtree_stages(module_stages(model, partition))
    found: set[str] = set()
    for name, module in model.named_modules():
        if not name or len(spread.get(name.rpartition(".")[0], ())) < 2:
            continue
        if next(module.parameters(), None) is not None:
            continue
        buffers = [(m, key, b) for m in module.modules() for key, b in m._buffers.items() if b is not None]
        if buffers and all(key in m._non_persistent_buffers_set and not b.is_meta for m, key, b in buffers):
            found.add(name)
    return found


def placed_buffers(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, int]]:
    """Every buffer of ``module`` and below, as it is now: (its module, its name, it, its version)."""
    return [(m, key, b, b._version)
            for m in module.modules() for key, b in m._buffers.items() if b is not None]


def changed_buffer(buffers: list[tuple[nn.Module, str, torch.Tensor, int]]) -> str | None:
    """The name of the first of ``buffers`` (`placed_buffers`) replaced or written since, if any."""
    for module, key, tensor, version in buffers:
        now = module._buffers.get(key)
        if now is not tensor or tensor._version != version:
            return key
    return None


def place(model: nn.Module, model_id: int, partition: Partition, servers: list[StageServer]) -> None:
    """Move each module's own tensors to its stage's device (materialised and initialised there if
    they were built on the meta device, as on processes) and route its calls there (threads: every
    stage's server is here)."""
    if ranks_of(partition) != len(servers):
        raise PartitionError(f"the partition runs on {ranks_of(partition)} ranks but the runtime runs "
                             f"{len(servers)}; re-partition with num_stages={len(servers)}")
    stages = module_stages(model, partition)
    _index_owners(model)
    moved: set[int] = set()
    fresh: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        server = servers[stages[name]]
        own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        if any(t.is_meta for t in own):
            if _materialise_own_tensors(module, server.device, moved)[1]:
                fresh.append((name, module))
        else:
            _move_own_tensors(module, server.device, moved)
        install(module, model_id, name, server.stage)
        server.modules[(model_id, name)] = module
    _initialise(model, fresh, loading=False)


def place_on_rank(model: nn.Module, model_id: int, partition: Partition, server: StageServer,
                  loading: bool = False, seed: int | None = None, loaded: Collection[str] = (),
                  recomputed: Collection[str] = ()) -> int:
    """Processes: route every module's calls to its stage; keep this rank's modules (materialised on
    its device and initialised if they were built on the meta device, from a generator seeded with
    ``seed`` if given; ``loading``: weights will be loaded into them; ``loaded``: the names of the
    tensors a load will write, whose modules are not initialised first) and release every other
    stage's tensors to the meta device, so a rank holds only its own stage, but the buffers of the
    ``recomputed`` modules (`recomputed_modules`), kept on this rank's device. Returns the parameter
    bytes kept here."""
    stages = module_stages(model, partition)
    mine = {name for name, stage in stages.items() if stage == server.stage}
    _index_owners(model)
    kept = 0
    seen: set[int] = set()
    fresh: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():  # own modules first: a tied weight is kept, not released
        if name in mine:
            size, materialised = _materialise_own_tensors(module, server.device, seen)
            kept += size
            if materialised:
                fresh.append((name, module))
            server.modules[(model_id, name)] = module
    fresh = [(name, module) for name, module in fresh if not _all_loaded(name, module, loaded)]
    with _seeded(seed, server.device):
        _initialise(model, fresh, loading)
    for name, module in model.named_modules():
        if name not in mine:
            if within(name, recomputed):
                _move_own_tensors(module, server.device, seen)
            else:
                _release_own_tensors(module, seen)
        install(module, model_id, name, stages[name])
    return kept


#: Parameters placement had to replace by new objects: id(old) -> (old, new), the old one weakly
#: held (keyed by identity: tensors compare by value). Tensor parallelism's shards are such (a
#: DTensor cannot take a plain parameter's place in the same object), as is a parameter autograd
#: still referenced, which could not be changed in place. Every optimizer adopts the new ones
#: before it steps (`adopt_replacements`): the optimizer a script made from ``model.parameters()``
#: before the first step would otherwise go on updating the old ones, which nothing uses. An entry
#: lives as long as its old parameter: once nothing holds that (every optimizer adopted the new
#: one), nothing can need the new one from here, and a model let go is freed whole.
REPLACED: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
_adopting: Any = None  # the handle of torch's global optimizer hook, once a parameter was replaced


def replacement_of(param: nn.Parameter) -> nn.Parameter | None:
    entry = REPLACED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def remember_replacement(old: nn.Parameter, new: nn.Parameter) -> None:
    """Record that ``new`` took ``old``'s place; from now on every optimizer adopts it as it steps
    (`torch.optim.optimizer.register_optimizer_step_pre_hook`: plain torch optimizers too)."""
    global _adopting
    key = id(old)

    def forget(ref: weakref.ref) -> None:
        if REPLACED.get(key, (None,))[0] is ref:  # not an entry for a later object of that id
            del REPLACED[key]

    REPLACED[key] = (weakref.ref(old, forget), new)
    if _adopting is None:
        _adopting = register_optimizer_step_pre_hook(_adopt_before_step)


def _adopt_before_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    adopt_replacements(optimizer)


def adopt_replacements(optimizer: torch.optim.Optimizer) -> None:
    """Put in ``optimizer`` each replaced parameter's replacement, with the state it had."""
    if not REPLACED:
        return
    for group in optimizer.param_groups:
        for i, param in enumerate(group["params"]):
            new = replacement_of(param)
            if new is not None:
                group["params"][i] = new
                if param in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(param)


def _swap_in(module: nn.Module, name: str, param: nn.Parameter, new: nn.Parameter) -> None:
    """Make ``param`` (same object, so optimizers holding it keep working) become ``new``; when
    autograd still references it, put ``new`` in its place instead and remember the replacement."""
    try:
        torch.utils.swap_tensors(param, new)
    except RuntimeError:
        owners = [owner for ref in _owners.get(id(param), ()) if (owner := ref()) is not None]
        for owner in owners or [module]:
            for key, value in owner._parameters.items():
                if value is param:
                    owner._parameters[key] = new
        remember_replacement(param, new)
        if param.device.type != "meta":
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # free its storage


#: The modules of the model being placed, weakly held: a placement's index keeps no model alive.
_owners: dict[int, list[weakref.ref[nn.Module]]] = {}


def _index_owners(model: nn.Module) -> None:
    """Every module holding each parameter: a tied one has several, and all must see a replacement."""
    _owners.clear()
    for owner in model.modules():
        for param in owner._parameters.values():
            if param is not None:
                _owners.setdefault(id(param), []).append(weakref.ref(owner))


def _materialise_own_tensors(module: nn.Module, device: torch.device, seen: set[int]) -> tuple[int, bool]:
    """Move (or, from meta, allocate) a module's own tensors on ``device``: their bytes, and whether
    any came from the meta device (uninitialised until `_initialise`)."""
    size = 0
    fresh = False
    for name, param in list(module._parameters.items()):
        if param is None or id(param) in seen:
            continue
        seen.add(id(param))
        size += param.numel() * param.element_size()
        if param.device.type == "meta":
            fresh = True
            _swap_in(module, name, param, nn.Parameter(_unset_like(param, device), param.requires_grad))
        elif param.device != device:
            param.data = param.data.to(device)
    for key, buffer in module._buffers.items():
        if buffer is not None and buffer.device != device:
            fresh |= buffer.device.type == "meta"
            module._buffers[key] = (_unset(buffer, device) if buffer.device.type == "meta"
                                    else buffer.to(device))
    return size, fresh


def _unset_like(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`_unset` for a parameter; a tensor-parallel shard (a DTensor on meta) stays a DTensor on
    its mesh, its own shard made on ``device``."""
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor

        local = _unset(param.to_local(), device)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return _unset(param, device)


def _unset(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``like``'s shape and dtype on ``device`` that no initialisation wrote yet: NaN
    where it can be, so that `_initialise` tells a module its scheme did not reach."""
    if like.dtype.is_floating_point or like.dtype.is_complex:
        return torch.full(like.shape, float("nan"), dtype=like.dtype, device=device)
    return torch.empty(like.shape, dtype=like.dtype, device=device)


def _unset_left(module: nn.Module) -> bool:
    """Whether one of the module's own tensors is still all NaN (`_unset`): nothing initialised it
    (a tensor-parallel shard: this rank's own part, no collective)."""
    own = [t.to_local() if is_dtensor(t) else t
           for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    return any(t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex) and bool(torch.isnan(t).all())
               for t in own)


def _device_of(module: nn.Module) -> torch.device:
    param = next(module.parameters(recurse=False))
    return (param.to_local() if is_dtensor(param) else param).device



def _all_loaded(name: str, module: nn.Module, loaded: Collection[str]) -> bool:
    """Whether a load will write every one of the module's own tensors (its values would go unused:
    a 1 B-parameter model loaded at placement is not initialised first)."""
    prefix = f"{name}." if name else ""
    own = [key for key, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]
    return bool(own) and all(prefix + key in loaded for key in own)


def _initialise(model: nn.Module, fresh: list[tuple[str, nn.Module]], loading: bool) -> None:
    """Give the modules materialised from the meta device their first values, children before their
    parents (as ``nn.Module.apply``): each module's ``reset_parameters()``, then, in a Hugging Face
    model, its own scheme (``_init_weights``, which its constructor applies, buffers such as rotary
    frequencies included). A module neither reached keeps unset values: said, unless weights are
    to be loaded."""
    hugging_face_init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for _, module in reversed(fresh):
            # A tensor-parallel layer: the plain module it splits is initialised, then sharded
            twin = module.plain_twin(_device_of(module)) if hasattr(module, "plain_twin") else None
            target = module if twin is None else twin
            reset = getattr(target, "reset_parameters", None) or getattr(target, "_reset_parameters", None)
            if callable(reset):  # torch's MultiheadAttention has only the private one
                reset()
            if callable(hugging_face_init):  # its scheme, over torch's, for the modules it knows
                hugging_face_init(target)
            if twin is not None:
                module.take_values(twin)
            twin = target = reset = None  # gone before the next twin is made: one whole layer at a time
    blank = [name or type(model).__name__ for name, module in fresh if _unset_left(module)]
    if blank and not loading:
        warnings.warn(f"smpart: {len(blank)} module(s) built on the meta device have no reset_parameters() "
                      f"({', '.join(sorted(blank)[:5])}{' ...' if len(blank) > 5 else ''}): their tensors on "
                      "this rank hold uninitialised memory (NaN). Load weights (smpart.load_checkpoint "
                      "before the first step, or smpart.load_weights), or give those modules a "
                      "reset_parameters()", stacklevel=2)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Draw from a generator seeded with ``seed`` (the replicas of a stage initialise alike,
    `replicas`), leaving the caller's random state as it was; nothing changes without a seed."""
    if seed is None:
        yield
        return
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


def fill_released(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Give tensors this rank released to the meta device (by qualified name) the values another
    rank kept (`replicas.make_whole`): parameters stay the objects optimizers hold."""
    _index_owners(model)
    for name, value in values.items():
        prefix, _, attr = name.rpartition(".")
        module = model.get_submodule(prefix)
        param = module._parameters.get(attr)
        if param is not None:
            _swap_in(module, attr, param, nn.Parameter(value, param.requires_grad))
        else:
            module._buffers[attr] = value


def _release_own_tensors(module: nn.Module, seen: set[int]) -> None:
    for name, param in list(module._parameters.items()):
        if param is None or id(param) in seen or param.device.type == "meta":
            continue
        seen.add(id(param))
        meta = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
        _swap_in(module, name, param, meta)
    for key, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[key] = torch.empty_like(buffer, device="meta")


def unplace(model: nn.Module, servers: list[StageServer]) -> None:
    """Undo `place`'s routing and activation checkpointing (tensors stay where they are)."""
    for module in model.modules():
        uninstall(module)
    ac.remove(model)
    for server in servers:
        server.modules.clear()


def _move_own_tensors(module: nn.Module, device: torch.device, moved: set[int]) -> None:
    for param in module.parameters(recurse=False):
        if id(param) in moved:
            continue
        moved.add(id(param))
        if param.device != device:
            param.data = param.data.to(device)
            if param.grad is not None:
                param.grad = param.grad.to(device)
    for key, buffer in module._buffers.items():
        if buffer is not None and buffer.device != device:
            module._buffers[key] = buffer.to(device)


def pins_for(model: nn.Module, config_pins: dict[str, int], module_pins: dict[Any, int]) -> dict[str, int]:
    """``config.pin`` plus the `set_partition` calls made for modules of ``model``."""
    pins = dict(config_pins)
    for name, module in model.named_modules():
        if module in module_pins:
            pins[name] = module_pins[module]
    return pins
