"""A command's flags from a file (``kvfleet up --config FILE``): YAML or TOML, one key per flag,
named as the flag without its dashes (``block_size: 256`` or ``block-size = 256``).

The keys are the names of the command's settings (``kvfleet.core.settings``), and each value meets the
rule its flag does, in the same words, after the file's name: ``tuned.yaml: --block-size must be a
multiple of 16 in 16..2048, got 17``. The file's values are defaults: a flag given on the command
line wins over them. An unknown key is refused in one line too, so a typo never starts a cluster on
a silently ignored setting. ``kvfleet tune`` writes such a file.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path

import yaml

from kvfleet.core import settings


class ConfigError(ValueError):
    """The file cannot be read, or says something the command does not take."""


def read(path: str | Path) -> dict:
    """The file's mapping (``.toml``: TOML, else YAML)."""
    p = Path(path)
    kind, parse = ("TOML", tomllib.loads) if p.suffix == ".toml" else ("YAML", yaml.safe_load)
    try:
        data = parse(p.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read the config file {path}: {err.strerror or err}") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path} is not valid {kind}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


def load(path: str | Path, schema: type) -> dict[str, object]:
    """The file's values by setting name, each checked by the setting of ``schema`` (a settings
    dataclass) it names."""
    known = settings.names(schema)
    values = {}
    for key, value in read(path).items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"{path}: unknown key {key!r}; known: {', '.join(sorted(known))}")
        try:
            values[name] = settings.convert_named(schema, name, value)
        except ValueError as err:
            raise ConfigError(f"{path}: {err}") from None
    return values


def dump_yaml(values: Mapping[str, object], header: str) -> str:
    """``values`` as the YAML that ``load`` reads, after ``header`` as comment lines."""
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comments + yaml.safe_dump(dict(values), sort_keys=False)
