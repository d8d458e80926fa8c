"""The model families mtp_jax reads, one module each, and their registry.

Each module of this package defines `FAMILY` (a `base.Family`: model types, block defaults,
chain conventions, whether its target is built) and / or `LAYOUT` (a `base.Layout`: how to
recognise its MTP tensors and where each canonical tensor is stored). They are collected here on
import: adding a family is one new module (and its test). `layouts` and `pretrained` read these
records; docs/checkpoints.md's family table is `table()`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping

from mtp_jax.families.base import Blocks, Conventions, Family, Layout, Sources

__all__ = ["Blocks", "Conventions", "Family", "Layout", "Sources", "FAMILIES", "LAYOUTS", "family_of", "get",
           "table"]


def _collect():
  families, layouts = {}, {}
  for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if info.name == "base":
      continue
    module = importlib.import_module(f"{__name__}.{info.name}")
    if (family := getattr(module, "FAMILY", None)) is not None:
      families[family.name] = family
    if (layout := getattr(module, "LAYOUT", None)) is not None:
      layouts[layout.name] = layout
  return families, layouts


FAMILIES, LAYOUTS = _collect()  # name -> Family, name -> Layout, in module name order
# mtp_jax's own layout first: it names no family and is what save_canonical writes.
LAYOUTS = {"canonical": LAYOUTS.pop("canonical"), **LAYOUTS}


def get(name: str) -> Family:
  """The family registered as `name`."""
  if name not in FAMILIES:
    raise ValueError(f"unknown family {name!r}; expected one of {sorted(FAMILIES)}")
  return FAMILIES[name]


def family_of(config: Mapping, layout: str | None = None) -> Family | None:
  """The family of an HF config (by model_type), else the first whose MTP layout is `layout` and who
  reads it as the layout does (not one borrowing its names through layout_sources, as ExaONE-MoE)."""
  model_type = config.get("model_type")
  for family in FAMILIES.values():
    if model_type in family.model_types:
      return family
  for family in FAMILIES.values():
    if layout is not None and family.layout == layout and family.layout_sources is None:
      return family
  return None


def table() -> str:
  """The markdown table of every registered family (docs/checkpoints.md holds it verbatim)."""
  rows = ["| family | `model_type` | MTP layout | target | chain from |", "|---|---|---|---|---|"]
  for f in FAMILIES.values():
    types = ", ".join(f"`{t}`" for t in f.model_types)
    if f.target == f.model_types:  # a refusal here: configs of a built model_type the target leaves out
      target = f"yes; no: {f.target_refusal}" if f.target_refusal else "yes"
    elif f.target:
      target = f"{', '.join(f'`{t}`' for t in f.target)}; no: {f.target_refusal}"
    else:
      target = f"no: {f.target_refusal}"
    layout = (f"`{f.layout}`" if f.layout else f"assistant (`load_assistant`): {f.assistant}" if f.assistant
              else f"no: {f.mtp_refusal}" if f.mtp_refusal else "(none released)")
    rows.append(f"| {f.title} | {types} | {layout} | {target} | "
                f"{f.sources or '-'} |")
  return "\n".join(rows)
