"""A generation request's admission, carried from the door to its handler in the ASGI scope's state.

The door (server/door.py) or else LoadSheddingMiddleware admits a generation request, reserving its place in
the engine's waiting queue; the handler hands that place to generate() (server/generation.py). Between them the
ticket travels in the scope's state, the one per-request store the protocol, the middleware and the handler
share: these functions are its only way in and out.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from pagedserve.engine.client.async_stream import Reservation

_STATE_KEY = "admission_ticket"


@dataclass(frozen=True)
class AdmissionTicket:
    """An admitted request's queue place; None where the engine took nothing when it was admitted (generate()
    then says why)."""

    place: Reservation | None


def put_ticket(state: MutableMapping[str, Any], ticket: AdmissionTicket) -> None:
    """Gives the request whose scope state this is its ticket."""
    state[_STATE_KEY] = ticket


def ticket_in(state: Mapping[str, Any]) -> AdmissionTicket | None:
    """The ticket a scope's state holds, None before its request is admitted."""
    ticket = state.get(_STATE_KEY)
    assert ticket is None or isinstance(ticket, AdmissionTicket)
    return ticket


def reserved_place(request: Request) -> Reservation | None:
    """The queue place the request was admitted with, if it holds one."""
    ticket = ticket_in(request.scope.get("state", {}))
    return None if ticket is None else ticket.place


def release_ticket(state: Mapping[str, Any]) -> None:
    """Gives back the queue place a scope's state holds, unless its request took it (idempotent)."""
    ticket = ticket_in(state)
    if ticket is not None and ticket.place is not None:
        ticket.place.release()
