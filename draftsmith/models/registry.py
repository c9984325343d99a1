"""Every drafter method draftsmith trains, exports, imports and runs: one entry per method folder.

The trainer, the exporter, the importer, `push`, the runtime's speculative-config parser and the recipe schema
read methods only through these functions (models/spec.py says what a spec holds). Adding a method: its folder
with a `spec.py` declaring `SPEC`, its import below and its entry in `SPECS` (explicit imports keep the
import graph, which tests/test_registry.py checks for circles, readable).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draftsmith.models.dflash.spec import SPEC as DFLASH
from draftsmith.models.dspark.spec import SPEC as DSPARK
from draftsmith.models.eagle.spec import SPEC as EAGLE
from draftsmith.models.eagle3.spec import SPEC as EAGLE3
from draftsmith.models.gemma4_mtp.spec import SPEC as GEMMA4_MTP
from draftsmith.models.mtp.spec import SPEC as MTP
from draftsmith.models.spec import DrafterSpec, ExportFormat

SPECS: tuple[DrafterSpec, ...] = (
    EAGLE3,
    EAGLE,
    MTP,
    GEMMA4_MTP,
    DFLASH,
    DSPARK,
)
_BY_METHOD = {spec.method: spec for spec in SPECS}
_BY_ALIAS = {alias: spec for spec in SPECS for alias in spec.engine_aliases}


class UnknownMethodError(ValueError):
    """A method name no spec declares."""


def methods() -> tuple[str, ...]:
    return tuple(_BY_METHOD)


def get(method: str) -> DrafterSpec:
    """The spec of `method` (or of an engine's other name for it, such as vLLM's deepseek_mtp)."""
    spec = _BY_METHOD.get(method) or _BY_ALIAS.get(method)
    if spec is None:
        raise UnknownMethodError(f"unknown drafter method {method!r}; available: {', '.join(methods())}")
    return spec


def find(method: str) -> DrafterSpec | None:
    return _BY_METHOD.get(method) or _BY_ALIAS.get(method)


def served_as(method: str, config: Mapping[str, Any]) -> DrafterSpec | None:
    """The spec whose drafter an engine serves under `method` (its `served_as`) and whose layout `config` (the
    drafter's config.json) is, or None: Gemma 4's assistant named as vLLM's `mtp`."""
    for spec in SPECS:
        if method in spec.served_as and any(f.detect is not None and f.detect(config) for f in spec.formats):
            return spec
    return None


def formats() -> dict[str, tuple[DrafterSpec, ExportFormat]]:
    """`export --format` name -> (its method's spec, the format), in registry order."""
    return {fmt.name: (spec, fmt) for spec in SPECS for fmt in spec.formats}


def detect_layout(config: Mapping[str, Any]) -> tuple[DrafterSpec, ExportFormat] | None:
    """The method and format of an export folder's config.json, by each format's `detect`; None if none claims it."""
    for spec in SPECS:
        for fmt in spec.formats:
            if fmt.detect is not None and fmt.detect(config):
                return spec, fmt
    return None
