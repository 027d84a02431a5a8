"""Run presets: TOML files in ``slideformer/gui/resources/presets`` whose sections are those of a run config.

A preset is a partial run config (``[optim] lr = 1e-5``...) read with the engine's own checks
(:func:`slideformer.engine.api.config_from_dict`: an unknown key is an error), applied on top of the current
settings. Its first comment line says what it is for: ``# Name: description``.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from slideformer.engine.api import RunConfig, config_from_dict, override, parse_toml


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    values: dict
    """{section: {key: value}}, as in the file."""


def parse_preset(text: str, source: str) -> Preset:
    """A preset from the text of its TOML file (the file's keys checked against RunConfig)."""
    values = parse_toml(text, source)
    config_from_dict(values, source, validate=False)
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("# ").strip())
    name, _, description = " ".join(comment).partition(":")
    description = description.strip()
    return Preset(name.strip() or source, description[:1].upper() + description[1:], values)


def load_presets() -> list[Preset]:
    """Every preset shipped in ``slideformer/gui/resources/presets``, by file name."""
    folder = resources.files("slideformer.gui") / "resources" / "presets"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
    return [parse_preset(f.read_text(encoding="utf-8"), f"presets/{f.name}") for f in files]


def apply_preset(cfg: RunConfig, preset: Preset) -> RunConfig:
    """``cfg`` with every key of ``preset`` set."""
    return override(cfg, {f"{section}.{key}": value
                                     for section, table in preset.values.items()
                                     for key, value in table.items()})
