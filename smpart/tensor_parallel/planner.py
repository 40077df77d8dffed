"""The tensor-parallel planner: which module to split, and how, so that the split is exact.

A Megatron split is exact when every column-parallel layer feeds its row-parallel partner with
nothing in between that needs the whole feature dimension: an MLP's up (and gate) projection
and its down projection, an attention's q/k/v projections and its output projection, with the
heads in between computed locally. Everything else stays replicated. `Planner` (run by
`plan_tensor_parallel`) finds those pairs, in this order:

1. **The model's own plan.** Hugging Face models publish one (``config.base_model_tp_plan``,
   the model's ``_tp_plan``: ``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``,
   ``"embedding_rowwise"``); it is followed wherever it names a Linear, Conv1D or Embedding.
2. **Attention**, through an adapter that knows where the class keeps its projections and its
   head counts (the zoo's attention, GPT-2, OPT, BERT, Llama, Qwen2, Mixtral, Mistral; add yours
   with `register_attention_adapter`). q and kv heads must both divide by the degree. An
   attention whose class has no adapter (nanoGPT's, timm's, torchtitan's, a research model's)
   has its heads found, split and proven on the spot by running it alone, split and whole
   (`smpart.tensor_parallel.heads`, which needs an example of its arguments: the traced call's,
   from ``example_inputs``); one that cannot be proven stays whole, with a warning.
3. **MLPs** from structure: among a module's Linear children (in call order, children that wrap
   one Linear included), ``up: d -> h`` then ``down: h -> d`` (or ``gate``, ``up``, ``down``).
   Where the parent's forward can be read by ``torch.fx``, the path from the column outputs to
   the row input is checked to be elementwise only (activations, dropout, products); a traced
   `ModuleTree`, when given, supplies the call order and the data-flow edges checked as well.
4. **Embeddings** split by vocabulary, and the **LM head** (a Linear onto the vocabulary)
   column-wise with its output gathered.
5. **Tied weights**: modules sharing a parameter must split it the same way (a vocabulary-split
   embedding and its column-split LM head both hold rows of the vocabulary, so they share one
   distributed parameter); otherwise all of them stay whole, with a warning.

A unit (an attention, an MLP) is split as a whole or not at all. Every module left whole for a
reason a user may not expect gets a ``warnings.warn`` naming it and the reason
(`TensorParallelWarning`), attention modules once per class and reason with their count (not
once per layer); the plan keeps every decision with its reason and prints as a table.

SMP's controls: `set_tensor_parallelism(module, enabled)` and the context manager
`tensor_parallelism(enabled)` mark subtrees; ``False`` keeps them whole, ``True`` also splits a
standalone Linear there (column-wise, output gathered), and ``only_marked=True`` splits nothing
unmarked, as SMP did.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from smpart.tensor_parallel.attention import (
    AttentionAdapter,
    AttentionLayout,
    FoundHeads,
    PublishedAttention,
    attention_adapter,
    looks_like_attention,
)
from smpart.tensor_parallel.decisions import (
    NONE,
    AttentionSplit,
    Decision,
    TensorParallelPlan,
    in_features,
    module_kind,
    out_features,
    own_numel,
)
from smpart.tensor_parallel.elementwise import elementwise_between
from smpart.tensor_parallel.heads import find_head_split
from smpart.tensor_parallel.layers import COLUMN, DIM, ROW, VOCAB, _is_conv1d
from smpart.tensor_parallel.localize import HeadSplit
from smpart.tensor_parallel.marks import tensor_parallelism_of
from smpart.tensor_parallel.published import PUBLISHED_STYLES, pattern_matches, published_plan
from smpart.tracing.tree import INPUT, ModuleTree


class Planner:
    """One planning of one model at one degree: the steps of the module docstring, in order, each
    deciding what the earlier ones left; `finish` gives the `TensorParallelPlan`."""

    def __init__(self, model: nn.Module, degree: int, tree: ModuleTree | None, only_marked: bool,
                 use_published: bool, examples: ModuleTree | None = None) -> None:
        self.model, self.degree, self.tree, self.examples = model, degree, tree, examples
        self.only_marked, self.use_published = only_marked, use_published
        self.module: dict[str, nn.Module] = dict(model.named_modules())
        self.name_of: dict[int, str] = {id(m): n for n, m in self.module.items()}
        self.aliases: dict[int, list[str]] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.aliases.setdefault(id(m), []).append(name)
        self.order = {name: i for i, name in enumerate(self.module)}
        self.marks = self._resolve_marks()
        self.plan = TensorParallelPlan(degree, type(model).__name__)
        self.handled: set[str] = set()
        self.explained: dict[str, tuple[str, str]] = {}  # name -> (reason, source) of modules left whole
        #: (class name, reason) -> the attention modules of that class kept whole for that reason.
        self.class_warnings: dict[tuple[str, str], list[str]] = {}

    # ------------------------------------------------------------ helpers
    def _resolve_marks(self) -> dict[str, bool | None]:
        marks: dict[str, bool | None] = {}
        for name, m in self.module.items():
            parent = name.rpartition(".")[0] if name else None
            inherited = marks.get(parent) if parent is not None else None
            own = tensor_parallelism_of(m)
            marks[name] = own if own is not None else inherited
        return marks

    def leaves(self) -> Iterator[tuple[str, nn.Module, str]]:
        for name, m in self.module.items():
            kind = module_kind(m)
            if kind is not None:
                yield name, m, kind

    def allowed(self, name: str) -> bool:
        return not self.refusal(name)

    def refusal(self, name: str) -> str:
        """Why the user's marks keep ``name`` whole ("" when they do not)."""
        mark = self.marks.get(name)
        if mark is False:
            return "marked off by set_tensor_parallelism"
        if self.only_marked and mark is None:
            return "not marked for tensor parallelism (only_marked=True)"
        return ""

    def warn(self, message: str) -> None:
        self.plan.warnings.append(message)

    def warn_class(self, name: str, module: nn.Module, why: str) -> None:
        """Say that attention ``name`` stays whole, once per class and reason (`finish`)."""
        self.class_warnings.setdefault((type(module).__name__, why), []).append(name)

    def keep(self, name: str, reason: str, warn: bool = False) -> None:
        if name not in self.explained and name not in self.plan.decisions:
            self.explained[name] = (reason, NONE)
            if warn:
                self.warn(f"{name} stays whole: {reason}")

    def decide(self, name: str, style: str, reason: str, source: str, *, unit: str | None = None,
               gather_output: bool = False, input_is_parallel: bool = True, fused: int = 1) -> None:
        m = self.module[name]
        params = own_numel(m)
        bias = getattr(m, "bias", None)
        replicated = bias.numel() if style == ROW and isinstance(bias, torch.Tensor) else 0
        self.plan.decisions[name] = Decision(style, reason, source, gather_output, input_is_parallel, fused,
                                             unit, params, params - replicated)
        self.handled.add(name)

    def call_key(self, name: str) -> tuple[int, int]:
        """Sort key: the traced call order when known, else registration order."""
        if self.tree is not None and name in self.tree:
            order = self.tree.node(name).call_order
            if order is not None:
                return 0, order
        return 1, self.order[name]

    def children(self, name: str) -> list[str]:
        module = self.module[name]
        prefix = f"{name}." if name else ""
        kids = [self.name_of[id(c)] for _, c in module.named_children()
                if self.name_of[id(c)] == prefix + _child_name(module, c)]
        return sorted(kids, key=self.call_key)

    def divides(self, size: int, parts: int = 1) -> bool:
        return size % (parts * self.degree) == 0

    # ------------------------------------------------------------ 1. the published plan
    def published(self) -> None:
        entries = published_plan(self.model) if self.use_published else {}
        if not entries:
            return
        units: dict[str, dict[str, list[str]]] = {}
        for pattern, hf_style in entries.items():
            targets = [n for n in self.module if n and pattern_matches(pattern, n)]
            if not targets:
                params = [n for n, _ in self.model.named_parameters() if pattern_matches(pattern, n)]
                if params and hf_style not in ("replicate",):
                    self.warn(f"{pattern} stays whole: the model's plan asks {hf_style!r} for a parameter; "
                              "smpart splits Linear, Conv1D and Embedding modules")
                continue
            for name in targets:
                self._published_entry(name, pattern, hf_style, units)
        for parent, roles in units.items():
            self._published_unit(parent, roles)

    def _published_entry(self, name: str, pattern: str, hf_style: str, units: dict) -> None:
        kind = module_kind(self.module[name])
        if hf_style not in PUBLISHED_STYLES or kind not in ("linear", "embedding"):
            what = type(self.module[name]).__name__
            self.keep(name, f"the model's plan asks {hf_style!r} ({pattern}) for a {what}; smpart splits "
                            "Linear, Conv1D and Embedding modules with colwise/rowwise/embedding styles",
                      warn=True)
            self.handled.update(n for n in self.module if n == name or n.startswith(name + "."))
            return
        style, flag = PUBLISHED_STYLES[hf_style]
        if kind == "embedding":
            style = {COLUMN: DIM, ROW: VOCAB}.get(style, style)
        if not self.allowed(name):
            self.keep(name, self.refusal(name))
            self.handled.add(name)
            return
        if style in (VOCAB, DIM) or (style == COLUMN and flag):
            self._single(name, style, "the model's plan: " + hf_style, "published")
        elif style == NONE:
            self.keep(name, "the model's plan replicates it")
            self.handled.add(name)
        else:
            units.setdefault(name.rpartition(".")[0], {COLUMN: [], ROW: []})[style].append(name)

    def _published_unit(self, parent: str, roles: dict[str, list[str]]) -> None:
        columns, rows = roles[COLUMN], roles[ROW]
        members = columns + rows
        module = self.module[parent]
        if len(rows) != 1 or not columns:
            for n in members:
                self.keep(n, f"the model's plan splits {', '.join(members)} under {parent} without exactly "
                             "one rowwise partner", warn=True)
            self.handled.update(members)
            return
        if looks_like_attention(module):
            rel = lambda n: n[len(parent) + 1:]
            adapter = attention_adapter(module) or PublishedAttention(tuple(rel(c) for c in columns),
                                                                      rel(rows[0]))
            self._attention(parent, module, adapter, source="published")
            self.handled.update(members)
            return
        self._unit(parent, columns, rows[0], "the model's plan: colwise/rowwise", "published")

    # ------------------------------------------------------------ 2./3. structure
    def structure(self, name: str = "") -> None:
        module = self.module[name]
        if name not in self.handled:
            adapter = attention_adapter(module)
            if adapter is not None:
                self._attention(name, module, adapter, source="attention")
                return
        if looks_like_attention(module) and name not in self.handled:
            projections = [c for c in self.children(name)
                           if module_kind(self.module[c]) == "linear" and c not in self.handled]
            refused = next((self.refusal(c) for c in projections if self.refusal(c)), "")
            found = (find_head_split(module, self.degree, self.example_of(name, module))
                     if projections and not refused else "")
            if isinstance(found, HeadSplit):
                self._attention(name, module, FoundHeads(found), source="attention", heads=found)
                return
            unknown = ("smpart has no adapter for this attention (register_attention_adapter teaches it one) "
                       f"and could not split its heads itself: {found}")
            why = (f"its attention {name} is kept whole: a projection is {refused}" if refused else
                   f"it projects inside {name} ({type(module).__name__}), {unknown}")
            for child in projections:
                self.keep(child, self.refusal(child) or why)
                self.handled.add(child)
            if projections and not refused:
                self.warn_class(name, module, unknown)
        self._mlps(name)
        for child in self.children(name):
            self.structure(child)

    def example_of(self, name: str, module: nn.Module) -> dict[str, Any] | None:
        """The traced arguments of module ``name``'s first call, when a tree recorded them."""
        for tree in (self.examples, self.tree):
            if tree is not None and name in tree:
                node = tree.node(name)
                if node.call_inputs is not None and node.class_name == type(module).__name__:
                    return node.call_inputs
        return None

    def _attention(self, name: str, module: nn.Module, adapter: AttentionAdapter, source: str,
                   heads: HeadSplit | None = None) -> None:
        layout = adapter.layout(module)
        projections: list[str] = []
        if isinstance(layout, AttentionLayout):
            projections = [f"{name}.{path}" if name else path for path, _ in layout.columns]
            projections.append(f"{name}.{layout.row}" if name else layout.row)
        self.handled.update(projections)
        self.handled.add(name)
        if isinstance(layout, str):
            self._keep_attention(name, module, layout)
            return
        refused = next((self.refusal(p) for p in projections if self.refusal(p)), "")
        if refused:
            for p in projections:
                self.keep(p, f"its attention {name} is kept whole: a projection is {refused}")
            return
        why = self._attention_problem(name, layout, projections)
        if why:
            for p in projections:
                self.keep(p, f"its attention {name} cannot be split exactly: {why}")
            self.warn_class(name, module, why)
            return
        local = f"{layout.q_heads // self.degree} of {layout.q_heads} q heads"
        if layout.kv_heads != layout.q_heads:
            local += f", {layout.kv_heads // self.degree} of {layout.kv_heads} kv heads"
        for (_, fused), proj in zip(layout.columns, projections, strict=False):
            self.decide(proj, COLUMN, f"attention {name}: {local} per rank", source, unit=name, fused=fused)
        self.decide(projections[-1], ROW, f"attention {name}: output projection, partial sums all-reduced",
                    source, unit=name)
        self.plan.attention[name] = AttentionSplit(name, adapter.name, layout.q_heads, layout.kv_heads,
                                                   self.degree, tuple(projections), heads)

    def _keep_attention(self, name: str, module: nn.Module, why: str) -> None:
        for n, m in self.module.items():
            if n.startswith(f"{name}.") and module_kind(m) == "linear":
                self.keep(n, f"its attention {name} cannot be split: {why}")
                self.handled.add(n)
        self.warn_class(name, module, why)

    def _attention_problem(self, name: str, layout: AttentionLayout, projections: list[str]) -> str:
        if any(p not in self.module or module_kind(self.module[p]) != "linear" for p in projections):
            return "its projections are not plain Linear/Conv1D modules where its adapter expects them"
        if layout.q_heads % self.degree or layout.kv_heads % self.degree:
            heads = (_count(layout.q_heads, "head") if layout.q_heads == layout.kv_heads
                     else f"{layout.q_heads} q heads and {layout.kv_heads} kv heads")
            return f"{heads} cannot be shared out evenly over tensor-parallel degree {self.degree}"
        for (path, fused), p in zip(layout.columns, projections, strict=False):
            if not self.divides(out_features(self.module[p]), fused):
                return (f"its {path} has {out_features(self.module[p])} output features, not divisible into "
                        f"{fused} x {self.degree}")
        return ""

    def _mlps(self, name: str) -> None:
        run: list[tuple[str, str]] = []  # (linear name, the direct child that holds it)
        runs = [run]
        for child in self.children(name):
            m = self.module[child]
            kind = module_kind(m)
            if kind == "linear":
                if child not in self.handled:
                    run.append((child, child))
                continue
            if kind is not None or not any(True for _ in m.parameters()):
                continue  # embeddings and parameterless modules do not break a run
            linears = (x for x in m.modules() if module_kind(x) == "linear")
            inner = list(dict.fromkeys(self.name_of[id(x)] for x in linears))
            if (len(inner) == 1 and inner[0] not in self.handled and not looks_like_attention(m)
                    and not any(looks_like_attention(x) for x in m.modules())):
                run.append((inner[0], child))
            elif inner:
                run = []
                runs.append(run)
        for members in runs:
            self._pair_run(name, members)

    def _pair_run(self, parent: str, run: list[tuple[str, str]]) -> None:
        i = 0
        while i < len(run):
            for width in (3, 2):
                group = self._down_last(run[i:i + width])
                if len(group) == width and self._mlp_shape(group) and self._mlp(parent, group):
                    i += width
                    break
            else:
                i += 1

    def _down_last(self, group: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """A gated triple with its down projection registered between the others (torchtitan's
        ``w1``, ``w2``, ``w3``, called ``w1``, ``w3``, ``w2``) in the order it runs."""
        if len(group) != 3 or self._mlp_shape(group):
            return group
        for down in range(2):
            reordered = [g for j, g in enumerate(group) if j != down] + [group[down]]
            if self._mlp_shape(reordered):
                return reordered
        return group

    def _mlp_shape(self, group: list[tuple[str, str]]) -> bool:
        mods = [self.module[n] for n, _ in group]
        *columns, down = mods
        d, h = in_features(columns[0]), out_features(columns[0])
        return (all(in_features(c) == d and out_features(c) == h for c in columns)
                and in_features(down) == h and out_features(down) == d)

    def _mlp(self, parent: str, group: list[tuple[str, str]]) -> bool:
        """Split ``group`` (ups..., down) as one MLP if every check passes; False to try others."""
        names = [n for n, _ in group]
        *columns, row = names
        direct = all(holder == n for n, holder in group)
        ok: bool | None = None
        if direct:
            rel = lambda n: n[len(parent) + 1:] if parent else n
            ok, why = elementwise_between(self.module[parent], [rel(c) for c in columns], rel(row))
            if ok is False:
                for n in names:
                    self.keep(n, f"not split as an MLP: in {parent or 'the model'}, {why}", warn=n == row)
                return False
            checked = "; path checked elementwise by torch.fx" if ok else f"; structure only ({why})"
        else:
            checked = "; structure only (the projections sit in wrapper modules)"
        flow = self._flow_problem(parent, group)
        if not ok and not flow:
            flow = self._width_problem(parent, group)
        if flow:
            for n in names:
                self.keep(n, flow, warn=n == row)
            return False
        self._unit(parent, columns, row, f"MLP {' -> '.join(n.rpartition('.')[2] for n in names)}{checked}",
                   "mlp")
        return True

    def _flow_problem(self, parent: str, group: list[tuple[str, str]]) -> str:
        """With a traced tree: the members run equally often, and the row projection reads
        nothing from another module that has weights."""
        names = [n for n, _ in group]
        if self.tree is None or any(n not in self.tree for n in names):
            return ""
        nodes = [self.tree.node(n) for n in names]
        if len({n.call_count for n in nodes}) != 1:
            return "not split as an MLP: the traced forward calls these projections unequally often"
        allowed = {self.tree.node(n).name for pair in group for n in pair if n in self.tree}
        if parent in self.tree:
            allowed.add(self.tree.node(parent).name)
        down = nodes[-1].name
        for edge in self.tree.edges:
            if edge.dst == down and edge.src != INPUT and edge.src not in allowed \
                    and _tree_params(self.tree, edge.src):
                return (f"not split as an MLP: the traced forward feeds {edge.src} (which has weights) "
                        f"into {down}")
        return ""

    def _width_problem(self, parent: str, group: list[tuple[str, str]]) -> str:
        """Without a checked path: no other module with weights of the hidden width may sit where
        it could run on the split activations (a norm over the hidden features, say)."""
        hidden = in_features(self.module[group[-1][0]])
        members = {n for n, _ in group}
        holders = {h for _, h in group}
        places = [(h, n) for n, h in group if h != n]  # inside a wrapper, next to the projection
        places += [(parent, c) for c in self.children(parent) if c not in holders]
        for holder, _ in places:
            scope = self.module[holder]
            for sub_name, sub in scope.named_modules(prefix=holder):
                if sub_name in members or self.name_of.get(id(sub)) in members or sub is self.module[parent]:
                    continue
                for p in sub.parameters(recurse=False):
                    if hidden in p.shape:
                        return (f"not split as an MLP: {self.name_of.get(id(sub), sub_name)} has weights of "
                                f"the hidden width {hidden} and might run between the projections")
        return ""

    def _unit(self, parent: str, columns: list[str], row: str, reason: str, source: str) -> None:
        members = [*columns, row]
        self.handled.update(members)
        problem = next((f"a projection is {self.refusal(n)}" for n in members if self.refusal(n)), "")
        if not problem:
            for c in columns:
                if not self.divides(out_features(self.module[c])):
                    problem = (f"{c} has {out_features(self.module[c])} output features, not divisible by "
                               f"{self.degree}")
            if not self.divides(in_features(self.module[row])):
                problem = (f"{row} has {in_features(self.module[row])} input features, not divisible by "
                           f"{self.degree}")
        if problem:
            for n in members:
                self.keep(n, f"the pair {', '.join(members)} cannot be split exactly: {problem}",
                          warn=n == row and "a projection is" not in problem)
            return
        unit = parent or "<model>"
        for c in columns:
            self.decide(c, COLUMN, reason, source, unit=unit)
        self.decide(row, ROW, reason + " (partial sums all-reduced)", source, unit=unit)

    def _single(self, name: str, style: str, reason: str, source: str) -> None:
        m = self.module[name]
        self.handled.add(name)
        if style == VOCAB and not self.divides(m.num_embeddings) and self.divides(m.embedding_dim):
            style = DIM
            reason += f" (dimension split: the vocabulary of {m.num_embeddings} does not divide)"
        size = {VOCAB: lambda: m.num_embeddings, DIM: lambda: m.embedding_dim,
                COLUMN: lambda: out_features(m)}[style]()
        if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.sparse):
            self.keep(name, "max_norm and sparse embeddings cannot be split", warn=True)
            return
        if not self.divides(size):
            self.keep(name, f"{size} {'rows' if style != DIM else 'columns'} do not divide by the "
                            f"tensor-parallel degree {self.degree}", warn=True)
            return
        self.decide(name, style, reason, source, unit=name, gather_output=style == COLUMN)

    # ------------------------------------------------------------ 4. embeddings and the LM head
    def embeddings_and_heads(self) -> None:
        vocab = max((m.num_embeddings for _, m, k in self.leaves() if k == "embedding"), default=None)
        for name, m, kind in self.leaves():
            if name in self.handled or name in self.explained:
                continue
            if not self.allowed(name):
                self.keep(name, self.refusal(name))
                continue
            if kind == "custom":
                base = "nn.Embedding" if isinstance(m, nn.Embedding) else "nn.Linear"
                self.keep(name, f"{type(m).__name__} subclasses {base} with its own forward, which the "
                                "distributed layers cannot reproduce", warn=True)
            elif kind == "embedding":
                self._single(name, VOCAB, "embedding: vocabulary split, masked lookups all-reduced",
                             "embedding")
            elif vocab is not None and out_features(m) == vocab:
                self._single(name, COLUMN, "LM head: vocabulary columns, logits gathered", "lm_head")
            elif self.marks.get(name) is True:
                self._single(name, COLUMN, "marked by set_tensor_parallelism: column split, output gathered",
                             "marked")
            else:
                self.keep(name, "no row-parallel partner: splitting it alone would add collectives for one "
                                "matmul")

    # ------------------------------------------------------------ 5. tied weights
    def ties(self) -> None:
        owners: dict[int, list[tuple[str, str]]] = {}
        for name, m in self.module.items():
            for pname, p in m.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append((name, pname))
        changed = True
        while changed:
            changed = False
            for group in owners.values():
                if len({n for n, _ in group}) < 2:
                    continue
                split = [n for n, _ in group if n in self.plan.decisions and self.plan.decisions[n].split]
                if not split:
                    continue
                layouts = {self._placement(n, p) for n, p in group}
                if None in layouts or len(layouts) > 1:
                    names = ", ".join(f"{n}.{p}" if n else p for n, p in group)
                    why = (f"a parameter is shared ({names}) and the modules sharing it cannot split it the "
                           "same way" if None not in layouts else
                           f"a parameter is shared ({names}) with a module that keeps it whole")
                    for n in split:
                        self._undo_unit(n, why)
                    changed = True

    def _placement(self, name: str, pname: str) -> tuple | None:
        d = self.plan.decisions.get(name)
        if d is None or not d.split:
            return None
        m = self.module[name]
        if d.style in (VOCAB, DIM):
            return ("shard", 0 if d.style == VOCAB else 1, 1)
        conv = _is_conv1d(m)
        if pname == "bias":
            return ("shard", 0, d.fused) if d.style == COLUMN else ("replicate",)
        out_dim, in_dim = (1, 0) if conv else (0, 1)
        return ("shard", out_dim if d.style == COLUMN else in_dim, d.fused)

    def _undo_unit(self, name: str, why: str) -> None:
        unit = self.plan.decisions[name].unit
        members = [n for n, d in self.plan.decisions.items()
                   if d.split and (n == name or (unit and d.unit == unit))]
        for n in members:
            d = self.plan.decisions[n]
            d.style, d.source, d.gather_output, d.fused, d.split_params = NONE, NONE, False, 1, 0
            d.reason = why if n == name else f"split together with {name}, which stays whole: {why}"
        self.plan.attention.pop(unit or "", None)
        others = [m for m in members if m != name]
        self.warn(f"{name} stays whole: {why}" + (f" (and with it {', '.join(others)})" if others else ""))

    # ------------------------------------------------------------ the result
    def finish(self) -> TensorParallelPlan:
        for (class_name, why), names in self.class_warnings.items():
            if len(names) == 1:
                self.warn(f"{names[0]} ({class_name}) stays whole: {why}")
            else:
                self.warn(f"{len(names)} {class_name} modules stay whole ({_names_together(names)}): {why}")
        self.class_warnings.clear()
        for name, m, _ in self.leaves():
            if name not in self.plan.decisions:
                reason, source = self.explained.get(name, ("not reached by any rule", NONE))
                self.plan.decisions[name] = Decision(NONE, reason, source, params=own_numel(m))
            self.plan.decisions[name].names = tuple(self.aliases.get(id(m), [name]))
        order = {n: i for i, n in enumerate(self.module)}
        self.plan.decisions = dict(sorted(self.plan.decisions.items(), key=lambda kv: order[kv[0]]))
        return self.plan


def _names_together(names: list[str], shown: int = 3) -> str:
    """``h.0.attn ... h.11.attn`` for names that differ in one number only, else the first few."""
    shapes = {re.sub(r"\.\d+\.", ".#.", n, count=1) for n in names}
    if len(shapes) == 1 and "#" in next(iter(shapes)):
        return f"{names[0]} ... {names[-1]}"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    return next(n for n, c in parent.named_children() if c is child)


def _tree_params(tree: ModuleTree, node_name: str) -> int:
    return tree.node(node_name).param_count if node_name in tree else 0
