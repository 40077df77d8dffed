"""The wire: the messages the runtimes exchange and every transport that carries them.

`transport` (the seam, and threads: by reference), `processes` (rank to rank over gloo or NCCL,
in `frames`), `routed` (the runtime's addresses over it), `messages` (what travels).
"""
