"""The reference runtime (SMP's design): a model's first step, and any step a program cannot run.

The step body runs on the first stage's rank, one `Driver` thread per micro-batch; every call to
a module of another stage is a request its `StageServer` answers, in the order of its `Schedule`.
"""
