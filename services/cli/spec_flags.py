"""`spotrl up`'s run options, generated from the run spec: one flag per `RunSpec` field, named
after it whatever its section (`--prompts-per-step` sets `training.prompts_per_step`: the flat
names of `FLAT_FIELDS`, which RunSpec takes as they are), its help the field's description, its
choices those of a `Literal`, its default the embedded preset (`EMBEDDED_DEFAULTS`) over the
field's own; with `--task NAME`, that task's preset (`TASK_PRESETS`) over the embedded one for
the flags not given. Values are checked by `RunSpec` itself (`spec_from_args`), so `spotrl up`
refuses exactly what the REST API refuses, and an error names the flag and the field.

Not here: options that are not part of a run (workers, ports, the trace replay): `main.py`.
"""

import argparse
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from services.contracts.runspec import (
    EMBEDDED_DEFAULTS,
    FLAT_FIELDS,
    LORA_FIELDS,
    SECTION_OF,
    TASK_PRESETS,
    RunSpec,
)

# Fields `spotrl up` sets itself: the model folder (it builds one when none is named).
NOT_FLAGS = frozenset({"model"})
# Fields where 0 also means "unset", as `spotrl up` documented before "none" was accepted.
ZERO_IS_NONE = frozenset({"stall_timeout_s"})
# Fields passed to the spec only when they differ from its own default: the lora section turns
# on when one of them is given (`--lora-r 8`), and a flag's default gives none.
GIVEN_ONLY = frozenset({"use_peft", *LORA_FIELDS})


class TaskDefault:
    """The default of a flag that a task's preset sets: `value` (the embedded preset's or the
    field's) unless the run's task has its own (`spec_from_args`)."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def for_task(self, task: str) -> Any:
        return TASK_PRESETS.get(task, {}).get(self.name, self.value)

    def __repr__(self) -> str:
        return repr(self.value)


def task_preset_fields() -> frozenset[str]:
    return frozenset(name for preset in TASK_PRESETS.values() for name in preset)


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser that also reads `none` (any case) as None: the field unset."""

    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() == "none" else parse(text)

    parse_optional.__name__ = parse.__name__  # argparse names the type in its errors
    return parse_optional


def _names_or(words: tuple[str, ...]) -> Callable[[str], Any]:
    """A parser of a comma-separated list of names, or of one of `words` as it is."""

    def names(text: str) -> Any:
        text = text.strip()
        return text if text in words else [n.strip() for n in text.split(",") if n.strip()]

    return names


def _help(name: str, info: FieldInfo, default: Any, optional: bool) -> str:
    text = (info.description or name).replace("%", "%%")
    notes = []
    if optional:
        notes.append("0 or none: unset" if name in ZERO_IS_NONE else "none: unset")
    if name in EMBEDDED_DEFAULTS:
        notes.append(f"default {default!r}, the embedded preset; a spec's own: {info.default!r}")
    else:
        notes.append(f"default {default!r}")
    tasks = [f"{task} {preset[name]!r}" for task, preset in TASK_PRESETS.items() if name in preset]
    if tasks:
        notes.append(f"with --task: {', '.join(tasks)}")
    return f"{text} ({'; '.join(notes)})"


def flag_options(name: str, info: FieldInfo, default: Any) -> dict[str, Any]:
    """`add_argument` keywords for one RunSpec field (`FLAT_FIELDS`)."""
    annotation: Any = info.annotation
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(args) < len(get_args(annotation))
        if list[str] in args and len(args) == 2:  # names, or a word that stands for a set
            word = next(a for a in args if a != list[str])
            return {
                "dest": name,
                "default": default,
                "help": _help(name, info, default, optional)
                + f"; a comma-separated list, or {' or '.join(map(repr, get_args(word)))}",
                "type": _names_or(get_args(word)),
            }
        if len(args) != 1:
            raise TypeError(f"RunSpec.{name}: no flag for a union of {args}")
        annotation = args[0]
    options: dict[str, Any] = {
        "dest": name,
        "default": default,
        "help": _help(name, info, default, optional),
    }
    if annotation is bool and not optional:
        return options | {"action": argparse.BooleanOptionalAction}
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        parse = type(choices[0])
        options["choices"] = choices
    elif annotation in (int, float, str):
        parse = annotation
    else:
        raise TypeError(f"RunSpec.{name}: no flag for type {annotation!r}")
    options["type"] = _or_none(parse) if optional else parse
    return options


def add_spec_flags(
    parser: argparse.ArgumentParser, preset: Mapping[str, Any] = EMBEDDED_DEFAULTS
) -> None:
    """One flag per RunSpec field but `NOT_FLAGS`, in the spec's order (top-level fields, then
    each section's), in a group of their own;
    defaults from `preset`, else the field's."""
    group = parser.add_argument_group(
        "run spec",
        "The fields of the run spec (RunSpec). Defaults: the embedded preset "
        "(EMBEDDED_DEFAULTS: "
        + ", ".join(f"{k}={v!r}" for k, v in preset.items()).replace("%", "%%")
        + "), else the spec's own.",
    )
    task_fields = task_preset_fields()
    for name, info in FLAT_FIELDS.items():
        if name in NOT_FLAGS:
            continue
        default = preset.get(name, info.default)
        options = flag_options(name, info, default)
        if name in task_fields:
            options["default"] = TaskDefault(name, default)
        group.add_argument(flag(name), **options)


def spec_from_args(args: argparse.Namespace, **fields: Any) -> RunSpec:
    """The RunSpec the flags ask for (a flag not given: its task's preset, else the embedded
    one, else the field's default), with `fields` (the model) on top; raises ValidationError."""
    values = {name: getattr(args, name) for name in FLAT_FIELDS if name not in NOT_FLAGS}
    for name, value in values.items():
        if isinstance(value, TaskDefault):
            values[name] = value.for_task(values["task"])
    for name in ZERO_IS_NONE:
        if values.get(name) == 0:
            values[name] = None
    for name in GIVEN_ONLY:
        if values.get(name) == FLAT_FIELDS[name].default:
            del values[name]
    return RunSpec(**(values | fields))


def describe_errors(exc: ValidationError) -> str:
    """One line per error, naming the flag and the field by its place:
    `--top-p (sampling.top_p): Input should...`."""
    lines = []
    for error in exc.errors():
        field = str(error["loc"][-1]) if error["loc"] else ""
        place = ".".join(str(part) for part in error["loc"])
        known = field in FLAT_FIELDS and place in (field, f"{SECTION_OF.get(field)}.{field}")
        where = f"{flag(field)} ({place})" if known else "run spec"
        lines.append(f"{where}: {error['msg']}")
    return "\n".join(lines)
