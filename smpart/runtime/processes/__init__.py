"""The process runtime (one stage per rank under ``torchrun``) and what only processes need.

`runtime` (`ProcessRuntime`); the collectives of ranks that each hold a part: starting alike
(`replicas`), the full state dict (`state_exchange`), data parallelism, ZeRO-1, global clipping.
"""
