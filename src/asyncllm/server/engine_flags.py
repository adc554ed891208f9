"""Engine arguments as command-line flags, derived from `EngineConfig` so a new engine argument is a new flag.

Owns the one piece of introspection (`engine_arg_specs`: fields, types, defaults, attribute docstrings) and
its argparse wiring. Knows nothing of HTTP. If `EngineConfig` becomes a composition of small configs, only
`engine_arg_specs` changes: nested dataclass fields are flattened into one flag namespace already.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncllm.config import EngineConfig

_POSITIONAL = frozenset({"model"})  # `asyncllm serve [MODEL]` takes it positionally


@dataclass(frozen=True)
class EngineArgSpec:
    """One engine argument: its keyword name, value type, allowed values, default and documentation."""

    name: str
    type: type  # bool, int, float or str
    default: Any  # dataclasses.MISSING when the field has none
    help: str
    choices: tuple[str, ...] | None = None
    optional: bool = False  # None is a valid value

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def engine_arg_specs(config_cls: type = EngineConfig) -> list[EngineArgSpec]:
    """Every keyword argument of `AsyncLLMEngine(model, **engine_args)` but `model`, in declaration order.

    Fields whose type is itself a dataclass are flattened (their fields become arguments of their own). A
    field's help is its `metadata["doc"]`, else the string literal written under it in the class body.
    """
    hints = typing.get_type_hints(config_cls)
    docs = _attribute_docstrings(config_cls)
    specs: list[EngineArgSpec] = []
    for field in dataclasses.fields(config_cls):
        if not field.init or field.name in _POSITIONAL or "env" in field.metadata:
            continue  # an ASYNCLLM_* variable's field is no flag (config_fields.from_env)
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            specs.extend(engine_arg_specs(hint))
            continue
        value_type, choices, optional = _classify(field.name, hint)
        default = field.default
        if isinstance(default, enum.Enum):
            default = default.value
        doc = field.metadata.get("doc") or docs.get(field.name, "")  # `metadata={"doc": ...}` or a docstring
        specs.append(EngineArgSpec(field.name, value_type, default, doc, choices, optional))
    return specs


def _classify(name: str, hint: Any) -> tuple[type, tuple[str, ...] | None, bool]:
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    optional = type(None) in members
    members = tuple(m for m in members if m is not type(None))
    for member in members:
        if isinstance(member, type) and issubclass(member, enum.Enum):
            return str, tuple(str(m.value) for m in member), optional
    for candidate in (bool, int, float, str):  # bool first: it is an int too
        if candidate in members:
            return candidate, None, optional
    if Path in members:
        return str, None, optional
    raise TypeError(f"EngineConfig.{name}: cannot make a command-line flag of type {hint!r}")


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """{field: the string literal written under it}: attribute docstrings exist only in the source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped: flags still work, without help text
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for stmt, after in zip(body.body, body.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def add_engine_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, exclude: frozenset[str] = frozenset()
) -> list[EngineArgSpec]:
    """Add one flag per engine argument but those in `exclude` (a command whose own flag has that name), and
    return their specs. Flags the user leaves out are absent from the parsed namespace, so the engine's own
    defaults apply (and stay the engine's business)."""
    specs = [spec for spec in engine_arg_specs() if spec.name not in exclude]
    for spec in specs:
        shown = "" if spec.default is dataclasses.MISSING else f" (default: {spec.default})"
        help_text = (spec.help + shown).replace("%", "%%")  # argparse formats help with %
        kwargs: dict[str, Any] = dict(dest=spec.name, default=argparse.SUPPRESS, help=help_text)
        if spec.type is bool:
            parser.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif spec.choices is not None:
            parser.add_argument(spec.flag, choices=spec.choices, **kwargs)
        else:
            parser.add_argument(spec.flag, type=spec.type, metavar=spec.type.__name__.upper(), **kwargs)
    return specs


def engine_args_from(namespace: argparse.Namespace, specs: list[EngineArgSpec]) -> dict[str, Any]:
    """The engine keyword arguments the user gave on the command line."""
    return {spec.name: getattr(namespace, spec.name) for spec in specs if hasattr(namespace, spec.name)}


def check_engine_args(model: str, engine_args: dict[str, Any]) -> None:
    """Raise the engine's own `UnknownArgumentError` / `InvalidConfigError` for bad arguments now, before
    any loading: the command line reports it in one line instead of a failed start-up."""
    EngineConfig.from_kwargs(model, **engine_args)
