"""Ranks and the mesh, process groups, the process transport, faults across ranks."""
