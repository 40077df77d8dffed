"""Launching under torchrun: the layout of ranks, process groups, checking devices, attendance."""
