"""Tracing: turn an ``nn.Module`` and an example batch into a costed `ModuleTree`.

This package's ``__init__`` imports no torch, so torch-free rooms (the partitioner) can use
`ModuleTree`; the tracer itself lives in `smpart.tracing.tracer`.
"""

from smpart.tracing.tree import INPUT, DataEdge, ModuleNode, ModuleTree

__all__ = ["INPUT", "DataEdge", "ModuleNode", "ModuleTree"]
