"""Enum fields of the public API as domain names. proto3 keeps numbers it does not know (a
newer client, a typo'd constant), so each conversion refuses them instead of guessing."""
from __future__ import annotations

from typing import Mapping, TypeVar

from generation_service.engine.errors import InvalidRequestError

Name = TypeVar("Name")


def enum_name(names: Mapping[int, Name], value: int, field: str) -> Name:
    """The domain name of a known enum value; InvalidRequestError (-> INVALID_ARGUMENT) naming
    `field` otherwise."""
    if value not in names:
        raise InvalidRequestError(f"{field} {value} is not a known value; expected one of {sorted(names)}")
    return names[value]
