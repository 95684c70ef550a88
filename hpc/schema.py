"""The login side's one schema mechanism: a table of keys per mapping a user writes.

Each key of the job spec (:data:`hpc.spec.SPEC`) and of a cluster profile
(:data:`hpc.profiles.PROFILE` and its nested mappings) is declared once as a
:class:`Key`: its kind, bounds, choices, default and help. Reading a mapping
(:meth:`Table.read`) and every one-line message (``LABEL: VALUE is not allowed; allowed:
...``, the nearest valid key or choice named through difflib) come from that
declaration, so changing a bound in the table changes both the check and its message.

Why a table of our own (standard library only) and not pydantic v2 or msgspec:
``hpc render`` is a whole process a user waits for on a login node, and importing
pydantic and building its models costs about as much again as all of ``hpc render``
(docs/architecture.md, "One schema per side", has the figures); its messages would need
a translator to keep every existing line byte for byte. msgspec is not installed here
and would be a compiled dependency for the same thing. What a schema library would add
(coercion rules, JSON schema) the login side does not need.

Keys whose value is a structure of its own (``command``, ``queues``, ``rules``...) are
``kind="custom"`` with a ``parse`` function next to the table that declares them; they
still have their default and help here, and their nested mappings are tables too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING as _NO_DEFAULT
from dataclasses import fields
from typing import Any

from hpc._util import check_keys, did_you_mean
from hpc.errors import UserError

#: A custom key's reader: (value, label, the keys read so far) -> the value to keep.
Parse = Callable[[Any, str, dict[str, Any]], Any]
#: A check run on a kind's result (each item for ``strings``): (value, label) -> value.
Then = Callable[[Any, str], Any]

#: What each kind accepts, as the message says when no ``allowed`` text is declared.
_KIND_ALLOWED = {
    "str": "a string",
    "bool": "true or false",
    "strings": "a list of strings",
}
#: A key that is not in the mapping (``None`` is a key given as null).
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()
KINDS = ("str", "text", "int", "number", "bool", "choice", "strings", "custom", "meta")


def refuse(label: str, value: Any, allowed: str, hint: str = "") -> UserError:
    """The one-line message every key check raises: what, which value (cut to 80
    characters: a 5000-digit number is one line, not a screenful), what is allowed."""
    shown = repr(value)
    if len(shown) > 80:
        shown = f"{shown[:77]}..."
    return UserError(f"{label}: {shown} is not allowed{hint}; allowed: {allowed}")


def expect(label: str, allowed: str) -> UserError:
    """The line for a value of the wrong shape (a list where a mapping goes): what goes."""
    return UserError(f"{label}: allowed: {allowed}")


class Key:
    """One key of a mapping, declared once.

    ``kind``: ``str``, ``text`` (free text for people: anything, none or false is
    empty), ``int`` (a whole number within ``low``/``high``), ``number``
    (int or float within the bounds; NaN fails both), ``bool`` (true or false: a
    switch written ``'no'`` or ``0`` is refused, not read as its truth value),
    ``choice`` (one of ``choices``, the nearest named for a typo), ``strings``
    (one string or a list), ``custom`` (``parse`` reads it) or ``meta`` (read by the
    loader itself, e.g. ``extends``, an alias: listed as allowed, skipped by
    :meth:`Table.read`). ``allowed`` overrides the generated "allowed:" text and may
    use ``{low}``, ``{high}`` and ``{choices}``. ``choices`` and ``default`` may be
    functions of the keys read before (a scheduler's own queue directives). ``sep``
    joins the mapping's label and the key (the table's when None); ``digits``: a whole
    number may come as ASCII digits in text (command-line flags); ``nullable``: null
    means the default (else null is refused like any other wrong value); ``required``:
    an absent key is checked as a null (refused) instead of taking the default; ``lax``
    (the table's when None): a choice is compared as text and ``strings`` takes any
    scalars (profiles have always been read so).

    A plain class with slots, not a ``@dataclass``: the decorator writes and compiles
    its methods at import, about a millisecond of every ``hpc`` start (measured for
    docs/architecture.md), which is what a user waits for on a login node.
    """

    __slots__ = (
        "name",
        "kind",
        "default",
        "help",
        "low",
        "high",
        "choices",
        "allowed",
        "parse",
        "then",
        "sep",
        "digits",
        "nullable",
        "required",
        "lax",
    )

    def __init__(
        self,
        name: str,
        kind: str = "str",
        default: Any = MISSING,
        help: str = "",
        *,
        low: float | None = None,
        high: float | None = None,
        choices: tuple[str, ...] | Callable[[dict[str, Any]], tuple[str, ...]] = (),
        allowed: str = "",
        parse: Parse | None = None,
        then: Then | None = None,
        sep: str | None = None,
        digits: bool = False,
        nullable: bool = True,
        required: bool = False,
        lax: bool | None = None,
    ) -> None:
        if kind not in KINDS or (kind == "custom") != (parse is not None):
            raise ValueError(f"key {name}: kind {kind!r} with parse {parse!r}")
        self.name, self.kind, self.default, self.help = name, kind, default, help
        self.low, self.high, self.choices, self.allowed = low, high, choices, allowed
        self.parse, self.then, self.sep, self.digits = parse, then, sep, digits
        self.nullable, self.required, self.lax = nullable, required, lax

    def __repr__(self) -> str:
        return f"Key({self.name!r}, {self.kind!r})"

    def but(self, **changes: Any) -> Key:
        """A copy with ``changes`` (``dataclasses.replace`` for this plain class)."""
        new = object.__new__(Key)
        for slot in self.__slots__:
            setattr(new, slot, changes.get(slot, getattr(self, slot)))
        return new

    def options(self, got: dict[str, Any] | None = None) -> tuple[str, ...]:
        """The choices, computed from the keys read before where they depend on them."""
        return tuple(self.choices(got or {}) if callable(self.choices) else self.choices)

    def fallback(self, got: dict[str, Any] | None = None) -> Any:
        """The default, computed from the keys read before where it depends on them."""
        value = self.default(got or {}) if callable(self.default) else self.default
        if value is MISSING:
            return None
        return type(value)(value) if isinstance(value, (list, dict)) else value  # a fresh one

    def describe(self, got: dict[str, Any] | None = None) -> str:
        """The text after 'allowed:' in this key's messages, from its declaration."""
        choices = ", ".join(self.options(got)) if self.kind == "choice" else ""
        if self.allowed:
            return self.allowed.format(low=self.low, high=self.high, choices=choices)
        if self.kind == "choice":
            return choices
        if self.kind == "int":
            if self.high is not None:
                return f"a whole number from {self.low} to {self.high}"
            return f"a whole number >= {self.low}"
        if self.kind == "number":
            return f"a number from {self.low:g} to {self.high:g}"
        return _KIND_ALLOWED.get(self.kind, self.help)

    def read(self, value: Any, label: str, got: dict[str, Any], lax: bool = False) -> Any:
        """Check ``value`` (:data:`MISSING`: the key is absent) and return what is kept."""
        lax = lax if self.lax is None else self.lax
        if value is MISSING:
            if not self.required:
                return self.fallback(got)
            value = None  # the kind's own message names what is missing
        elif value is None and self.nullable:
            return self.fallback(got)
        elif self.kind == "choice" and lax:
            value = str(value)  # profiles: compared as text, a null included
        if self.kind == "custom":
            assert self.parse is not None, self.name
            return self.parse(value, label, got)
        out = getattr(self, f"_{self.kind}")(value, label, got, lax)
        if self.then is None:
            return out
        if self.kind == "strings":
            return type(out)(self.then(v, label) for v in out)
        return self.then(out, label)

    def _str(self, value: Any, label: str, got: dict[str, Any], lax: bool) -> str:
        if not lax and isinstance(value, (dict, list, bool)):
            raise refuse(label, value, self.describe(got))
        return str(value)

    def _int(self, value: Any, label: str, got: dict[str, Any], lax: bool) -> int:
        text = value.strip() if self.digits and isinstance(value, str) else ""
        if text.isascii() and text.isdigit() and len(text) <= 18:  # ASCII: not ², ٢
            value = int(text)  # 18 digits: past every bound, short of int()'s limit
        if isinstance(value, bool) or not isinstance(value, int) or not self._within(value):
            raise refuse(label, value, self.describe(got))
        return value

    def _number(self, value: Any, label: str, got: dict[str, Any], lax: bool) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not self._within(value):  # NaN fails both bounds
            raise refuse(label, value, self.describe(got))
        return float(value)

    def _within(self, value: float) -> bool:
        low = -float("inf") if self.low is None else self.low
        high = float("inf") if self.high is None else self.high
        return low <= value <= high

    def _bool(self, value: Any, label: str, got: dict[str, Any], lax: bool) -> bool:
        if not isinstance(value, bool):
            raise refuse(label, value, self.describe(got))
        return value

    def _text(self, value: Any, label: str, got: dict[str, Any], lax: bool) -> str:
        return str(value or "")

    def _choice(self, value: Any, label: str, got: dict[str, Any], lax: bool) -> str:
        allowed = self.options(got)
        if value not in allowed:
            hint = did_you_mean(str(value), allowed)
            raise refuse(label, value, self.describe(got), hint)
        return str(value)

    def _strings(self, value: Any, label: str, got: dict[str, Any], lax: bool) -> Any:
        if lax:  # a profile: anything false is none, any scalar is text
            value = value or []
        if isinstance(value, str):
            value = [value]
        nested = (
            not lax and isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)
        )
        if not isinstance(value, list) or nested:
            raise refuse(label, value, self.describe(got))
        words = [str(v) for v in value]
        return tuple(words) if lax else words


class Table:
    """The keys of one mapping, in the order they are checked (the first mistake wins).

    ``sep`` joins the mapping's label (``where``) and a key for messages (``": "``:
    ``cluster x: ppn``; ``"."``: ``resilience.spares``); an empty ``where`` labels a key
    by its name alone (the job spec's top level). ``lax``: see :class:`Key`.
    """

    __slots__ = ("keys", "sep", "lax", "model")

    def __init__(
        self, keys: tuple[Key, ...], sep: str = ": ", lax: bool = False, model: type | None = None
    ) -> None:
        self.keys, self.sep, self.lax, self.model = self._defaults(keys, model), sep, lax, model

    @staticmethod
    def _defaults(keys: tuple[Key, ...], model: type | None) -> tuple[Key, ...]:
        """A key that declares no default takes the one of ``model``'s field of its name.

        Why: the frozen type (``JobSpec``, ``Cluster``...) is also built in Python without
        any YAML, so its fields keep their defaults; the table reads them from there
        instead of writing them a second time.
        """
        if model is None:
            return keys
        own = {}
        for f in fields(model):
            if f.default is not _NO_DEFAULT:
                own[f.name] = f.default
            elif f.default_factory is not _NO_DEFAULT:
                own[f.name] = f.default_factory()
        return tuple(
            k.but(default=own[k.name]) if k.default is MISSING and k.name in own else k
            for k in keys
        )

    def names(self) -> tuple[str, ...]:
        """Every key a user may write here (what an unknown key is compared with)."""
        return tuple(k.name for k in self.keys)

    def __getitem__(self, name: str) -> Key:
        for key in self.keys:
            if key.name == name:
                return key
        raise KeyError(name)

    def defaults(self) -> dict[str, Any]:
        """Each key's default where it depends on no other key (docs, tests, the API)."""
        return {
            k.name: k.fallback() for k in self.keys if k.kind != "meta" and not callable(k.default)
        }

    def check_keys(self, data: Mapping[str, Any], where: str) -> None:
        """Refuse an unknown key, naming the nearest known one."""
        check_keys(dict(data), self.names(), where)

    def label(self, where: str, key: Key) -> str:
        """How messages name ``key`` of the mapping at ``where``."""
        return f"{where}{self.sep if key.sep is None else key.sep}{key.name}" if where else key.name

    def read(
        self, data: Mapping[str, Any], where: str = "", given: Iterable[tuple[str, Any]] = ()
    ) -> dict[str, Any]:
        """Each key's checked value (its default when absent), in declaration order.

        ``given``: values known before reading (e.g. the profile's scheduler) that
        ``choices``, ``default`` and ``parse`` functions may use.
        """
        got: dict[str, Any] = dict(given)
        for key in self.keys:
            if key.kind != "meta":
                value = data.get(key.name, MISSING)
                got[key.name] = key.read(value, self.label(where, key), got, self.lax)
        return {k.name: got[k.name] for k in self.keys if k.kind != "meta"}
