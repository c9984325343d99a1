"""MTP drafters (DeepSeek-V3 multi-token prediction, FastMTP-style recursion) over a frozen target."""

from draftsmith.models.mtp.config import MtpDrafterConfig
from draftsmith.models.mtp.io import load_mtp_drafter
from draftsmith.models.mtp.model import MtpDrafter

__all__ = ["MtpDrafter", "MtpDrafterConfig", "load_mtp_drafter"]
