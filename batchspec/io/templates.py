"""Prompts rendered from templates over a row's columns: ``input.prompt_template`` (a text
prompt) and ``input.messages_template`` (chat messages, each ``content`` a template).

A template is Jinja2, compiled once and rendered for each row as the reader turns a record
batch's rows into :class:`~batchspec.io.rows.Row` objects, in Jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` (no attribute of Python's internals, no
mutation), with :class:`~jinja2.StrictUndefined` (a name that is not there fails) and no
autoescaping. The row's columns are its variables; a null cell is left out, so it fails as an
undefined name unless the template gives a default (``{{ x | default('n/a') }}``,
``{% if x is defined %}``). An input must have the columns the template reads without such a
guard (:attr:`PromptTemplate.required`, found on the template's syntax tree by
:func:`_unguarded`); one it guards may be missing.

A template cannot cost more than its bounds, whatever the row holds:

- refused when the job is checked (exit 2, naming the key and the line): syntax errors, macros
  and ``{% call %}``, ``include``/``import``/``extends``, recursive loops, the ``**`` operator,
  a dunder attribute (``x.__class__``), the globals ``lipsum``, ``cycler``, ``joiner`` and
  ``namespace``, every filter but :data:`FILTERS` (``map('name')`` included), and the filter
  arguments whose cost is not linear: ``tojson``'s indent, ``sum``'s start (summing lists),
  ``round`` to more than :data:`MAX_ROUND_DIGITS` digits (checked again when a filter is
  named at render: ``map(f, ...)``);
- bounded when a row renders (the row's error when exceeded): :data:`MAX_LOOP_ITERATIONS` loop
  iterations in all (``range`` included, and nested loops counted together),
  :data:`MAX_CHARS` characters (or items) for the output and for any value computed on the way
  (checked before ``*``, ``+``, ``join`` and ``replace`` allocate and before a list or a
  struct is written out as text, and after each filter, ``~`` and call),
  :data:`MAX_INT_BITS` bits for an integer ``*`` builds, :data:`MAX_WORK` characters and items
  handled by filters, methods and operators (each call's input with its nested items, its
  arguments, once an item where it applies them to each (``select('in', other)``) or looks
  each character up in them (``trim(chars)``), and what it builds), and only the methods of
  :data:`METHODS` may be called (``x.upper()``; not ``'{}'.format``).

A list or a struct printed as it is (``{{ labels }}``) renders as JSON; a null printed from
inside one (a struct's null field) or a binary value is the row's error."""

from __future__ import annotations

import functools
import itertools
import json
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from batchspec.errors import SpecError
from batchspec.io.rows import check_messages

#: Loop iterations one row's render may take, all loops together (the sandbox's own ``range``
#: limit, for every loop).
MAX_LOOP_ITERATIONS = 100_000
#: Characters (or items, for a list) the rendered text, and any value computed on the way, may
#: have: 16 Mi, far above any context window.
MAX_CHARS = 1 << 24
#: Characters and items filters, methods and operators may handle in one row's render (each
#: call counts its input, nested items included, its arguments and what it builds): what bounds
#: the time a loop of filters takes.
MAX_WORK = 1 << 26
#: Bits an integer built by ``*`` may have (``{% set n = n * n %}`` squares its digits).
MAX_INT_BITS = 1 << 16
#: Digits ``round`` may round to (``round(1, 10**9, 'floor')`` computes ``10**10**9``).
MAX_ROUND_DIGITS = 32

#: The filters a template may use: each takes time and space linear in its input and arguments
#: (what :func:`_refused_arguments` refuses aside). Left out: those with a width or count
#: argument that allocates at will (center, indent, format, wordwrap, batch, slice), random (a
#: rerun would render other prompts), and the HTML ones (urlize, xmlattr).
FILTERS = frozenset(
    {
        "abs",
        "attr",
        "capitalize",
        "count",
        "d",
        "default",
        "dictsort",
        "e",
        "escape",
        "first",
        "float",
        "forceescape",
        "groupby",
        "int",
        "items",
        "join",
        "last",
        "length",
        "list",
        "lower",
        "map",
        "max",
        "min",
        "reject",
        "rejectattr",
        "replace",
        "reverse",
        "round",
        "safe",
        "select",
        "selectattr",
        "sort",
        "string",
        "striptags",
        "sum",
        "title",
        "tojson",
        "trim",
        "truncate",
        "unique",
        "upper",
        "urlencode",
        "wordcount",
    }
)

#: Methods a template may call, on text, lists and mappings (``body.strip()``,
#: ``meta.get('k')``): none of them allocates more than its input and arguments.
METHODS = frozenset(
    {
        "capitalize",
        "casefold",
        "count",
        "endswith",
        "find",
        "get",
        "index",
        "isalnum",
        "isalpha",
        "isdigit",
        "islower",
        "isspace",
        "isupper",
        "items",
        "join",
        "keys",
        "lower",
        "lstrip",
        "removeprefix",
        "removesuffix",
        "replace",
        "rfind",
        "rsplit",
        "rstrip",
        "split",
        "splitlines",
        "startswith",
        "strip",
        "title",
        "upper",
        "values",
    }
)

#: Globals a template may not use (the rest of Jinja2's: ``range``, ``dict``).
_REFUSED_GLOBALS = ("lipsum", "cycler", "joiner", "namespace")
_HOOK_LOOP = "__batchspec_loop"
_HOOK_CAP = "__batchspec_cap"


class TemplateBudget(Exception):
    """A row's render went over one of the bounds."""


class _NullValue(Exception):
    """A null printed from inside a list or a struct."""


class _Binary(Exception):
    """Binary data printed."""


class _Spent(threading.local):
    loops = 0
    work = 0
    #: id -> (list or struct, its size): what :func:`_deep` measured in this row's render
    sizes: dict[int, tuple[Any, int]] = {}


_spent = _Spent()


def _size(value: Any) -> int:
    if isinstance(value, str | bytes | list | tuple | dict):
        return len(value)
    return 0


def _deep(value: Any, limit: int, why: str) -> int:
    """``value``'s characters and items, nested ones included (a number counts its digits),
    measured without building anything: TemplateBudget(``why``) once they pass ``limit``. A
    list or a struct measured whole is remembered for the rest of the row's render, so a value
    read again (in a loop, or one list repeated inside another) is not walked again; the walk
    costs no more than ``limit`` steps. A generator is not walked (what it yields is counted
    where it is built)."""
    memo = _spent.sizes
    total = 0
    stack: list[tuple[Any, Any, int]] = [(None, iter((value,)), 0)]
    while True:
        container, items, began = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
            if not stack:
                return total
            if len(container) >= 16:
                memo[id(container)] = (container, total - began)
            continue
        if isinstance(item, list | tuple | dict):
            seen = memo.get(id(item))
            if seen is not None and seen[0] is item:
                total += seen[1]
            else:
                total += len(item)
                children = (
                    itertools.chain(item.keys(), item.values()) if isinstance(item, dict) else iter(item)
                )
                stack.append((item, children, total - len(item)))
        elif isinstance(item, str | bytes | bytearray):
            total += len(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 1
        elif isinstance(item, float):
            total += 24
        else:
            total += 1
        if total > limit:
            raise TemplateBudget(why)


_END = object()


def _cap(value: Any) -> Any:
    """A computed value, refused when it is larger than :data:`MAX_CHARS`, and counted as work."""
    size = _size(value)
    if size > MAX_CHARS:
        raise TemplateBudget(f"a value of more than {MAX_CHARS:,} characters or items")
    _work(size)
    return value


def _work(n: int) -> None:
    _spent.work += n
    if _spent.work > MAX_WORK:
        raise TemplateBudget(_work_why())


def _work_why() -> str:
    return f"filters, methods and operators handled more than {MAX_WORK:,} characters or items"


def _work_deep(value: Any) -> int:
    """Count ``value``, nested items included, as work; its size."""
    size = _deep(value, MAX_WORK - _spent.work, _work_why())
    _work(size)
    return size


def _serializable(value: Any) -> None:
    """A list or a struct about to be written out as text (JSON, ``str``): refused before it
    is when its characters and items are over :data:`MAX_CHARS`."""
    if isinstance(value, list | tuple | dict):
        _deep(value, MAX_CHARS, f"a value of more than {MAX_CHARS:,} characters or items")


def _loop(iterable: Any):
    """Every ``for`` loop's iterable, counted against :data:`MAX_LOOP_ITERATIONS`."""
    for item in iterable:
        _spent.loops += 1
        if _spent.loops > MAX_LOOP_ITERATIONS:
            raise TemplateBudget(f"more than {MAX_LOOP_ITERATIONS:,} loop iterations")
        yield item


def _join_size(items: Sequence[Any], separator: Any) -> int:
    return sum(len(str(i)) for i in items) + max(len(items) - 1, 0) * len(str(separator))


def _replace_size(text: str, old: str, new: str, count: int | None = None) -> int:
    found = text.count(old) if old else len(text) + 1
    if count is not None and count >= 0:
        found = min(found, count)
    return len(text) + found * (len(new) - len(old))


#: Filters that apply a test or a filter named by their argument to each item (the argument's
#: cost paid once an item: ``select('in', other)``).
_PER_ITEM = frozenset({"select", "reject", "selectattr", "rejectattr", "map"})


def _refused_arguments(name: str, positional: int, keywords: set[str]) -> str | None:
    """Why a filter called with these arguments (besides its input) is refused, or None: the
    ones whose cost is not linear in their input."""
    if name == "tojson" and (positional or keywords):
        return "tojson takes no argument in a prompt template (indent= allocates at will)"
    if name == "sum" and (positional >= 2 or "start" in keywords):
        return "sum's start is not available in a prompt template (summing lists is quadratic)"
    return None


def _checked_filter(name: str, func):
    """A filter whose input (nested items included) and arguments count against
    :data:`MAX_WORK`, whose arguments are checked (:func:`_refused_arguments`, ``round``'s
    precision), and whose result is capped and counted (``join``, ``replace``, ``string`` and
    ``tojson`` checked before they allocate)."""
    from jinja2.sandbox import SecurityError
    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(func) is None else 1

    @functools.wraps(func)
    def checked(*args, **kwargs):
        value = args[skip] if len(args) > skip else None
        rest = args[skip + 1 :]
        why = _refused_arguments(name, len(rest), set(kwargs))
        if why is not None:
            raise SecurityError(why)
        if name == "round":
            precision = rest[0] if rest else kwargs.get("precision", 0)
            if not isinstance(precision, int) or abs(precision) > MAX_ROUND_DIGITS:
                raise TemplateBudget(f"round to more than {MAX_ROUND_DIGITS} digits")
        size = _work_deep(value)
        extra = _work_deep([*rest, *kwargs.values()]) if rest or kwargs else 0
        if name in _PER_ITEM:
            _work(_size(value) * extra)
        elif name == "trim" and rest:  # str.strip(chars) looks each character up in chars
            _work(size * _size(rest[0]))
        if name in ("tojson", "string", "join"):
            _serializable(value)
        if name == "join" and isinstance(value, list | tuple | str):
            separator = args[skip + 1] if len(args) > skip + 1 else kwargs.get("d", "")
            _cap_size(_join_size(value, separator))
        elif name == "replace" and isinstance(value, str) and len(args) > skip + 2:
            old, new = str(args[skip + 1]), str(args[skip + 2])
            count = args[skip + 3] if len(args) > skip + 3 else kwargs.get("count")
            _cap_size(_replace_size(value, old, new, count))
        return _cap(func(*args, **kwargs))

    return checked


def _cap_size(size: int) -> None:
    if size > MAX_CHARS:
        raise TemplateBudget(f"a value of more than {MAX_CHARS:,} characters or items")


def _finalize(value: Any) -> Any:
    """What a ``{{ ... }}`` prints: a list or a struct as JSON; a null or bytes refused."""
    if value is None:
        raise _NullValue()
    if isinstance(value, bytes | bytearray | memoryview):
        raise _Binary()
    if isinstance(value, list | tuple | dict):
        _serializable(value)
        return json.dumps(value, ensure_ascii=False, default=str)
    return value


@functools.cache
def _environment():
    from jinja2 import StrictUndefined, Undefined
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Sandbox(ImmutableSandboxedEnvironment):
        # checked before they allocate: 'x' * 10**9, a + b; ** is refused when compiled,
        # and % on text (printf formatting with a width)
        intercepted_binops = frozenset({"*", "+", "%", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**":
                raise SecurityError("the ** operator is not available in a prompt template")
            if operator == "%" and isinstance(left, str):
                raise SecurityError("% formatting of text is not available in a prompt template")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(n, int):
                        _cap_size(len(seq) * max(n, 0))
                if isinstance(left, int) and isinstance(right, int):
                    if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                        raise TemplateBudget(f"an integer of more than {MAX_INT_BITS:,} bits")
            if operator == "+":
                _cap_size(_size(left) + _size(right))
            return _cap(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja2's own names)
            if __obj is _loop or __obj is _cap:  # the hooks: counted where they run
                return super().call(__context, __obj, *args, **kwargs)
            owner = getattr(__obj, "__self__", None)
            name = getattr(__obj, "__name__", "")
            allowed = (
                __obj is _GLOBALS["range"]
                or __obj is dict
                or (isinstance(owner, LoopContext) and name in ("cycle", "changed"))
                or (isinstance(owner, str | list | tuple | dict) and name in METHODS)
            )
            if isinstance(__obj, Undefined):  # an unsafe or missing attribute: its own error
                __obj._fail_with_undefined_error()
            if not allowed:
                raise SecurityError(f"calling {name or type(__obj).__name__!r} is not available")
            if isinstance(owner, str | list | tuple | dict):
                size = _work_deep(owner)
                _work_deep([*args, *kwargs.values()])
                if name in ("strip", "lstrip", "rstrip") and args and args[0] is not None:
                    _work(size * _size(args[0]))  # each character looked up in the argument
                if name == "join":
                    items = list(args[0]) if args else []
                    _cap_size(_join_size(items, owner))
                    args = (items,)
                elif name == "replace" and isinstance(owner, str) and len(args) >= 2:
                    _cap_size(_replace_size(owner, str(args[0]), str(args[1]), *args[2:3]))
            return _cap(super().call(__context, __obj, *args, **kwargs))

    env = Sandbox(undefined=StrictUndefined, autoescape=False, finalize=_finalize, keep_trailing_newline=True)
    env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items() if name in FILTERS}
    for name in _REFUSED_GLOBALS:
        env.globals.pop(name, None)
    env.globals[_HOOK_LOOP] = _loop
    env.globals[_HOOK_CAP] = _cap
    _GLOBALS.update(env.globals)
    return env


_GLOBALS: dict[str, Any] = {}


class _Compiled:
    """One template, compiled: what it renders and the columns it reads."""

    def __init__(self, source: str, key: str):
        from jinja2 import TemplateSyntaxError, meta, nodes

        env = _environment()
        try:
            tree = env.parse(source)
        except TemplateSyntaxError as exc:
            raise SpecError(key, f"not a valid Jinja2 template: line {exc.lineno}: {exc.message}") from exc
        _refuse(tree, key)
        self.columns = frozenset(meta.find_undeclared_variables(tree) - set(env.globals))
        #: the columns it reads without a guard (``is defined``, ``default``): those an input
        #: must have
        self.required = frozenset(meta.find_undeclared_variables(_unguarded(env.parse(source), nodes)))
        self.required &= self.columns
        # every loop's iterable counted, every concatenation capped
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(_HOOK_LOOP, "load"), [loop.iter], [], None, None)
        _wrap_concat(tree, nodes)
        try:
            self.template = env.from_string(tree)
        except TemplateSyntaxError as exc:  # an unknown filter or test
            raise SpecError(key, f"not a valid prompt template: line {exc.lineno}: {exc.message}") from exc
        self.source = source

    def render(self, variables: dict[str, Any]) -> str:
        template = self.template
        context = template.new_context(variables)
        out: list[str] = []
        size = 0
        for chunk in template.root_render_func(context):
            size += len(chunk)
            if size > MAX_CHARS:
                raise TemplateBudget(f"it renders more than {MAX_CHARS:,} characters")
            out.append(chunk)
        return "".join(out)


def _wrap_concat(tree, nodes) -> None:
    """``a ~ b`` becomes a capped value (a Concat node inside the cap hook's call)."""
    for node in list(tree.find_all(nodes.Node)):
        for field in node.fields:
            value = getattr(node, field, None)
            if isinstance(value, nodes.Concat):
                setattr(node, field, _capped(value, nodes))
            elif isinstance(value, list):
                setattr(node, field, [_capped(v, nodes) if isinstance(v, nodes.Concat) else v for v in value])


def _defined(test, nodes, when: bool) -> set[str]:
    """The names ``test`` proves defined when it evaluates to ``when``: ``x is defined``,
    ``x is not defined`` (false), ``not``, and ``and`` (true) or ``or`` (false) of those."""
    if (
        isinstance(test, nodes.Test)
        and test.name in ("defined", "undefined")
        and isinstance(test.node, nodes.Name)
    ):
        return {test.node.name} if (test.name == "defined") == when else set()
    if isinstance(test, nodes.Not):
        return _defined(test.node, nodes, not when)
    if (isinstance(test, nodes.And) and when) or (isinstance(test, nodes.Or) and not when):
        return _defined(test.left, nodes, when) | _defined(test.right, nodes, when)
    return set()


def _unguarded(tree, nodes):
    """``tree`` (a parse of its own, changed in place) with every guarded read of a name made
    a constant, so that the names it still reads are the ones it reads without a guard: the
    input of ``default``/``d``, the operand of ``is defined``/``is undefined``, and a name read
    where an ``if``, an ``x if ... else y``, an ``and`` or an ``or`` has tested it defined.
    A read under a test that does not prove the name defined (``{% if x is defined or y %}``)
    stays unguarded."""
    for node in list(tree.find_all(nodes.Node)):
        if isinstance(node, nodes.If):
            _blank(node, ("body",), _defined(node.test, nodes, True), nodes)
            _blank(node, ("elif_", "else_"), _defined(node.test, nodes, False), nodes)
        elif isinstance(node, nodes.CondExpr):
            _blank(node, ("expr1",), _defined(node.test, nodes, True), nodes)
            _blank(node, ("expr2",), _defined(node.test, nodes, False), nodes)
        elif isinstance(node, nodes.And):
            _blank(node, ("right",), _defined(node.left, nodes, True), nodes)
        elif isinstance(node, nodes.Or):
            _blank(node, ("right",), _defined(node.left, nodes, False), nodes)
        elif isinstance(node, nodes.Filter) and node.name in ("default", "d"):
            _blank(node, ("node",), {node.node.name} if isinstance(node.node, nodes.Name) else set(), nodes)
        elif isinstance(node, nodes.Test) and node.name in ("defined", "undefined"):
            _blank(node, ("node",), {node.node.name} if isinstance(node.node, nodes.Name) else set(), nodes)
    return tree


def _blank(node, fields, names: set[str], nodes) -> None:
    """Each read of one of ``names`` under ``node``'s ``fields`` made a constant."""
    if not names:
        return

    def swap(value):
        if isinstance(value, nodes.Name) and value.ctx == "load" and value.name in names:
            return nodes.Const(None, lineno=value.lineno)
        return value

    todo = [(node, fields)]
    while todo:
        parent, names_of = todo.pop()
        for field in names_of:
            value = getattr(parent, field, None)
            if isinstance(value, list):
                value = [swap(v) for v in value]
                children = value
            else:
                value = swap(value)
                children = [value]
            setattr(parent, field, value)
            todo.extend((c, c.fields) for c in children if isinstance(c, nodes.Node))


def _capped(node, nodes):
    call = nodes.Call(nodes.Name(_HOOK_CAP, "load"), [node], [], None, None)
    call.set_lineno(node.lineno)
    return call


def _refuse(tree, key: str) -> None:
    """Refuse what no bound can make safe, naming the line (exit 2)."""
    from jinja2 import nodes

    def refuse(node, why: str):
        raise SpecError(key, f"line {node.lineno}: {why}")

    for node in tree.find_all(nodes.Node):
        if isinstance(node, nodes.Macro | nodes.CallBlock):
            refuse(node, "macros and {% call %} are not available in a prompt template")
        if isinstance(node, nodes.Include | nodes.Import | nodes.FromImport | nodes.Extends):
            refuse(node, "a prompt template cannot include, import or extend another template")
        if isinstance(node, nodes.For) and node.recursive:
            refuse(node, "recursive loops are not available in a prompt template")
        if isinstance(node, nodes.Pow):
            refuse(node, "the ** operator is not available in a prompt template")
        if isinstance(node, nodes.Getattr) and node.attr.startswith("__"):
            refuse(
                node, f"attribute {node.attr!r} is not available: a template reads columns and their fields"
            )
        if (
            isinstance(node, nodes.Getitem)
            and isinstance(node.arg, nodes.Const)
            and isinstance(node.arg.value, str)
            and node.arg.value.startswith("__")
        ):
            refuse(
                node, f"item {node.arg.value!r} is not available: a template reads columns and their fields"
            )
        if isinstance(node, nodes.Name) and (
            node.name in _REFUSED_GLOBALS or node.name.startswith("__batchspec")
        ):
            refuse(node, f"{node.name!r} is not available in a prompt template")
        if isinstance(node, nodes.Filter) and node.name not in FILTERS:
            refuse(
                node,
                f"filter {node.name!r} is not available in a prompt template "
                f"(filters: {', '.join(sorted(FILTERS))})",
            )
        if isinstance(node, nodes.Filter):
            name, args = node.name, node.args
            if name == "map" and args and isinstance(args[0], nodes.Const):  # map('tojson', 4)
                name, args = args[0].value, args[1:]
                if name not in FILTERS:
                    refuse(node, f"filter {name!r} is not available in a prompt template")
            why = _refused_arguments(name, len(args), {k.key for k in node.kwargs})
            if why is None and name == "round":
                precision = (
                    args[0] if args else next((k.value for k in node.kwargs if k.key == "precision"), None)
                )
                if (
                    isinstance(precision, nodes.Const)
                    and isinstance(precision.value, int)
                    and abs(precision.value) > MAX_ROUND_DIGITS
                ):
                    why = f"round to more than {MAX_ROUND_DIGITS} digits is not available"
            if why is not None:
                refuse(node, why)


@functools.lru_cache(maxsize=64)
def _compiled(source: str, key: str) -> _Compiled:
    return _Compiled(source, key)


#: A Jinja2 message about a name that is not there.
_UNDEFINED = re.compile(r"^'([^']*)' is undefined$")


class PromptTemplate:
    """The job's template (``input.prompt_template`` or ``input.messages_template``), compiled
    (a bad one is a :class:`~batchspec.errors.SpecError` naming its key), and rendered per row."""

    def __init__(self, prompt: str | None, messages: Sequence[Mapping[str, str]] | None):
        self.messages = messages is not None
        if prompt is not None:
            self.parts = [(None, _compiled(prompt, "input.prompt_template"))]
        else:
            self.parts = [
                (m["role"], _compiled(m["content"], f"input.messages_template[{i}].content"))
                for i, m in enumerate(messages or ())
            ]
        #: The columns the template reads (its undeclared names), in a stable order.
        self.columns: tuple[str, ...] = tuple(sorted(set().union(*(c.columns for _, c in self.parts))))
        #: Those it reads without a guard (``is defined``, ``default``): an input must have them.
        self.required: tuple[str, ...] = tuple(sorted(set().union(*(c.required for _, c in self.parts))))

    def render(self, values: Mapping[str, Any]) -> tuple[str | list[dict[str, str]] | None, str | None]:
        """(the prompt or the messages, None) or (None, why not): the row's error, naming the
        column where one is at fault. Never raises."""
        variables = {}
        for column in self.columns:
            value = values.get(column)
            if isinstance(value, bytes | bytearray):
                return None, f"binary cell in column {column!r}: a template renders text"
            if value is not None:
                variables[column] = value
        _spent.loops = _spent.work = 0
        _spent.sizes = {}
        try:
            if not self.messages:
                return self.parts[0][1].render(variables), None
            return [{"role": role, "content": c.render(variables)} for role, c in self.parts], None
        except Exception as exc:  # noqa: BLE001 (whatever one row's render raises is its error)
            return None, self._why(exc, values)
        finally:
            _spent.sizes = {}

    def fill(self, row, values: Mapping[str, Any], where: str = "") -> None:
        """Render the row's prompt or messages from its ``values`` (column -> value) into
        ``row`` (a :class:`~batchspec.io.rows.Row`), or set its error (its first one kept;
        ``where`` is added to the message: ``: line 4``)."""
        rendered, why = self.render(values)
        if why is None:
            if self.messages:
                row.messages = rendered
                why = check_messages(rendered)
            else:
                row.prompt = rendered
                why = None if rendered.strip() else "empty prompt: the template renders only whitespace"
        if why is not None and row.error is None:
            row.error = why + where

    def _why(self, exc: Exception, values: Mapping[str, Any]) -> str:
        from jinja2 import UndefinedError
        from jinja2.sandbox import SecurityError

        if isinstance(exc, UndefinedError):
            match = _UNDEFINED.match(str(exc))
            if match and match.group(1) in self.columns and values.get(match.group(1)) is None:
                return f"null cell in column {match.group(1)!r}: the template gives it no default"
            return f"template error: {_short(exc)}"
        if isinstance(exc, SecurityError):
            return f"template refused: {_short(exc)}"
        if isinstance(exc, TemplateBudget):
            return f"template too costly: {exc}"
        if isinstance(exc, _NullValue):
            return "template error: it prints a null value (a null field or item; give it a default)"
        if isinstance(exc, _Binary):
            return "template error: it prints binary data"
        return f"template error: {type(exc).__name__}: {_short(exc)}"


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


def prompt_template(spec) -> PromptTemplate | None:
    """The input spec's template, compiled; None when prompts come from a column."""
    if spec.prompt_template is None and spec.messages_template is None:
        return None
    return PromptTemplate(spec.prompt_template, spec.messages_template)


def check_columns(template: PromptTemplate, names, url: str) -> None:
    """Exit 2 naming the first column the template reads without a guard that the shard lacks
    (:attr:`PromptTemplate.required`); one it guards may be missing."""
    have = set(names)
    for column in template.required:
        if column not in have:
            raise SpecError(
                "input.prompt_template" if not template.messages else "input.messages_template",
                f"the template reads column {column!r}, which {url} does not have "
                f"(columns: {', '.join(sorted(have)) or 'none'})",
            )
