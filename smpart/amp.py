"""Mixed precision under SMP's name for it (``smp.amp.GradScaler``)."""

from smpart.runtime.grad_scaler import GradScaler

__all__ = ["GradScaler"]
