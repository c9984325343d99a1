"""DFlash: a block drafter conditioned on fused target features (DESIGN.md §3, methods.md §2); spec.py declares it."""
