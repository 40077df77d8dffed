"""Placement: cutting a model into its stages and putting each module where its stage runs.

`place` (partition a traced model, move or release each stage's tensors, route calls to a
module's stage), `activation_checkpointing` (which placed modules recompute in the backward).
"""
