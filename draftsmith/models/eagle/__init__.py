"""EAGLE-1/2: one decoder layer over fc(cat(embed(x_{t+1}), h_t)), h_t the target's final-normed last hidden state,
read out through the target's own head (Li et al. 2024, arXiv 2401.15077; EAGLE-2's dynamic tree, 2406.16858, is
run-time only). spec.py declares it."""
