"""Shared base for every recipe section: strict keys, strict types, frozen values, described fields.

Every section model forbids unknown keys (a misspelt key is an error, never
silently ignored: the failure mode of peer launchers' schemas) and is frozen
(validators never rewrite user values; derived values are computed properties).

Types are strict where YAML invites a silent conversion (pydantic's lax mode would take each):

* a number field refuses text (``ep: "8"``, ``lr: "2e-4"``) and booleans (``dim: true``);
  YAML 1.1 number forms that YAML 1.2 reads as text (``010``, ``1:20``, ``8_0``) are refused
  with what YAML 1.1 would have made of them and the number to write instead;
* a boolean field refuses text and numbers (``tensorboard: yes`` / ``"true"`` / ``1``): write
  ``true`` or ``false``.

Allowed on purpose: an integer where a float is expected (``lr: 1``, ``factor: 16``), and a
whole-valued float where an integer is expected (``tokens: 1e12``; pydantic refuses ``2.5``).
Full pydantic strict mode is not used because YAML gives lists where the schema keeps tuples.
"""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

_LEADING_ZERO = re.compile(r"^[-+]?0[0-9_]+$")
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_SEPARATED = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?$")
_BINARY = re.compile(r"^[-+]?0b[01_]+$")


def _has(annotation: object, kinds: tuple[type, ...]) -> bool:
    """True when ``annotation`` is one of ``kinds``, alone or inside Optional / Union / a tuple or list."""
    if annotation in kinds:
        return True
    return any(_has(a, kinds) for a in typing.get_args(annotation) if a is not type(None) and a is not Ellipsis)


def _numeric(annotation: object) -> bool:
    """True when the annotation holds int or float and bool is not one of the allowed types."""
    return bool not in typing.get_args(annotation) and annotation is not bool and _has(annotation, (int, float))


def _sexagesimal(text: str) -> int | float:
    sign = -1 if text.startswith("-") else 1
    value: int | float = 0
    for part in text.lstrip("+-").replace("_", "").split(":"):
        value = value * 60 + (float(part) if "." in part else int(part))
    return sign * value


def text_number_problem(text: str) -> str:
    """Why the text ``text`` is not taken for a number, and what to write instead."""
    t = text.strip()
    if len(t) > 40:
        return f"a number is required, not text ({len(t)} characters)"
    if _LEADING_ZERO.match(t):
        digits = t.lstrip("+-").replace("_", "")
        octal = f"octal {int(digits, 8)}" if set(digits) <= set("01234567") else "an error"
        return (f"a number is required; {t!r} has a leading zero, which YAML 1.1 reads as {octal} and "
                f"YAML 1.2 as {int(digits)}: write the number without the leading zero (e.g. {int(digits)})")
    if _SEXAGESIMAL.match(t):
        return (f"a number is required; {t!r} is base 60 in YAML 1.1 (= {_sexagesimal(t)}) and text in "
                f"YAML 1.2: write {_sexagesimal(t)}")
    if "_" in t and _SEPARATED.match(t):
        return f"a number is required; '_' digit separators are not YAML 1.2: write {t.replace('_', '')}"
    if _BINARY.match(t):
        return f"a number is required; binary literals are YAML 1.1 only: write {int(t.replace('_', ''), 0)}"
    if t.lower() in ("yes", "no", "on", "off", "y", "n"):
        return f"a number is required, not the word {t!r} (a boolean in YAML 1.1, text in YAML 1.2)"
    try:
        number = float(t)
    except ValueError:
        return f"a number is required, not the text {t!r}"
    if number != number or number in (float("inf"), float("-inf")):
        return f"a finite number is required, not {t!r}"
    return f"a number is required, not the text {t!r} (quoted in the YAML?): write it without quotes, e.g. {t}"


class Section(BaseModel):
    """Base class of all recipe sections: ``extra="forbid"``, frozen, validated defaults, strict
    numbers and booleans (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: object, info: ValidationInfo) -> object:
        annotation = cls.model_fields[info.field_name].annotation
        items = value if isinstance(value, (list, tuple)) else (value,)
        if _numeric(annotation):
            if any(isinstance(v, bool) for v in items):
                raise ValueError(f"a number is required, not the boolean {value!r} (YAML reads true/false as "
                                 "booleans)")
            text = next((v for v in items if isinstance(v, str)), None)
            if text is not None and not _has(annotation, (str,)):
                raise ValueError(text_number_problem(text))
            if isinstance(value, float) and value.is_integer() and not _has(annotation, (float,)):
                return int(value)  # tokens: 1e12 is the whole number 10**12 (pydantic's lax mode takes it too)
        elif annotation is bool or (bool in typing.get_args(annotation) and not _has(annotation, (str, int, float))):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"true or false is required, not {value!r} (YAML 1.2 reads yes/no/on/off and "
                                 "quoted words as text): write true or false")
        return value
