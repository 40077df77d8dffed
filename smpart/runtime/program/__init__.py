"""Step programs: from a model's second step on, each rank runs a fixed list of actions.

The first step of a model under an ``init`` runs on the reference runtime (SMP's: the body on the
first stage's rank, a request per cross-stage call), which records what a program needs
(`templates`). From the next step on every rank runs the step body itself, with placeholders for
what other ranks hold (`glue`), in the order of its list of actions (`actions`), on one thread
(`executor`), sending each tensor once, one way; `guards` decides which steps may, and undoes one
that finds it cannot. `steps` runs a program step on threads and under ``torchrun``.
"""
