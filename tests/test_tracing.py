"""`smpart.trace`: costs, nodes and data flow checked against hand-worked numbers and torch itself."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import smpart
from examples import models
from examples.models import ZOO
from smpart import ConfigError, ModuleTree, TraceError, trace
from smpart.tracing.tree import INPUT


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _trace_quietly(model, args, kwargs=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(model, args, kwargs, **kw)


# ---------------------------------------------------------------- hand-worked costs
def test_linear_costs_match_hand_computation():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    tree = trace(model, (x,))
    first, relu, last = (tree.node(n) for n in "012")
    assert (first.param_count, first.param_bytes) == (4 * 8 + 8, 4 * (4 * 8 + 8))
    assert first.flops == 2 * 3 * 4 * 8 and last.flops == 2 * 3 * 8 * 2 and relu.flops == 0
    assert first.activation_bytes == 3 * 8 * 4 and relu.activation_bytes == 3 * 8 * 4
    assert (tree.root.flops, tree.root.param_bytes, tree.root.call_order) == (0, 0, 0)
    assert [c.name for c in tree.root.children] == ["0", "1", "2"]
    assert [c.call_order for c in tree.root.children] == [1, 2, 3]
    assert tree.compute_unit == "flops" and tree.input_bytes == 3 * 4 * 4
    # autograd saves: the first layer its input (its weight is a parameter, never an activation),
    # the ReLU its output, the last layer its input (the ReLU's output: counted there, once)
    # and the model's output, which the loss keeps
    assert (first.saved_bytes, relu.saved_bytes, last.saved_bytes) == (3 * 4 * 4, 3 * 8 * 4, 3 * 2 * 4)
    assert tree.activation_memory == "saved"
    assert tree.memory_of(first) == 4 * first.param_bytes + 3 * 4 * 4


class _Scores(nn.Module):
    """Token × token scores made in forward code: no module returns them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ x.transpose(0, 1)).softmax(-1).sum(-1)  # transpose is a view: nothing written


def test_op_bytes_count_what_operations_write_inside_forward_code():
    n, d = 6, 3
    model = nn.Sequential(nn.Linear(d, d), _Scores(), nn.Unflatten(0, (n, 1)))
    tree = trace(model, (torch.randn(n, d),))
    linear, scores, unflatten = (tree.node(name) for name in "012")
    assert linear.op_bytes == n * d * 4
    assert scores.op_bytes == (n * n + n * n + n) * 4  # matmul, softmax, sum
    assert scores.activation_bytes == n * 4  # the module's output alone
    assert unflatten.op_bytes == 0 and tree.root.op_bytes == 0  # a view writes nothing


class _Fan(nn.Module):
    """One hidden state read by two layers, once whole and once through a view."""

    def __init__(self, d: int):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.scale  # mul saves a's output and the parameter: only the first counts
        return self.b(h) + self.c(h.view(-1, h.size(-1)))


def test_saved_bytes_count_each_storage_once_and_never_a_parameter():
    n, d = 5, 6
    model = _Fan(d)
    tree = trace(model, (torch.randn(n, d),))
    a, b, c = (tree.node(name) for name in "abc")
    assert a.saved_bytes == n * d * 4  # its input
    assert b.saved_bytes == n * d * 4 and c.saved_bytes == 0  # h, and a view of h: one storage
    # the root's own code keeps a's output (for scale's gradient) and the model output (for the
    # loss); the parameter `scale` and the weights count nothing
    assert tree.root.saved_bytes == 2 * n * d * 4
    assert tree.root.activation_bytes == n * d * 4 and a.activation_bytes == n * d * 4


class _Gpt2Block(nn.Module):
    """A GPT-2 block as Megatron's paper counts it: dropouts on, attention written out (no flash)."""

    def __init__(self, h: int, heads: int, p: float = 0.1):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.gelu, self.proj = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)
        self.attn_drop, self.resid_drop, self.mlp_drop = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(C, dim=-1))
        scores = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        y = self.attn_drop(scores.softmax(-1)) @ v
        x = x + self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.mlp_drop(self.proj(self.gelu(self.fc(self.ln_2(x)))))


def test_gpt2_medium_block_saves_what_megatron_counts():
    s, b, h, a = 1024, 1, 1024, 16
    with torch.device("meta"):
        block = _Gpt2Block(h, a).half()
    x = torch.empty(b, s, h, dtype=torch.half, device="meta", requires_grad=True)  # a stage's input
    tree = trace(block, (x,))
    megatron = 34 * s * b * h + 5 * a * s * s * b  # Korthikanti et al. 2022, eq. (1), fp16
    saved = sum(n.saved_bytes for n in tree.nodes())
    assert 0.7 * megatron <= saved <= 1.3 * megatron
    assert sum(n.activation_bytes for n in tree.nodes()) < 0.7 * megatron  # outputs alone: too few
    assert tree.total_memory() == pytest.approx(
        4 * sum(n.param_bytes for n in tree.nodes()) + saved)


def test_a_model_nothing_can_train_counts_its_outputs_instead():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).requires_grad_(False)
    tree = trace(model, torch.randn(3, 4))
    assert all(n.saved_bytes == 0 for n in tree.nodes()) and tree.activation_memory == "outputs"
    assert tree.memory_of(tree.node("1")) == 3 * 8 * 4


def test_tree_json_without_saved_bytes_still_loads_and_counts_outputs():
    tree = trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(3, 4))
    old = tree.to_dict()
    del old["activation_memory"]
    for node in [old["root"], *old["root"]["children"]]:
        del node["saved_bytes"]
    again = ModuleTree.from_dict(old)
    assert again.activation_memory == "outputs" and again.node("0").saved_bytes == 0
    assert again.memory_of(again.node("1")) == 3 * 8 * 4
    with pytest.raises(ConfigError, match="activation_memory"):
        ModuleTree(tree.root, activation_memory="everything")


def test_sequential_edges_go_from_each_layer_to_the_next_with_its_output_bytes():
    widths = [4, 8, 16, 2]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)))
    batch = 5
    tree = trace(model, (torch.randn(batch, 4),))
    edges = {(e.src, e.dst): e.nbytes for e in tree.edges}
    assert edges == {
        (INPUT, ""): batch * 4 * 4,
        (INPUT, "0"): batch * 4 * 4,
        ("0", "1"): batch * 8 * 4,
        ("1", "2"): batch * 16 * 4,
    }
    assert tree.cut_bytes({"": 0, "0": 0, "1": 1, "2": 1}) == batch * 8 * 4


@pytest.mark.parametrize("name", sorted(ZOO))
def test_total_flops_equal_flop_counter_on_the_unsplit_model(name):
    ex = ZOO[name]()
    tree = _trace_quietly(ex.model, ex.args, ex.kwargs)
    with torch.no_grad():
        expected = _flops(lambda: ex.model(*ex.args, **ex.kwargs))
    assert expected > 0 and tree.total_compute() == expected
    assert sum(n.param_count for n in tree.nodes()) == sum(p.numel() for p in ex.model.parameters())
    # every saved storage was written by some operation, or is an input
    saved = sum(n.saved_bytes for n in tree.nodes())
    assert tree.activation_memory == "saved"
    assert 0 < saved <= sum(n.op_bytes for n in tree.nodes()) + tree.input_bytes


def test_meta_and_cpu_traces_agree_node_by_node():
    ex = models.gpt2(n_layer=2)
    on_meta, on_cpu = trace(ex.model, ex.args), trace(ex.model, ex.args, device="cpu")
    assert on_meta.to_dict() == on_cpu.to_dict()


# ---------------------------------------------------------------- nodes
def test_tied_embedding_and_lm_head_are_one_node_under_their_common_ancestor():
    ex = models.gpt2()
    tree = trace(ex.model, ex.args)
    tied = tree.node("lm_head")
    assert tied is tree.node("transformer.wte")
    assert tied.name == "transformer.wte" and set(tied.names) == {"transformer.wte", "lm_head"}
    assert tied in tree.root.children and tied not in tree.node("transformer").children
    assert tied.param_count == 64 * 32 and tied.call_count == 2
    assert tree.node("transformer.h.7.mlp").class_name == "MLP"


def test_one_module_under_three_names_is_one_node_named_as_first_called():
    ex = models.t5()
    tree = trace(ex.model, ex.args, ex.kwargs)
    shared = tree.node("shared")
    assert shared is tree.node("encoder.embed_tokens") is tree.node("decoder.embed_tokens")
    assert shared.name == "encoder.embed_tokens" and shared.call_count == 2
    assert shared in tree.root.children
    assert not any(t.is_meta for t in ex.model.state_dict().values())
    decoder = tree.node("decoder")
    assert [c.name for c in decoder.children] == ["decoder.block", "decoder.final_layer_norm"]
    assert decoder.children[0].call_order == tree.node("decoder.block.0").call_order


def test_albert_layer_is_one_node_called_n_times_with_n_times_the_flops():
    n = 4
    ex = models.albert(n_repeat=n)
    tree = trace(ex.model, ex.args)
    layer = tree.node("layer")
    assert layer.call_count == n and tree.node("layer.mlp.c_fc").call_count == n
    hidden = torch.randn(*ex.args[0].shape, 32)
    with torch.no_grad():
        one_call = _flops(lambda: ex.model.layer(hidden))
    assert tree.total_compute(layer) == n * one_call


def test_children_follow_call_order_and_uncalled_modules_come_last():
    class Swapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(2, 2)
            self.second = nn.Linear(2, 2)
            self.first = nn.Linear(2, 2)

        def forward(self, x):
            return self.second(self.first(x))

    tree = trace(Swapped(), torch.randn(1, 2))
    assert [c.name for c in tree.root.children] == ["first", "second", "unused"]
    unused = tree.node("unused")
    assert (unused.call_count, unused.call_order, unused.flops) == (0, None, 0)
    assert unused.param_count == 6


def test_uncalled_containers_take_the_place_of_their_first_called_layer():
    ex = models.gpt2(n_layer=2)
    tree = trace(ex.model, ex.args)
    h = tree.node("transformer.h")
    assert h.call_count == 0 and h.call_order == tree.node("transformer.h.0").call_order
    transformer = [c.name for c in tree.node("transformer").children]
    assert transformer == ["transformer.wpe", "transformer.h", "transformer.ln_f"]
    assert [c.name for c in tree.root.children] == ["transformer.wte", "transformer"]


def test_modules_sharing_a_parameter_deep_in_the_tree_meet_at_their_lowest_common_ancestor():
    block = nn.Sequential(nn.Sequential(nn.Linear(3, 3)), nn.Sequential(nn.Linear(3, 3)))
    block[1][0].weight = block[0][0].weight
    model = nn.Sequential(nn.Linear(3, 3), block)
    tree = trace(model, torch.randn(2, 3))
    shared = tree.node("1.0.0")
    assert shared is tree.node("1.1.0") and shared in tree.node("1").children
    assert shared.param_count == 9 + 3 + 3  # one weight, two biases
    assert tree.node("1.0").children == [] and tree.node("1.1").children == []


def test_moe_experts_without_tokens_are_kept_and_marked_after_a_warned_fallback():
    ex = models.moe()
    with pytest.warns(UserWarning, match="meta device"):
        tree = trace(ex.model, ex.args)
    experts = [n for n in tree.nodes() if ".experts." in n.name and n.name.count(".") == 5]
    assert len(experts) == 8 * 4
    uncalled = [n for n in experts if not n.called]
    assert uncalled
    for expert in uncalled:
        assert all(n.call_order is None and n.flops == 0 for n in expert.walk())
        assert sum(n.param_count for n in expert.walk()) > 0
    for layer in range(4):
        siblings = tree.node(f"transformer.h.{layer}.mlp.experts").children
        called = [n.called for n in siblings]
        assert called == sorted(called, reverse=True)


def test_trivial_models_give_one_valid_node():
    tree = trace(nn.ReLU(), torch.randn(2, 3))
    assert len(tree) == 1 and tree.root.call_count == 1 and tree.total_memory() == 2 * 3 * 4
    assert len(trace(nn.Sequential(nn.ReLU(), nn.Tanh()), torch.randn(2))) == 3


# ---------------------------------------------------------------- the model is left alone
class _BigCpuTensors(TorchDispatchMode):
    """Records every op that produces a CPU tensor of at least ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() >= self.numel:
                self.seen.append(str(func))
        return out


def test_meta_trace_neither_copies_nor_changes_cpu_weights():
    model = nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.Linear(512, 512))
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    with _BigCpuTensors(512 * 512) as allocations:
        tree = trace(model, torch.randn(4, 512))
    assert allocations.seen == []
    for k, v in model.state_dict().items():
        assert v.data_ptr() == before[k][0] and torch.equal(v, before[k][1]), k
    assert all(p.grad is None for p in model.parameters())
    assert tree.node("0").param_bytes == 4 * (512 * 512 + 512)


def test_fallback_runs_on_the_models_own_weights_without_changing_them():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(4)
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.norm(x)
            return self.a(x) if x.sum() > 0 else self.b(x)

    model = DataDependent()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    made = _weakrefs_to_outputs_with_a_graph(model)
    with pytest.warns(UserWarning, match="own weights"):
        tree = trace(model, torch.randn(3, 4))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert tree.node("a").called != tree.node("b").called
    # the pass ran with autograd on the real weights: no gradient written, and no graph left
    # behind (a kept graph keeps its module outputs alive, saved for backward or held as outputs)
    assert all(p.grad is None for p in model.parameters())
    gc.collect()
    assert made and [ref() for ref in made if ref() is not None] == []
    assert tree.node("norm").saved_bytes == 3 * 4 * 4 + 2 * 4 * 4  # its input, batch mean and invstd


@pytest.mark.parametrize("device", ["meta", None])
def test_a_traced_model_is_freed_once_let_go(device):
    """An op that saves its own output (tanh) kept, through the saved-bytes hook, a graph that
    held the hook, the recorder and the model: a cycle through autograd's C++ that no garbage
    collection breaks. Every model a runtime placed stayed alive after its script let it go."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    alive = weakref.ref(model)
    trace(model, torch.randn(3, 4), device=device)
    del model
    gc.collect()
    assert alive() is None


def _weakrefs_to_outputs_with_a_graph(model: nn.Module) -> list[weakref.ref]:
    """Weak references to every tensor a module of ``model`` returns with a ``grad_fn``, from now on."""
    made: list[weakref.ref] = []

    def record(_module, _args, output):
        made.extend(weakref.ref(t) for t in torch.utils._pytree.tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None)

    for module in model.modules():
        module.register_forward_hook(record)
    return made


def test_a_distributed_model_traces_as_the_model_it_wraps_before_and_after_its_first_step():
    ex = models.gpt2()
    plain = _trace_quietly(ex.model, ex.args).to_dict()
    smpart.init(pipeline_parallel_degree=2, microbatches=2)
    try:
        model = smpart.DistributedModel(ex.model)
        assert _trace_quietly(model, ex.args).to_dict() == plain

        @smpart.step
        def forward(model, tokens):
            return model(tokens)

        forward(model, *ex.args)  # traced, partitioned and placed: the modules' forwards are staged now
        assert _trace_quietly(model, ex.args).to_dict() == plain
    finally:
        smpart.shutdown()


def test_a_model_with_some_weights_on_meta_traces_as_the_whole_model_does():
    """As a rank's model does under torchrun once it released the other stages' weights."""
    ex = models.gpt2()
    whole = _trace_quietly(ex.model, ex.args).to_dict()
    for block in ex.model.transformer.h[4:]:
        block.to("meta")
    assert _trace_quietly(ex.model, ex.args).to_dict() == whole


# ---------------------------------------------------------------- errors
def test_bad_inputs_raise_trace_error_naming_the_failing_module():
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(5, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TraceError, match=r"module '1\.1' \(Linear\)") as info:
            trace(model, torch.randn(3, 4))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_meta_model_that_needs_values_raises_trace_error():
    ex = models.moe(device="meta")
    with pytest.raises(TraceError, match="meta device"):
        trace(ex.model, ex.args)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: trace("not a model", ()), TraceError),
        (lambda: trace(nn.ReLU(), torch.ones(1), example_kwargs=[1]), TraceError),
        (lambda: trace(nn.ReLU(), torch.ones(1), device="nowhere"), TraceError),
        (lambda: trace(nn.ReLU(), torch.ones(1), device="cuda:99"), TraceError),
        (lambda: trace(nn.ReLU(), torch.ones(1), param_memory_factor=-1), ConfigError),
    ],
)
def test_bad_arguments_raise_smpart_errors(call, error):
    with pytest.raises(error):
        call()


# ---------------------------------------------------------------- timing and serialisation
def test_measured_time_becomes_the_compute_unit():
    ex = models.gpt2(n_layer=2)
    tree = trace(ex.model, ex.args, device=None, measure_time=True)
    assert tree.compute_unit == "time"
    assert all(n.time_s is not None and n.time_s >= 0 for n in tree.nodes())
    assert tree.total_compute() > 0
    assert all(p.grad is None for p in ex.model.parameters())


def test_tree_survives_a_json_round_trip():
    ex = models.t5()
    tree = trace(ex.model, ex.args, ex.kwargs, param_memory_factor=2.0)
    again = ModuleTree.from_json(tree.to_json())
    assert again.to_dict() == tree.to_dict()
    assert again.node("decoder.embed_tokens").name == "encoder.embed_tokens"
    assert again.edges == tree.edges and again.param_memory_factor == 2.0
