"""One process per stage: launching, the layout of ranks, the process transport."""
