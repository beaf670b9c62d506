"""The base of every spec model: frozen, unknown keys rejected, every field described."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Strict(BaseModel):
    """Frozen and ``extra="forbid"``: a typo is an error, never a silently ignored key."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def _scalar_to_str(value: object) -> object:
    """YAML reads ``NCCL_DEBUG: 1`` as an int; environment values are strings."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return str(value)
    return value


EnvValue = Annotated[str, BeforeValidator(_scalar_to_str)]
EnvDict = dict[str, EnvValue]
