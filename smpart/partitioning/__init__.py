"""The partitioner: a `ModuleTree` of plain costs in, a `Partition` (the stage of every node) out.

Segmentation DP, D'Hondt and the recursive tree walk, on numbers only: nothing here imports torch.
"""
