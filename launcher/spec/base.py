"""The base of every spec model: frozen, unknown keys rejected, every field described."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class Strict(BaseModel):
    """Frozen and ``extra="forbid"``: a typo is an error, never a silently ignored key."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


_KINDS = {"bool": "a boolean", "int": "a number", "float": "a number", "date": "a date"}


def _text_only(value: object) -> object:
    """Environment values are text. YAML reads ``1.10`` as 1.1, ``true`` as True and ``0022``
    as 18, so anything but a string is refused rather than guessed at."""
    if value is None:
        raise ValueError(
            "null is not an environment value; quote it ('null') to mean the word, or leave "
            "the variable out"
        )
    if not isinstance(value, str):
        raise ValueError(
            f"YAML read this value as {_KINDS.get(type(value).__name__, 'no text')}; quote it "
            f"(e.g. '1.10', 'true', '0022') so the workers get exactly what you wrote"
        )
    return value


EnvValue = Annotated[str, BeforeValidator(_text_only)]
EnvDict = dict[str, EnvValue]
Port = Annotated[int, Field(ge=1024, le=65535)]  # an unprivileged TCP port
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # job and node names
