"""MTP drafters (DeepSeek-V3 multi-token prediction, FastMTP-style recursion) over a frozen target; spec.py
declares them."""
