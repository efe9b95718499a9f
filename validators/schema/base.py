"""Shared base for every recipe section: strict keys, frozen values, described fields.

Every section model forbids unknown keys (a misspelt key is an error, never
silently ignored: the failure mode of peer launchers' schemas) and is frozen
(validators never rewrite user values; derived values are computed properties).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base class of all recipe sections: ``extra="forbid"``, frozen, validated defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)
