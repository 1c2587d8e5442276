"""What one row's render of a prompt template may cost, and the counting that holds it there
(:mod:`batchspec.io.templates` compiles templates and calls these from its sandbox).

Every operation whose cost grows with a value's size counts that size against the row's
:data:`MAX_WORK`: filters, tests, methods and operators (their input with its nested items, their
arguments, what they build), comparisons and ``in`` (both sides), slices (the copy), a ``{% set %}``
or ``{% filter %}`` block's body, a list or a struct written out as text, and the measuring itself.
What runs once an item in Python costs more (:data:`CALL_COST`, :data:`ITEM_COST`), and so does
each loop iteration (:data:`NODE_COST` a node of its body). The unit is about what C code takes
to handle one character or item, so :data:`MAX_WORK` is about a second of rendering: a row over it
is its own error that soon, and every single operation is bounded by :data:`MAX_CHARS`, so that a
signal handler gets to run. A stopping run makes a render in progress give up
(:func:`interrupt_renders`)."""

from __future__ import annotations

import collections
import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

#: Loop iterations one row's render may take, all loops together (the sandbox's own ``range``
#: limit, for every loop).
MAX_LOOP_ITERATIONS = 100_000
#: Characters (or items, for a list) the rendered text, and any value computed on the way, may
#: have: 16 Mi, far above any context window.
MAX_CHARS = 1 << 24
#: Work one row's render may do: characters and items handled, each call and loop iteration
#: weighted by what it costs beside them. About a second.
MAX_WORK = 1 << 26
#: Work a filter, test or method call costs besides what it handles: a few microseconds of
#: Python, also when a filter makes it once an item (``map('upper')``).
CALL_COST = 256
#: Work each item costs a filter that runs Python on each (a ``sort`` key, ``map(attribute=)``).
ITEM_COST = 32
#: Work each loop iteration costs for each node of the loop's body (an attribute read, an output):
#: about a microsecond.
NODE_COST = 64
#: Bits an integer built by ``*`` may have (``{% set n = n * n %}`` squares its digits).
MAX_INT_BITS = 1 << 16
#: Digits ``round`` may round to (``round(1, 10**9, 'floor')`` computes ``10**10**9``).
MAX_ROUND_DIGITS = 32
#: Levels a template may nest tags and expressions: a few more overflow Jinja2's parser or
#: Python's compiler, and compiling slows down with the depth well before.
MAX_NESTING = 40


class TemplateBudget(Exception):
    """A row's render went over one of the bounds."""


class RenderStopped(Exception):
    """The run is stopping: the row being rendered is dropped anyway."""


class _Spent(threading.local):
    loops = 0
    work = 0
    #: id -> (list or struct, its characters, its items): what :func:`deep_size` measured in
    #: this row's render
    sizes: dict[int, tuple[Any, int, int]] = {}


_spent = _Spent()
_interrupt: Callable[[], bool] | None = None


def interrupt_renders(check: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """Make every render give up (:class:`RenderStopped`) once ``check()`` is true; None: never.
    The previous check is returned, to be put back. For a run that stops: the rows it reads
    after the stop are dropped, so it need not wait for one to render."""
    global _interrupt
    previous, _interrupt = _interrupt, check
    return previous


def begin_row() -> None:
    _spent.loops = _spent.work = 0
    _spent.sizes = {}


def end_row() -> None:
    _spent.sizes = {}  # the values measured may be large: not kept past the row


def work(n: int) -> None:
    _spent.work += n
    if _spent.work > MAX_WORK:
        raise TemplateBudget(_work_why())
    if _interrupt is not None and _interrupt():
        raise RenderStopped()


def _work_why() -> str:
    return (
        f"more than {MAX_WORK:,} units of work (characters and items handled, calls and loop steps weighted)"
    )


def size(value: Any) -> int:
    if isinstance(value, str | bytes | list | tuple | dict):
        return len(value)
    return 0


def cap_size(n: int) -> None:
    if n > MAX_CHARS:
        raise TemplateBudget(f"a value of more than {MAX_CHARS:,} characters or items")


def cap(value: Any) -> Any:
    """A computed value, refused when it is larger than :data:`MAX_CHARS`, and counted as work."""
    n = size(value)
    cap_size(n)
    work(n)
    return value


_CONTAINERS = (list, tuple, dict)


def deep_size(value: Any, limit: int, why: str, per_item: int = 1) -> int:
    """``value``'s characters and items, nested ones included (a number counts its digits), each
    item ``per_item`` (what writing it out or handling it costs beside its characters), measured
    without building anything: TemplateBudget(``why``) once they pass ``limit``. A list or a
    struct measured whole is remembered for the rest of the row's render, so a value read again
    is not walked again; the items walked count as work. A generator is not walked (what it
    yields is counted where it is built)."""
    if not isinstance(value, _CONTAINERS):
        total = _scan((value,))[0]
        if total > limit:
            raise TemplateBudget(why)
        return total
    memo = _spent.sizes
    seen = memo.get(id(value))
    if seen is not None and seen[0] is value:
        if seen[1] + per_item * seen[2] > limit:
            raise TemplateBudget(why)
        return seen[1] + per_item * seen[2]
    # each frame: [container, its child containers left (child, times), characters, items, times]
    stack = [_open(value, 1)]
    total = stack[0][2] + per_item * stack[0][3]
    while True:
        if total > limit:
            raise TemplateBudget(why)
        frame = stack[-1]
        child = next(frame[1], None)
        if child is None:
            stack.pop()
            container, _, chars, items, times = frame
            if len(container) >= 16:
                memo[id(container)] = (container, chars, items)
            if not stack:
                return chars + per_item * items
            stack[-1][2] += chars * times
            stack[-1][3] += items * times
            total += (chars + per_item * items) * (times - 1)
            continue
        child, times = child
        seen = memo.get(id(child))
        if seen is not None and seen[0] is child:
            frame[2] += seen[1] * times
            frame[3] += seen[2] * times
            total += (seen[1] + per_item * seen[2]) * times
        else:
            stack.append(_open(child, times))
            total += stack[-1][2] + per_item * stack[-1][3]


def _open(container, times: int) -> list:
    """A frame of :func:`deep_size`'s walk: its scalars measured, its containers to visit."""
    items = [*container.keys(), *container.values()] if isinstance(container, dict) else container
    chars, children = _scan(items)
    # the walk itself: two passes in C an item, and Python's steps a container
    work(2 * len(items) + 2 * CALL_COST)
    distinct = dict(zip(map(id, children), children, strict=True))
    if len(distinct) == len(children):
        pending = zip(children, itertools.repeat(1))
    else:  # one list repeated inside another: measured once
        counts = collections.Counter(map(id, children))
        pending = ((distinct[i], n) for i, n in counts.items())
    return [container, iter(pending), chars, len(container), times]


def _scan(items: Sequence[Any]) -> tuple[int, list]:
    """The size of the scalars among ``items``, and the lists and structs among them: one pass
    in C a type of item, not a Python step an item."""
    kinds = set(map(type, items))
    total = 0
    children: list = []
    for kind in kinds:
        if len(kinds) == 1:
            same = items
        else:
            same = list(itertools.compress(items, map(frozenset((kind,)).__contains__, map(type, items))))
        if issubclass(kind, _CONTAINERS):
            children.extend(same)
        elif issubclass(kind, str | bytes | bytearray):
            total += sum(map(len, same))
        elif issubclass(kind, int) and not issubclass(kind, bool):
            total += sum(map(int.bit_length, same)) // 3 + len(same)
        elif issubclass(kind, float):
            total += 24 * len(same)
        else:
            total += len(same)
    return total, children


def count_deep(value: Any, per_item: int = 1) -> int:
    """Count ``value``, nested items included, as work; its size."""
    n = deep_size(value, MAX_WORK - _spent.work, _work_why(), per_item)
    work(n)
    return n


def counted(value: Any) -> Any:
    """A comparison's operand (``x in l``, ``a == b``): read whole, nested items included."""
    count_deep(value)
    return value


def serializable(value: Any) -> None:
    """A list or a struct about to be written out as text (JSON, ``str``): refused before it
    is when its characters and items are over :data:`MAX_CHARS`."""
    if isinstance(value, _CONTAINERS):  # an item is written with a separator: ", " or ": "
        deep_size(value, MAX_CHARS, f"a value of more than {MAX_CHARS:,} characters or items", 3)


def as_text(value: Any) -> Any:
    """An operand of ``~``, which writes it out as text."""
    serializable(value)
    return value


def concat(chunks) -> str:
    """What a ``{% set %}`` or ``{% filter %}`` block wrote, joined: measured before it is."""
    chunks = chunks if isinstance(chunks, list) else list(chunks)
    n = sum(map(len, chunks))
    cap_size(n)
    work(n)
    return "".join(chunks)


def loop(iterable: Any, weight: int):
    """Every ``for`` loop's iterable, counted against :data:`MAX_LOOP_ITERATIONS`, each iteration
    ``weight`` work (the loop body's nodes)."""
    for item in iterable:
        _spent.loops += 1
        if _spent.loops > MAX_LOOP_ITERATIONS:
            raise TemplateBudget(f"more than {MAX_LOOP_ITERATIONS:,} loop iterations")
        work(weight)
        yield item


def binop(operator: str, left: Any, right: Any) -> None:
    """Refuse or count an arithmetic operator before it runs."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(n, int):
                cap_size(len(seq) * max(n, 0))
    if operator == "+":
        cap_size(size(left) + size(right))
    if isinstance(left, int) and isinstance(right, int):
        if operator == "*" and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateBudget(f"an integer of more than {MAX_INT_BITS:,} bits")
        # a product or a division of big integers: each word of one by each word of the other
        words = (left.bit_length() >> 6) + 4, (right.bit_length() >> 6) + 4
        work(words[0] * words[1] if operator in ("*", "/", "//", "%") else words[0] + words[1])


def join_size(items: Sequence[Any], separator: Any) -> int:
    return sum(map(len, map(str, items))) + max(len(items) - 1, 0) * len(str(separator))


def replace_size(text: str, old: str, new: str, count: int | None = None) -> int:
    found = text.count(old) if old else len(text) + 1
    if count is not None and count >= 0:
        found = min(found, count)
    return len(text) + found * (len(new) - len(old))


def refused_arguments(name: str, positional: int, keywords: set[str]) -> str | None:
    """Why a filter called with these arguments (besides its input) is refused, or None: the
    ones whose cost is not linear in their input."""
    if name == "tojson" and (positional or keywords):
        return "tojson takes no argument in a prompt template (indent= allocates at will)"
    if name == "sum" and (positional >= 2 or "start" in keywords):
        return "sum's start is not available in a prompt template (summing lists is quadratic)"
    return None


#: Filters that apply a test or a filter named by their argument to each item (the argument's
#: cost paid once an item: ``select('in', other)``).
_PER_ITEM = frozenset({"select", "reject", "selectattr", "rejectattr", "map"})
#: Filters that run Python on each item: a key (``sort`` ignores case by default), an attribute
#: getter, a test or a filter.
_PYTHON_PER_ITEM = _PER_ITEM | {"sort", "dictsort", "groupby", "unique", "min", "max"}
#: Filters that sort: n log n comparisons.
_SORTING = frozenset({"sort", "dictsort", "groupby"})
#: Filters that write their input out as text (``str``), whatever it is.
_TEXT_FILTERS = frozenset(
    {"capitalize", "e", "escape", "forceescape", "lower", "replace", "safe", "string", "striptags"}
    | {"title", "tojson", "trim", "truncate", "upper", "urlencode", "wordcount", "join"}
)


def checked_filter(name: str, func):
    """A filter whose call, input (nested items included) and arguments count against
    :data:`MAX_WORK`, whose arguments are checked (:func:`refused_arguments`, ``round``'s
    precision), and whose result is capped and counted (``join``, ``replace``, ``string`` and
    ``tojson`` checked before they allocate)."""
    from jinja2.sandbox import SecurityError
    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(func) is None else 1

    @functools.wraps(func)
    def checked(*args, **kwargs):
        value = args[skip] if len(args) > skip else None
        rest = args[skip + 1 :]
        why = refused_arguments(name, len(rest), set(kwargs))
        if why is not None:
            raise SecurityError(why)
        if name == "round":
            precision = rest[0] if rest else kwargs.get("precision", 0)
            if not isinstance(precision, int) or abs(precision) > MAX_ROUND_DIGITS:
                raise TemplateBudget(f"round to more than {MAX_ROUND_DIGITS} digits")
        work(CALL_COST)
        n = count_deep(value)
        extra = count_deep([*rest, *kwargs.values()]) if rest or kwargs else 0
        items = size(value)
        if name in _PER_ITEM:
            work(items * extra)
        elif name == "trim" and rest:  # str.strip(chars) looks each character up in chars
            work(n * size(rest[0]))
        if name in _PYTHON_PER_ITEM or "attribute" in kwargs:
            work(items * ITEM_COST)
        if name in _SORTING:
            work(items * items.bit_length())
        if name in _TEXT_FILTERS:
            serializable(value)
        if name == "join" and isinstance(value, list | tuple | str):
            separator = args[skip + 1] if len(args) > skip + 1 else kwargs.get("d", "")
            cap_size(join_size(value, separator))
        elif name == "replace" and isinstance(value, str) and len(args) > skip + 2:
            old, new = str(args[skip + 1]), str(args[skip + 2])
            count = args[skip + 3] if len(args) > skip + 3 else kwargs.get("count")
            cap_size(replace_size(value, old, new, count))
        return cap(func(*args, **kwargs))

    return checked


def checked_test(func):
    """A test (``x is in l``, also once an item for ``select('in', l)``) whose call, input and
    arguments count against :data:`MAX_WORK`."""
    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(func) is None else 1

    @functools.wraps(func)
    def checked(*args, **kwargs):
        work(CALL_COST)
        count_deep([*args[skip:], *kwargs.values()])
        return func(*args, **kwargs)

    return checked


def method_call(name: str, owner: Any, args: tuple) -> tuple:
    """Count a method call on text, a list or a struct before it runs (``join``'s items, as a
    list, are what it is then called with)."""
    n = count_deep(owner)
    if name in ("strip", "lstrip", "rstrip") and args and args[0] is not None:
        work(n * size(args[0]))  # each character looked up in the argument
    if name == "join":
        items = list(args[0]) if args else []
        serializable(items)
        cap_size(join_size(items, owner))
        args = (items,)
    elif name == "replace" and isinstance(owner, str) and len(args) >= 2:
        cap_size(replace_size(owner, str(args[0]), str(args[1]), *args[2:3]))
    return args


def too_deep(tree) -> int | None:
    """The line of a node nested deeper than :data:`MAX_NESTING` in ``tree``, or None. Without
    recursion: Jinja2's own passes recurse, and would overflow first."""
    stack = [(tree, 0, 1)]
    while stack:
        node, depth, line = stack.pop()
        line = getattr(node, "lineno", None) or line  # an operand has none of its own
        if depth > MAX_NESTING:
            return line
        stack.extend((child, depth + 1, line) for child in node.iter_child_nodes())
    return None


def body_weight(loop, nodes) -> int:
    """The work a loop's iteration costs beside what its calls count: its body's nodes."""
    parts = [*loop.body, loop.test] if loop.test is not None else loop.body
    return NODE_COST * sum(1 + sum(1 for _ in part.find_all(nodes.Node)) for part in parts)
