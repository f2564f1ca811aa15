"""A page of a list (the dead letters, the waiting or delayed jobs): :data:`PAGE_SIZE` a
page, the page asked for, and a filtered page's reader and what it says of its filter."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

#: Dead letters (``/dead``) or jobs (``/jobs``) a page.
PAGE_SIZE = 50


def page_of(
    items: Iterable[T], keep: Callable[[T], bool], number: int, reads: int
) -> tuple[list[T], int, int]:
    """Page ``number`` (:data:`PAGE_SIZE` a page) of ``items`` that ``keep`` keeps, reading
    at most ``reads`` of them: (the page, how many match, how many were read). A filtered
    page's one reader: the dead letters' and the waiting jobs'."""
    first = number * PAGE_SIZE
    page: list[T] = []
    matching = read = 0
    for item in itertools.islice(items, reads):
        read += 1
        if keep(item):
            if first <= matching < first + PAGE_SIZE:
                page.append(item)
            matching += 1
    return page, matching, read


def found_note(sought: str, matching: int, read: int, total: int, which: str) -> str:
    """What a filtered page says of its filter (nothing when not filtered): how many match,
    and when it read fewer than all (``which`` it read: ``oldest``...), that it did."""
    if not sought:
        return ""
    short = f" (of the {which} {read} read; narrow the search)" if read < total else ""
    return f"{matching} of them match {sought!r}{short}; "


def sought_in(params: dict[str, str]) -> str:
    """What a page is filtered by (``?find=T``, trimmed, at most 200 characters)."""
    return params.get("find", "").strip()[:200]


def page_number(params: dict[str, str]) -> int:
    """The page asked for (``?page=N``, from 0; anything else: the first)."""
    page = params.get("page", "")
    return int(page) if page.isdigit() else 0
