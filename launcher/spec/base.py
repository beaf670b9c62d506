"""The base of every spec model: frozen, unknown keys rejected, every field described."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Strict(BaseModel):
    """Frozen and ``extra="forbid"``: a typo is an error, never a silently ignored key."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def _scalar_to_str(value: object) -> object:
    """Environment values are strings. Job and cluster files and ``--set`` give them as the
    text written (the loader reads every scalar under an ``env`` key as text); a number or bool
    given from Python or JSON becomes text here. A null is refused: a variable needs a value."""
    if value is None:
        raise ValueError(
            "null is not an environment value; give the text (quote it, 'null', to mean "
            "the word) or leave the variable out"
        )
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return str(value)
    return value


EnvValue = Annotated[str, BeforeValidator(_scalar_to_str)]
EnvDict = dict[str, EnvValue]
