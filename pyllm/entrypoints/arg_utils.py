"""Command-line flags made from a config dataclass's fields (EngineConfig, ServerConfig),
and the config made back from the parsed flags: an option is defined once, as a field.

Each field made with `pyllm.engine.config.option` becomes `--field-name`: its type from
the annotation (`X | None` as X), its help text with the default appended (a default of
None or a flag's is said in the help text itself), and what the field's metadata adds
(`flag`, `short`, `choices`, `type`, `const`, `env`). A bool field is a flag that turns
its default around.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any


def add_config_arguments(parser, config_class: type, overrides: dict | None = None) -> None:
    """One flag per option of config_class, on `parser` (or an argument group);
    `overrides`: {field name: argparse options} where a command reads one otherwise."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if "help" in field.metadata:
            names = [flag_of(field), *filter(None, [field.metadata.get("short")])]
            options = _argparse_options(field, hints) | (overrides or {}).get(field.name, {})
            parser.add_argument(*names, dest=field.name, **options)


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def option_help(config_class: type, name: str) -> str:
    """The help text of config_class's option `name`, for a command that takes it alone."""
    return config_class.__dataclass_fields__[name].metadata["help"]


def _argparse_options(field: dataclasses.Field, hints: dict[str, Any]) -> dict[str, Any]:
    meta, default = field.metadata, field.default
    if "const" in meta:
        return dict(action="store_const", const=meta["const"], default=default, help=meta["help"])
    if _base_type(hints[field.name]) is bool:
        action = "store_false" if default else "store_true"
        return dict(action=action, default=default, help=meta["help"])
    help = meta["help"]
    if default is not None:
        help += " (default: %(default)s)"
    options = dict(type=meta.get("type", _base_type(hints[field.name])), default=default)
    if "choices" in meta:
        options["choices"] = meta["choices"]
    return dict(options, help=help)


def _base_type(hint: Any) -> Any:
    """int for `int | None`; the hint itself otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (base,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return base
    return hint


def config_from_args(config_class: type, args: argparse.Namespace, **overrides: Any):
    """config_class built from the parsed flags (an unset one with an `env` read from
    the environment), `overrides` taking precedence."""
    values = {}
    for field in dataclasses.fields(config_class):
        if "help" not in field.metadata or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if value is None and "env" in field.metadata:
            value = os.environ.get(field.metadata["env"])
        values[field.name] = value
    return config_class(**{**values, **overrides})
