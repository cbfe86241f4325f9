"""A command's flags from a file (``kvfleet up --config FILE``): YAML or TOML, one key per flag,
named as the flag without its dashes (``block_size: 256`` or ``block-size = 256``).

The file's values are defaults: a flag given on the command line wins over them. A key that is no
flag of the command, or a value of the wrong kind, is refused in one line naming the key, so a typo
never starts a cluster on a silently ignored setting. ``kvfleet tune`` writes such a file.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """The file cannot be read, or says something the command does not take."""


def _kind_ok(value: object, current: object) -> bool:
    """Whether ``value`` suits a flag whose default is ``current`` (None: a string or number)."""
    if isinstance(value, bool) or isinstance(current, bool):
        return isinstance(value, bool) and (current is None or isinstance(current, bool))
    if current is None:
        return isinstance(value, (str, int, float))
    if isinstance(current, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(current))


def _kind_name(current: object) -> str:
    if isinstance(current, bool):
        return "true or false"
    return {int: "an integer", float: "a number"}.get(type(current), "a string")


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


def load(path: str | Path, flags: Mapping[str, object]) -> dict[str, object]:
    """The file's values by flag destination, checked against ``flags`` (destination → its
    current value, whose kind the file's value must have)."""
    values = {}
    for key, value in read(path).items():
        dest = str(key).replace("-", "_")
        if dest not in flags:
            raise ConfigError(f"{path}: unknown key {key!r}; known: {', '.join(sorted(flags))}")
        if not _kind_ok(value, flags[dest]):
            raise ConfigError(f"{path}: {key} must be {_kind_name(flags[dest])}, got {value!r}")
        values[dest] = value
    return values


def dump_yaml(values: Mapping[str, object], header: str) -> str:
    """``values`` as the YAML that ``load`` reads, after ``header`` as comment lines."""
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comments + yaml.safe_dump(dict(values), sort_keys=False)
