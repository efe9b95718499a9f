"""Shared base for every recipe section: strict keys, frozen values, described fields.

Every section model forbids unknown keys (a misspelt key is an error, never
silently ignored: the failure mode of peer launchers' schemas) and is frozen
(validators never rewrite user values; derived values are computed properties).
"""

from __future__ import annotations

import typing

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _numeric(annotation: object) -> bool:
    """True when the annotation is int or float, alone or inside Optional / Union / Annotated /
    a tuple or list of them (and bool is not one of the allowed types)."""
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    if bool in args:
        return False
    return any(_numeric(a) for a in args if a is not type(None) and a is not Ellipsis)


class Section(BaseModel):
    """Base class of all recipe sections: ``extra="forbid"``, frozen, validated defaults.

    A YAML boolean is never taken for a number (pydantic's lax mode reads ``dim: true`` as 1);
    full strict mode is not used because YAML gives lists where the schema keeps tuples."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: object, info: ValidationInfo) -> object:
        items = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(v, bool) for v in items) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"a number is required, not the boolean {value!r} (YAML reads true/false/yes/no "
                             "as booleans)")
        return value
