"""Fakes of the director's collaborators, shared by its unit tests: an observer that records every
call and a forwarder whose requests run until told to finish."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from router.director import Attempt, Interruption, Rejected


class Recorder:
    """An observer taking any method call: ``calls`` holds (method name, positional args) in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, args))

    def of(self, name: str) -> list[tuple[object, ...]]:
        """The args of every call of ``name``, in order."""
        return [args for n, args in self.calls if n == name]


@dataclass
class Hold:
    """A forwarder whose requests run until ``done`` is set (or the router interrupts them): ``send``
    answers ``"answered"``, ``interrupted`` and ``rejected`` hand back what they were given."""

    done: asyncio.Event = field(default_factory=asyncio.Event, kw_only=True)

    async def send(self, attempt: Attempt, retry: bool) -> object:
        await self.done.wait()
        return "answered"

    async def interrupted(self, attempt: Attempt, interruption: Interruption) -> object:
        return interruption

    def rejected(self, rejected: Rejected) -> object:
        return rejected
