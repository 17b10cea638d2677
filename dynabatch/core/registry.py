"""A registry of names: each name registered once, with the help line every choice list and help text shows.

A :class:`Registry` *is* the tuple of its names, in the order commands list them, so it goes straight into a
``Literal[...]`` field type (the flag's choices), an ``in`` test or a ``", ".join``; it also knows each name's
help line (:meth:`Registry.help`, :meth:`Registry.describe`) and checks a user's choice with one clear
``ValueError`` that lists the valid names (:meth:`Registry.check`). Registries are built once, at import, in the
module that owns the names (:mod:`dynabatch.core.methods`, ...), and never change after.
"""

from __future__ import annotations

from collections.abc import Iterable


class Registry(tuple):
    """The names of one kind of choice (``what``: "batching method", "schedule policy", ...), each with a help line.

    >>> colours = Registry("colour", [("red", "warm"), ("blue", "cold")])
    >>> colours, "red" in colours, colours.describe()
    (('red', 'blue'), True, 'red (warm), blue (cold)')
    """

    what: str
    helps: dict[str, str]

    def __new__(cls, what: str, entries: Iterable[tuple[str, str]]) -> "Registry":
        entries = list(entries)
        names = [name for name, _ in entries]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"{what} names registered twice: {', '.join(duplicates)}")
        self = super().__new__(cls, names)
        self.what = what
        self.helps = dict(entries)
        return self

    def __reduce__(self):
        return Registry, (self.what, list(self.helps.items()))

    def __add__(self, other: "Registry") -> "Registry":
        """The names of both registries (``other`` after these): a new registry named after this one."""
        if not isinstance(other, Registry):
            return tuple(self) + tuple(other)
        return Registry(self.what, [*self.helps.items(), *other.helps.items()])

    def check(self, name: str) -> str:
        """``name`` if registered; else ``ValueError`` naming it and listing the valid names."""
        if name not in self.helps:
            raise ValueError(f"unknown {self.what} {name!r}; valid: {', '.join(self)}")
        return name

    def help(self, name: str) -> str:
        """The help line of ``name``."""
        return self.helps[self.check(name)]

    def describe(self, last: str = ", ") -> str:
        """Every name with its help in parentheses, for a flag's help text (``a (..), b (..)``)."""
        items = [f"{name} ({help})" if help else name for name, help in self.helps.items()]
        if last != ", " and len(items) > 1:
            return ", ".join(items[:-1]) + last + items[-1]
        return ", ".join(items)
