"""The distributed layers under SMP's name for them (``smp.nn.DistributedLinear``)."""

from smpart.tensor_parallel.layers import DistributedEmbedding, DistributedLinear

__all__ = ["DistributedEmbedding", "DistributedLinear"]
