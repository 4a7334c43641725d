"""The waiting queue's places on the caller's side: reservations made before a request's body is read."""

from __future__ import annotations

import pytest

from pagedserve.engine import QueueFullError
from pagedserve.engine.client.async_stream import QueuePlaces


def test_reservations_count_against_the_limit() -> None:
    places = QueuePlaces(limit=2)
    first, second = places.reserve(), places.reserve()
    with pytest.raises(QueueFullError, match="2 more are being submitted"):
        places.reserve()
    first.release()
    third = places.reserve()
    assert second.held and third.held


def test_a_reservation_becomes_one_of_the_places_it_takes() -> None:
    places = QueuePlaces(limit=3)
    reservation = places.reserve()
    places.take(3, reservation)  # its own reserved place is one of the three
    assert not reservation.held
    reservation.release()  # after taking: nothing to give back
    with pytest.raises(QueueFullError):
        places.reserve()
    places.free(3)
    places.reserve()


def test_a_request_needing_more_places_than_left_keeps_nothing() -> None:
    places = QueuePlaces(limit=2)
    other = places.reserve()
    reservation = places.reserve()
    with pytest.raises(QueueFullError):
        places.take(2, reservation)  # n=2: one more place than is left
    assert reservation.held and other.held
    reservation.release()
    other.release()
    places.take(2)  # everything was given back


def test_release_is_idempotent() -> None:
    places = QueuePlaces(limit=1)
    reservation = places.reserve()
    reservation.release()
    reservation.release()
    places.take(1)
    with pytest.raises(QueueFullError):
        places.reserve()
