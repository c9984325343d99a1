"""DSpark: the DFlash block drafter plus a low-rank Markov head and a confidence head (DESIGN.md §3, methods.md §3);
spec.py declares it."""
