"""The cost model: time per iteration and memory per device of one parallel strategy.

AMP's top-down decomposition, generalised to stages whose device groups differ:

* **Layer, on a stage.** A stage holds ``dp`` replicas, each a tensor-parallel group of ``tp``
  devices of one node. The ``dp × microbatch_size`` samples of a micro-batch step are shared by
  the pipeline replicas in proportion to their speed, as Metis and HexiScale share them, so
  replicas of unequal devices finish together: replica ``r`` takes micro-batches of
  ``replica_sizes[r]`` samples (whole samples, at least one, by largest remainder), the same on
  every stage, since a replica's micro-batch flows through all its stages: that is what the
  runtime runs (``Config.data_parallel_shares``). A replica's speed is ``tp`` × its slowest
  device × ``efficiency``, the slowest over its stages; a stage takes as long as its slowest
  replica: max over replicas of FLOPs × samples / speed. **Tensor parallelism** divides by ``tp``
  only what the runtime's swap-in splits: the tree records, per node and degree, the share of its FLOPs and
  parameters that are split and the bytes its collectives move (`SplitShare`, from the swap-in's
  own rule); the rest (norms, an attention with one head) runs whole on every rank of the group.
  Each collective costs ``2(tp−1)/tp · bytes / intra-node bw`` (an all-gather half that), plus
  ``collective_latency_s`` per call (the calls per micro-batch are recorded too). A tree
  without records is priced the idealised way: everything divides, plus Megatron's four
  all-reduces of each layer's output (two forward, two backward).
* **Memory-bound layers (a roofline).** A layer cannot run faster than its memory traffic
  allows: ``max(FLOPs / speed, traffic / (memory bandwidth × bandwidth_efficiency))``, where the
  traffic is twice the bytes its operations write (each written once, read back at least once),
  forward and backward. FLOPs alone would price attention over thousands of tokens with narrow
  heads (TransGAN's late layers: 4 FLOPs per byte) at a fraction of its real time; AMP profiles
  layers for this reason, smpart uses the traced ``op_bytes``. The max is taken node by node and
  then summed, so a layer's time does not depend on how coarsely the model was cut into layers
  (a compute-bound MLP does not hide a memory-bound attention beside it). Devices without a known
  memory bandwidth, and trees of measured times, are priced by FLOPs alone.
* **Pipeline.** ``(B − 1)·max_i t_i + Σ_i t_i + Σ_boundaries e_j`` for ``B`` micro-batches, where
  ``e_j`` sends the activation forward and its gradient back over the boundary's slowest link
  (``2·(α + bytes / bandwidth)``, ``α`` = ``message_latency_s``); ``t_i`` includes a fixed
  ``microbatch_overhead_s`` per micro-batch (zero by default).
* **Data parallel.** Each stage ring-all-reduces the gradients of what one rank holds
  (``2(n−1)/n · bytes / bw``, the slowest link among the stage's nodes); the slowest stage sets
  the time, added once per step.
* **Memory per device.** parameter state × ``bytes_per_param`` (of split parameters 1/tp) +
  activations of the micro-batches in flight (interleaved: ``pp − stage + 1``, the loss counting
  as a stage as in `smpart.runtime.schedule`, one stage alone 1; simple: all ``B``;
  those of split nodes 1/tp) + buffers, against
  ``memory_fraction`` of the device's memory. A micro-batch's activations are the tensors
  autograd saves for its backward, as the trace counted them (`LayerSeq.activation_bytes`), not
  the modules' outputs: those are 3-5× smaller for a transformer block (its attention scores and
  MLP hidden states are saved but never returned), so a plan priced by outputs can overflow.

* **Activation checkpointing.** A stage may checkpoint its layers (`smpart.planner.search` decides
  which): a checkpointed layer keeps only its root module's inputs (`LayerSeq`'s
  ``checkpoint_activation_bytes``) and runs its forward again in the backward: its nodes' forward
  FLOPs and forward memory traffic once more, and, under tensor parallelism, the two forward
  all-reduces once more. ``strategy(..., checkpointed=True)`` prices every layer that way.

``bytes_per_param`` defaults to 16: fp16 weights and gradients (2 + 2) plus fp32 master weights
and Adam's two moments (4 + 4 + 4), the mixed-precision Adam figure of ZeRO and Megatron. Pass
``bytes_per_param=None`` to use the tree's own ``param_memory_factor`` × parameter bytes instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from smpart.errors import PlanError
from smpart.planner.cluster import Cluster, Device
from smpart.planner.layers import LayerSeq, TensorSplit


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model (defaults: mixed-precision Adam on GPUs)."""

    #: Training-state bytes per parameter; None: the tree's param_memory_factor × param bytes.
    bytes_per_param: float | None = 16.0
    #: Bytes per parameter that data parallelism all-reduces (fp16 gradients).
    grad_bytes_per_param: float = 2.0
    #: Scale on the traced activation bytes (0.5: traced in fp32, trained in fp16; masks and
    #: integer indices do not halve, so this slightly underestimates them).
    activation_scale: float = 1.0
    #: Fraction of peak FLOP/s a layer achieves.
    efficiency: float = 0.4
    #: Fraction of peak memory bandwidth a memory-bound layer achieves.
    bandwidth_efficiency: float = 0.7
    #: Backward FLOPs as a multiple of forward FLOPs.
    backward_factor: float = 2.0
    #: Fraction of each device's memory a plan may use (the rest: CUDA context, fragmentation).
    memory_fraction: float = 0.9
    #: "interleaved" (1F1B-like: stage i holds pp − i micro-batches) or "simple" (holds all B).
    pipeline: str = "interleaved"
    #: Batch size the tree was traced with; costs scale linearly per sample.
    trace_batch: int = 1
    #: For a tree of measured times: FLOP/s of the device the times were taken on.
    reference_flops: float | None = None
    #: Latency of one point-to-point message, paid per boundary crossing on top of bytes / bandwidth
    #: (the alpha of the alpha-beta model: ~10 µs for NCCL, more for a Python transport).
    message_latency_s: float = 0.0
    #: Fixed time a stage spends per micro-batch beyond its layers (framework dispatch, kernel
    #: launches); the reason many tiny micro-batches stop paying off.
    microbatch_overhead_s: float = 0.0
    #: Latency of one tensor-parallel collective call, paid per call on top of its bytes (the
    #: alpha of the collectives: tens of µs for NCCL inside a node, milliseconds for gloo).
    collective_latency_s: float = 0.0


@dataclass(frozen=True)
class StageDevices:
    """Devices of one pipeline stage: ``dp`` replicas, each a tensor-parallel group of one node."""

    replicas: tuple[tuple[Device, ...], ...]

    @property
    def devices(self) -> list[Device]:
        return [d for replica in self.replicas for d in replica]

    @property
    def nodes(self) -> list[int]:
        return sorted({d.node for d in self.devices})

    def replica_speeds(self, options: CostOptions) -> np.ndarray:
        return np.array([len(r) * min(d.type.flops for d in r) * options.efficiency for r in self.replicas])

    def replica_bandwidths(self, options: CostOptions) -> np.ndarray:
        """Memory bytes/s each replica achieves (``inf`` where a device's bandwidth is unknown)."""
        def bandwidth(replica: tuple[Device, ...]) -> float:
            known = [d.type.memory_bandwidth for d in replica]
            if any(b is None for b in known):
                return np.inf
            return len(replica) * min(known) * options.bandwidth_efficiency

        return np.array([bandwidth(r) for r in self.replicas])

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for d in self.devices:
            counts[d.type.name] = counts.get(d.type.name, 0) + 1
        kinds = "+".join(f"{n}×{name}" for name, n in counts.items())
        nodes = self.nodes
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
        return f"{kinds} ({where})"


@dataclass
class StrategyCosts:
    """Everything `assign_layers` needs for one strategy, plus what it needs after."""

    layer_times: np.ndarray  # (k, L) seconds per micro-batch, fwd + bwd
    cut_costs: np.ndarray  # (L-1, max(k-1, 1)) seconds per micro-batch, per boundary
    #: (k, L): the largest fraction of any of the stage's device budgets the layer takes; a stage
    #: fits when its layers sum to <= 1 (a sum of per-layer maxima: safe for mixed stages).
    layer_memory: np.ndarray
    #: Per stage, per replica: (bytes per device of each layer, that device's usable bytes).
    replica_memory: list[list[tuple[np.ndarray, float]]]
    #: Per stage: whether these rows price its layers checkpointed.
    checkpointed: tuple[bool, ...] = ()
    #: Samples in a micro-batch of each pipeline replica (their shares of the global batch).
    replica_sizes: tuple[int, ...] = ()

    def mixed(self, checkpointed: StrategyCosts, stages: tuple[bool, ...]) -> StrategyCosts:
        """Rows of ``checkpointed`` for the stages flagged in ``stages``, this one's for the rest."""
        pick = np.array(stages)[:, None]
        return StrategyCosts(
            np.where(pick, checkpointed.layer_times, self.layer_times), self.cut_costs,
            np.where(pick, checkpointed.layer_memory, self.layer_memory),
            [ck if flag else plain for plain, ck, flag in
             zip(self.replica_memory, checkpointed.replica_memory, stages, strict=True)],
            tuple(stages), self.replica_sizes,
        )

    def stage_memory(self, starts: tuple[int, ...]) -> list[tuple[float, float]]:
        """(bytes, usable bytes) of the fullest device of each stage under this assignment."""
        bounds = [*starts, self.layer_memory.shape[1]]
        out = []
        for j, replicas in enumerate(self.replica_memory):
            used = [(row[bounds[j]:bounds[j + 1]].sum(), budget) for row, budget in replicas]
            out.append(max(used, key=lambda ub: ub[0] / ub[1]))
        return out


class CostModel:
    """Prices strategies for one model (`LayerSeq`) on one `Cluster`."""

    def __init__(self, layers: LayerSeq, cluster: Cluster, options: CostOptions | None = None) -> None:
        self.layers = layers
        self.cluster = cluster
        self.options = options or CostOptions()
        opts = self.options
        names = {"gpipe": "simple", "1f1b": "interleaved"}  # the runtime's names for SMP's two schedules
        if opts.pipeline in names:
            opts = self.options = dataclasses.replace(opts, pipeline=names[opts.pipeline])
        if opts.pipeline not in ("interleaved", "simple"):
            raise PlanError("pipeline must be 'gpipe' ('simple') or '1f1b' ('interleaved'), "
                            f"got {opts.pipeline!r}")
        per_sample = 1.0 / max(opts.trace_batch, 1)
        measured = layers.tree.compute_unit == "time"
        if measured:
            if opts.reference_flops is None:
                raise PlanError("this tree holds measured times: pass reference_flops (FLOP/s of the "
                                "device they were measured on) so they can be scaled to the cluster")
            to_flops = opts.reference_flops * per_sample  # measured fwd+bwd seconds -> fwd+bwd FLOPs
        else:
            to_flops = (1 + opts.backward_factor) * per_sample
        self.flops = layers.compute * to_flops
        # node by node, for the roofline: each node's own FLOPs and own memory traffic
        self.node_flops = layers.node_compute * to_flops
        # each byte an op writes is read back at least once: 2 bytes of traffic, forward and backward
        traffic = 0.0 if measured else 2.0 * opts.activation_scale * (1 + opts.backward_factor) * per_sample
        self.node_traffic = layers.node_op_bytes * traffic
        # a checkpointed layer's nodes run one more forward: its FLOPs and its traffic, forward only
        forward_to_flops = (opts.reference_flops if measured else 1.0) * per_sample
        self.recompute_flops = layers.node_recompute * forward_to_flops
        forward_traffic = 0.0 if measured else 2.0 * opts.activation_scale * per_sample
        self.recompute_traffic = layers.node_op_bytes * layers.node_recomputed * forward_traffic
        self._sample_times: dict[tuple[float, float, bool, int], np.ndarray] = {}
        self._splits: dict[int, TensorSplit | None] = {}
        self.act = layers.activation_bytes * opts.activation_scale * per_sample
        self.act_checkpointed = layers.checkpoint_activation_bytes * opts.activation_scale * per_sample
        outputs = np.array([root.activation_bytes for root in layers.roots], dtype=float)
        self.out = outputs * opts.activation_scale * per_sample
        self.cut = layers.cut_bytes * opts.activation_scale * per_sample
        if opts.bytes_per_param is None:
            self.state = layers.param_bytes * layers.tree.param_memory_factor
        else:
            self.state = layers.param_count * opts.bytes_per_param
        self.has_params = layers.param_count > 0

    # ---------------------------------------------------------------- per strategy
    @property
    def can_checkpoint(self) -> bool:
        """Whether checkpointing any layer would keep fewer bytes."""
        return bool(self.layers.checkpointable.any())

    def strategy(self, stages: list[StageDevices], tp: int, microbatch_size: int,
                 microbatches: int, checkpointed: bool = False,
                 replica_sizes: tuple[int, ...] | None = None) -> StrategyCosts:
        """Per-stage rows of one strategy; ``checkpointed``: every checkpointable layer is;
        ``replica_sizes``: each replica's micro-batch size (default: shared by speed)."""
        k, num = len(stages), len(self.layers)
        sizes = replica_sizes or self.replica_sizes(stages, microbatch_size)
        times = np.empty((k, num))
        memory = np.empty((k, num))
        replica_memory = []
        for j, stage in enumerate(stages):
            times[j] = self._layer_times(stage, tp, sizes, checkpointed)
            in_flight = (microbatches if self.options.pipeline == "simple"
                         else min(_interleaved_in_flight(j, k), microbatches))
            replicas = self._replica_memory(stage, tp, sizes, in_flight, checkpointed)
            memory[j] = np.max([row / budget for row, budget in replicas], axis=0)
            replica_memory.append(replicas)
        cuts = np.zeros((max(num - 1, 0), max(k - 1, 1)))
        for j in range(k - 1):
            bandwidth = self._p2p_bandwidth(stages[j], stages[j + 1])
            cuts[:, j] = 2 * (self.options.message_latency_s + self.cut * max(sizes) / bandwidth)
        return StrategyCosts(times, cuts, memory, replica_memory, (checkpointed,) * k, tuple(sizes))

    def fixed_overhead(self, pp: int, microbatches: int) -> float:
        """Per-micro-batch stage overhead through the pipeline: ``(B − 1 + pp)·o``.

        A constant added to every stage's time shifts ``(B − 1)·max t + Σ t`` by exactly this, so
        it never changes which boundaries are best, only what the plan costs.
        """
        return (microbatches - 1 + pp) * self.options.microbatch_overhead_s

    def replica_sizes(self, stages: list[StageDevices], microbatch_size: int) -> tuple[int, ...]:
        """Samples in each pipeline replica's micro-batch: the ``dp × microbatch_size`` of a step's
        micro-batch shared in proportion to each replica's speed (its slowest stage's), whole and
        at least one each, by largest remainder (ties to the earlier replica)."""
        speeds = np.min([stage.replica_speeds(self.options) for stage in stages], axis=0)
        total = microbatch_size * speeds.size
        if np.all(speeds == speeds[0]):
            return (microbatch_size,) * speeds.size
        exact = total * speeds / speeds.sum()
        sizes = np.maximum(np.floor(exact).astype(int), 1)
        while sizes.sum() > total:  # the ones raised to one sample came out of the largest
            sizes[int(np.argmax(np.where(sizes > 1, sizes - exact, -np.inf)))] -= 1
        for r in sorted(range(sizes.size), key=lambda r: (sizes[r] - exact[r], r))[:total - int(sizes.sum())]:
            sizes[r] += 1
        return tuple(int(s) for s in sizes)

    def _layer_times(self, stage: StageDevices, tp: int, sizes: tuple[int, ...],
                     checkpointed: bool = False) -> np.ndarray:
        per_sample = np.array([self.sample_times(speed, bandwidth, checkpointed, tp) for speed, bandwidth in
                               zip(stage.replica_speeds(self.options), stage.replica_bandwidths(self.options),
                                   strict=True)])  # (replicas, layers)
        # each replica runs its own micro-batch size; the stage waits for the last to finish
        compute = (np.asarray(sizes, dtype=float)[:, None] * per_sample).max(axis=0)
        if tp == 1:
            return compute
        bandwidth = min(self.cluster.bandwidth(r[0].node, r[0].node) for r in stage.replicas)
        biggest = max(sizes)
        latency = self.options.collective_latency_s * self._collective_calls(tp, checkpointed)
        moved = 2 * (tp - 1) / tp * self._collective_bytes(tp, checkpointed) * biggest / bandwidth
        return compute + moved + latency

    def _collective_calls(self, tp: int, checkpointed: bool) -> np.ndarray:
        """Per layer and micro-batch: tensor-parallel collective calls (a recomputed forward
        repeats its own)."""
        recomputed = checkpointed & self.layers.checkpointable
        split = self.split(tp)
        if split is None:
            return np.where(self.has_params, 4 + 2 * recomputed, 0)
        return split.forward_collectives * (1 + recomputed) + split.backward_collectives

    def splits(self, tp: int) -> bool:
        """Whether the runtime's swap-in would split anything ``tp`` ways (a tree without records:
        assume so)."""
        split = self.split(tp)
        return split is None or bool((split.node_scale < tp).any() or (split.param_ratio < 1).any())

    def split(self, tp: int) -> TensorSplit | None:
        """The layers split ``tp`` ways by the swap-in's rule (None: everything divides by ``tp``)."""
        if tp not in self._splits:
            self._splits[tp] = self.layers.tensor_split(tp)
        return self._splits[tp]

    def _collective_bytes(self, tp: int, checkpointed: bool) -> np.ndarray:
        """Per layer and sample: all-reduce-equivalent bytes of its tensor-parallel collectives."""
        recomputed = checkpointed & self.layers.checkpointable  # a recomputed forward repeats its own
        split = self.split(tp)
        if split is None:  # Megatron's count: two all-reduces of the output forward, two backward
            count = 4 + 2 * recomputed
            return np.where(self.has_params, count * self.out, 0.0)
        scale = self.options.activation_scale / max(self.options.trace_batch, 1)
        return (split.forward_bytes * (1 + recomputed) + split.backward_bytes) * scale

    def sample_times(self, speed: float, bandwidth: float, checkpointed: bool = False,
                     tp: int = 1) -> np.ndarray:
        """Seconds per sample (forward + backward) of each layer on a replica of this FLOP/s and
        memory bytes/s: the roofline of each node, summed per layer (``checkpointed``: with the
        recomputed forward of every checkpointable layer). The replica is a tensor-parallel group
        of ``tp`` devices: a node the split leaves whole runs at one device's speed."""
        key = (speed, bandwidth, checkpointed, tp)
        if key not in self._sample_times:
            flops, traffic = self.node_flops, self.node_traffic
            if checkpointed:
                flops, traffic = flops + self.recompute_flops, traffic + self.recompute_traffic
            split = self.split(tp)
            if split is not None:
                flops, traffic = flops * split.node_scale, traffic * split.node_scale
            per_node = np.maximum(flops / speed, traffic / bandwidth)
            self._sample_times[key] = np.bincount(self.layers.node_layer, per_node,
                                                  minlength=len(self.layers))
        return self._sample_times[key]

    def _replica_memory(self, stage: StageDevices, tp: int, sizes: tuple[int, ...],
                        in_flight: int, checkpointed: bool = False) -> list[tuple[np.ndarray, float]]:
        """Per replica: bytes each layer takes on one of its devices, and that device's budget."""
        state, act = self._per_rank(tp, checkpointed)
        out = []
        for replica, size in zip(stage.replicas, sizes, strict=True):
            budget = min(d.type.memory_bytes for d in replica) * self.options.memory_fraction
            row = state + self.layers.buffer_bytes + act * size * in_flight
            out.append((row, budget))
        return out

    def _per_rank(self, tp: int, checkpointed: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per layer: training-state bytes, and activation bytes per sample, on one rank of a
        ``tp``-way group. A checkpointed layer keeps its inputs, which every rank holds whole."""
        split = self.split(tp)
        if split is None:
            return self.state / tp, (self.act_checkpointed if checkpointed else self.act) / tp
        act = split.activation_bytes * self.options.activation_scale / max(self.options.trace_batch, 1)
        if checkpointed:
            act = np.where(self.layers.checkpointable, self.act_checkpointed, act)
        return self.state * split.param_ratio, act

    def _p2p_bandwidth(self, a: StageDevices, b: StageDevices) -> float:
        pairs = zip(a.replicas, b.replicas, strict=True)
        return min(self.cluster.bandwidth(ra[0].node, rb[0].node) for ra, rb in pairs)

    def dp_sync_time(self, stages: list[StageDevices], starts: tuple[int, ...], tp: int) -> list[float]:
        """Seconds each stage spends ring-all-reducing its gradients (0 without data parallelism)."""
        bounds = [*starts, len(self.layers)]
        out = []
        for j, stage in enumerate(stages):
            n = len(stage.replicas)
            if n == 1:
                out.append(0.0)
                continue
            split = self.split(tp)
            ratio = np.full(len(self.layers), 1 / tp) if split is None else split.param_ratio
            params = (self.layers.param_count * ratio)[bounds[j]:bounds[j + 1]].sum()
            nbytes = params * self.options.grad_bytes_per_param
            out.append(2 * (n - 1) / n * nbytes / self.cluster.slowest_link(stage.nodes))
        return out


def _interleaved_in_flight(stage: int, stages: int) -> int:
    """Micro-batches whose activations stage ``stage`` of ``stages`` holds at once under 1F1B
    (`smpart.runtime.schedule.one_f_one_b_actions`: the loss counts as one more stage)."""
    return stages - stage + 1 if stages > 1 else 1
