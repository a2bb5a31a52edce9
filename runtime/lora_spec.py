"""``--lora-modules``: which LoRA adapters to serve, by name (torch-free: the configuration validates it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRASpec:
    name: str
    path: str


def parse_lora_modules(values: Sequence[str]) -> list[LoRASpec]:
    """``NAME=PATH`` items (vLLM's ``--lora-modules``; a JSON object ``{"name": ..., "path": ...}`` works too);
    ``ValueError`` naming the item at fault."""
    specs: list[LoRASpec] = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                name, path = item["name"], item["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules {value!r}: a JSON item needs "name" and "path"') from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH (the adapter's folder)")
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
            raise ValueError(f"--lora-modules {value!r}: the name and the path must both be given")
        name, path = name.strip(), path.strip()
        if any(s.name == name for s in specs):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        specs.append(LoRASpec(name, path))
    return specs


def lora_names(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(spec.name for spec in parse_lora_modules(values))
