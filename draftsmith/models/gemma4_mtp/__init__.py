"""Gemma 4 MTP: Google's separate assistant drafter (`gemma4_assistant`) of query-only layers over the target's own
KV cache, loaded, run, fine-tuned and exported back to its published layout. spec.py declares it."""
