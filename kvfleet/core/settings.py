"""One definition per setting: a dataclass field holds its type, default, help and rule, and the
command line flags, a config file's keys and a child process's argv are all generated from it.

    @dataclass(slots=True)
    class RouterSettings:
        queue_size: int = setting(1024, "waiting requests before shedding", at_least=1)

        def __post_init__(self) -> None:
            check(self)                     # "1024" -> 1024; 0 -> SettingError, one line

    add_flags(parser, RouterSettings)       # --queue-size, its help ending "(default 1024)"
    build(RouterSettings, namespace)        # RouterSettings(queue_size=...), checked
    to_argv(settings)                       # ["--queue-size", "2048"]: what differs from the default

Flags take raw text and the dataclass converts it, so a value from a command line, from a config
file or from Python meets the same rule and, when bad, the same one-line ``SettingError`` (argparse's
own errors print a usage block). A field whose type is such a dataclass is flattened: its flags sit
beside the outer ones, under its own heading in ``--help``. Pure: no torch, no grpc.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

_KEY = "kvfleet.setting"


class SettingError(ValueError):
    """A setting's value breaks its rule; the message is one line naming the flag."""


@dataclass(frozen=True, slots=True)
class Setting:
    """A field's rule. ``parse``, when given, takes the raw value (text from a command line, or a
    config file's value) and returns the typed one or raises ``ValueError`` with the whole line.
    ``help`` says what the setting does; its default is appended to it (``unset`` for None)."""

    help: str
    unset: str = ""  # what None means, for a setting whose default is None ("off", "the model's")
    choices: tuple[str, ...] = ()
    at_least: float | None = None
    at_most: float | None = None
    above: float | None = None
    parse: Callable[[Any], Any] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()


def setting(default: Any = MISSING, help: str = "", **rule: Any) -> Any:
    """A dataclass field that is a setting (no ``default``: a required flag)."""
    metadata = {_KEY: Setting(help, **rule)}
    return dataclasses.field(metadata=metadata) if default is MISSING else dataclasses.field(
        default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class _Spec:
    name: str
    rule: Setting
    kind: type | None   # int, float, str or bool; None where ``rule.parse`` decides
    optional: bool      # None is a value (the default says what it means)
    default: Any        # MISSING: required

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _kind(hint: Any) -> tuple[type | None, bool]:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    kinds = [a for a in args if a is not type(None)]
    kind = kinds[0] if len(kinds) == 1 and kinds[0] in (int, float, str, bool) else None
    return kind, len(kinds) < len(args)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, _Spec | type], ...]:
    """(name, spec) of each setting of ``cls`` and (name, class) of each nested settings class."""
    hints = typing.get_type_hints(cls)
    found: list[tuple[str, _Spec | type]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            found.append((f.name, hint))
            continue
        rule = f.metadata.get(_KEY)
        if rule is None:
            continue
        kind, optional = _kind(hint)
        if kind is None and rule.parse is None:
            raise TypeError(f"{cls.__name__}.{f.name}: a setting of type {hint} needs parse=")
        found.append((f.name, _Spec(f.name, rule, kind, optional, f.default)))
    return tuple(found)


def specs(cls: type, defaults: Mapping[str, Any] | None = None) -> Iterator[_Spec]:
    """Every setting of ``cls``, nested classes flattened, with ``defaults`` replacing theirs."""
    for name, spec in _fields(cls):
        if isinstance(spec, type):
            yield from specs(spec, defaults)
        elif defaults and name in defaults:
            yield dataclasses.replace(spec, default=defaults[name])
        else:
            yield spec


def names(cls: type) -> list[str]:
    """The settings' names (a config file's keys)."""
    return [spec.name for spec in specs(cls)]


# -- values -----------------------------------------------------------------------------------------

def _typed(spec: _Spec, value: Any) -> Any:
    kind, flag = spec.kind, spec.flag
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise SettingError(f"{flag} must be true or false, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise SettingError(f"{flag} must be text, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SettingError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if kind is int and isinstance(value, float):
        raise SettingError(f"{flag} must be an integer, got {value!r}")
    try:
        return kind(value.strip() if isinstance(value, str) else value)
    except ValueError:
        raise SettingError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None


def convert(spec: _Spec, value: Any) -> Any:
    """``value`` typed and checked against ``spec``'s rule, or ``SettingError``."""
    if value is None:
        if spec.optional:
            return None
        raise SettingError(f"{spec.flag} needs a value")
    rule = spec.rule
    if rule.parse is not None:
        try:
            return rule.parse(value)
        except ValueError as err:
            raise SettingError(str(err)) from None
    value = _typed(spec, value)
    if rule.choices and value not in rule.choices:
        raise SettingError(f"{spec.flag} must be one of {', '.join(rule.choices)}, got {value!r}")
    if rule.at_least is not None and value < rule.at_least:
        raise SettingError(f"{spec.flag} must be at least {rule.at_least:g}, got {value:g}")
    if rule.at_most is not None and value > rule.at_most:
        raise SettingError(f"{spec.flag} must be at most {rule.at_most:g}, got {value:g}")
    if rule.above is not None and not value > rule.above:
        above = "positive" if rule.above == 0 else f"more than {rule.above:g}"
        raise SettingError(f"{spec.flag} must be {above}, got {value:g}")
    return value


def convert_named(cls: type, name: str, value: Any) -> Any:
    """``convert`` for the setting ``name`` of ``cls`` (``KeyError`` when it has none)."""
    spec = next((s for s in specs(cls) if s.name == name), None)
    if spec is None:
        raise KeyError(name)
    return convert(spec, value)


def check(obj: Any) -> None:
    """Convert and check every setting of ``obj`` in place (from its ``__post_init__``); nested
    settings were checked by their own."""
    for name, spec in _fields(type(obj)):
        if not isinstance(spec, type):
            object.__setattr__(obj, name, convert(spec, getattr(obj, name)))  # a frozen class's too


# -- the command line -------------------------------------------------------------------------------

def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _flag_help(spec: _Spec) -> str:
    if spec.default is None:
        return f"{spec.rule.help} (default: {spec.rule.unset})" if spec.rule.unset else spec.rule.help
    if spec.default is MISSING or spec.default is False:
        return spec.rule.help
    return f"{spec.rule.help} (default {_text(spec.default)})"


def add_flags(parser: argparse.ArgumentParser, cls: type, defaults: Mapping[str, Any] | None = None,
              group: argparse._ArgumentGroup | None = None) -> None:
    """A flag per setting of ``cls`` (``defaults`` replacing theirs); a nested class's flags under
    its docstring's first line. The flags keep raw text: ``build`` converts it."""
    target = group or parser
    for name, spec in _fields(cls):
        if isinstance(spec, type):
            add_flags(parser, spec, defaults, parser.add_argument_group(spec.__doc__.strip().splitlines()[0]))
            continue
        if defaults and name in defaults:
            spec = dataclasses.replace(spec, default=defaults[name])
        flags = (spec.flag, *spec.rule.aliases)
        if spec.kind is bool:
            target.add_argument(*flags, dest=name, action="store_true", default=spec.default, help=spec.rule.help)
            continue
        metavar = spec.rule.metavar or ("|".join(spec.rule.choices) if spec.rule.choices else None)
        required = spec.default is MISSING
        target.add_argument(*flags, dest=name, metavar=metavar, help=_flag_help(spec), required=required,
                            **({} if required else {"default": spec.default}))


def build(cls: type, values: argparse.Namespace | Mapping[str, Any]) -> Any:
    """``cls`` from parsed flags (or a mapping of name → value), nested classes included; what a
    value breaks is a ``SettingError`` (a cross-setting rule: a ``ValueError``), one line."""
    get = values.get if isinstance(values, Mapping) else functools.partial(getattr, values)
    kwargs = {name: build(spec, values) if isinstance(spec, type) else get(name, spec.default)
              for name, spec in _fields(cls)}
    return cls(**{k: v for k, v in kwargs.items() if v is not MISSING})


def to_argv(obj: Any) -> list[str]:
    """The flags that give ``obj`` to a command built from its class: each setting whose value is
    not the one its class gives by default (after its ``__post_init__``: ``dtype`` auto, resolved
    to this machine's, is no flag to pass to a process on this machine)."""
    fields = _fields(type(obj))
    required = any(not isinstance(spec, type) and spec.default is MISSING for _, spec in fields)
    baseline = None if required else type(obj)()
    argv: list[str] = []
    for name, spec in fields:
        value = getattr(obj, name)
        if isinstance(spec, type):
            argv += to_argv(value)
            continue
        default = spec.default if baseline is None else getattr(baseline, name)
        if value == default:
            continue
        if value is None or (spec.kind is bool and not value):
            raise ValueError(f"{spec.flag} {value} cannot be said on a command line (its default is {default})")
        argv += [spec.flag] if spec.kind is bool else [spec.flag, _text(value)]
    return argv
