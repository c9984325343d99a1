"""DFlash: a block drafter conditioned on fused target features (DESIGN.md §3, methods.md §2)."""

from draftsmith.models.dflash.config import DflashConfigError, DflashDrafterConfig
from draftsmith.models.dflash.model import DflashDrafter, load_drafter

__all__ = ["DflashConfigError", "DflashDrafter", "DflashDrafterConfig", "load_drafter"]
