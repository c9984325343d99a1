"""draftsmith: train, export and run speculative-decoding drafters (EAGLE-3, MTP, DFlash)."""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)
