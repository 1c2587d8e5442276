"""Prompts rendered from templates over a row's columns: ``input.prompt_template`` (a text
prompt), ``input.messages_template`` (chat messages, each ``content`` a template) and
``input.pair_templates`` (``task: score``: each text of a pair).

A template is Jinja2, compiled once and rendered for each row as the reader turns a record
batch's rows into :class:`~batchspec.io.rows.Row` objects, in Jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` (no attribute of Python's internals, no
mutation), with :class:`~jinja2.StrictUndefined` (a name that is not there fails) and no
autoescaping. The row's columns are its variables; a null cell is left out, so it fails as an
undefined name unless the template gives a default (``{{ x | default('n/a') }}``,
``{% if x is defined %}``). An input must have the columns the template reads without such a
guard (:attr:`PromptTemplate.required`, found on the template's syntax tree by
:func:`_unguarded`); one it guards may be missing.

``x.name`` and ``x['name']`` read data, never a method: a struct's field (``meta.items`` is the
field named ``items``, not ``dict.items``), an item, the loop's ``loop.index``; text has no
fields. A method is only called (``body.strip()``, ``meta.get('k')``).

A template cannot cost more than its bounds, whatever the row holds:

- refused when the job is checked (exit 2, naming the key and the line): syntax errors, tags
  and expressions nested more than :data:`~batchspec.io.template_bounds.MAX_NESTING` deep,
  macros and ``{% call %}``, ``include``/``import``/``extends``, recursive loops, the ``**``
  operator, a dunder attribute (``x.__class__``), the globals ``lipsum``, ``cycler``, ``joiner``
  and ``namespace``, every filter but :data:`FILTERS` (``map('name')`` included), and the
  filter arguments whose cost is not linear: ``tojson``'s indent, ``sum``'s start (summing
  lists), ``round`` to more than ``MAX_ROUND_DIGITS`` digits (checked again when a filter is
  named at render: ``map(f, ...)``);
- bounded when a row renders (the row's error when exceeded), by
  :mod:`batchspec.io.template_bounds`: ``MAX_LOOP_ITERATIONS`` loop iterations in all,
  ``MAX_CHARS`` characters (or items) for the output and for any value computed on the way
  (a ``{% set %}`` block's body included), ``MAX_INT_BITS`` bits for an integer ``*`` builds,
  and ``MAX_WORK``: every operation whose cost grows with a value's size counts it, so that a
  row over it is its error within about a second. Only the methods of :data:`METHODS` may be
  called (``x.upper()``; not ``'{}'.format``).

A list or a struct printed as it is (``{{ labels }}``) renders as JSON; a null printed from
inside one (a struct's null field), a binary value or a function is the row's error."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from batchspec.errors import SpecError
from batchspec.io import template_bounds as bounds
from batchspec.io.rows import check_messages
from batchspec.io.template_bounds import (
    MAX_CHARS,
    MAX_NESTING,
    MAX_ROUND_DIGITS,
    RenderStopped,
    TemplateBudget,
)

#: The filters a template may use: each takes time and space linear in its input and arguments
#: (what :func:`~batchspec.io.template_bounds.refused_arguments` refuses aside). Left out: those
#: with a width or count argument that allocates at will (center, indent, format, wordwrap,
#: batch, slice), random (a rerun would render other prompts), and the HTML ones (urlize,
#: xmlattr).
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
#: The hooks the compiled tree calls (a template cannot name them: :func:`_refuse`).
_HOOKS = {
    "__batchspec_loop": bounds.loop,
    "__batchspec_cap": bounds.cap,
    "__batchspec_counted": bounds.counted,
    "__batchspec_text": lambda value: bounds.as_text(_printable(value)),
    "__batchspec_method": lambda owner, name: _environment().method(owner, name),
}


class _NullValue(Exception):
    """A null printed from inside a list or a struct."""


class _Binary(Exception):
    """Binary data printed."""


class _Callable(Exception):
    """A function, a method or a class printed (``range``): never a prompt's text."""


def _printable(value: Any) -> Any:
    if callable(value):
        from jinja2 import Undefined

        if not isinstance(value, Undefined):  # which fails as itself when printed
            raise _Callable()
    return value


def _finalize(value: Any) -> Any:
    """What a ``{{ ... }}`` prints: a list or a struct as JSON; a null, bytes or a function
    refused."""
    if value is None:
        raise _NullValue()
    if isinstance(value, bytes | bytearray | memoryview):
        raise _Binary()
    if isinstance(value, list | tuple | dict):
        bounds.serializable(value)
        bounds.count_deep(value, per_item=bounds.ITEM_COST // 4)  # json.dumps: 100 ns or so an item
        return json.dumps(value, ensure_ascii=False, default=lambda v: str(_printable(v)))
    return _printable(value)


@functools.cache
def _environment():
    from jinja2 import StrictUndefined, Undefined, pass_environment
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    def data(env, owner, name, value):
        # a bound method is no value: read as a field, it is a field that is not there
        if callable(value) and not isinstance(value, Undefined):
            return env.undefined(obj=owner, name=name)
        return value

    class Sandbox(ImmutableSandboxedEnvironment):
        # checked before they run: 'x' * 10**9, a + b, big integers; ** is refused when
        # compiled, and % on text (printf formatting with a width)
        intercepted_binops = frozenset({"*", "+", "-", "/", "//", "%", "**"})
        concat = staticmethod(bounds.concat)  # a {% set %} or {% filter %} block's body

        def getattr(self, obj, attribute):
            if isinstance(obj, dict):  # a struct: its field, never one of dict's methods
                return obj[attribute] if attribute in obj else self.undefined(obj=obj, name=attribute)
            return data(self, obj, attribute, super().getattr(obj, attribute))

        def getitem(self, obj, argument):
            return data(self, obj, argument, super().getitem(obj, argument))

        def method(self, obj, name):
            """``obj.name`` about to be called: the method, as Jinja2 looks it up."""
            return super().getattr(obj, name)

        def call_binop(self, context, operator, left, right):
            if operator == "**":
                raise SecurityError("the ** operator is not available in a prompt template")
            if operator == "%" and isinstance(left, str):
                raise SecurityError("% formatting of text is not available in a prompt template")
            bounds.binop(operator, left, right)
            return bounds.cap(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja2's own names)
            if id(__obj) in _HOOK_IDS:  # counted where they run; Jinja2's own call costs more
                return __obj(*args)
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
            bounds.work(bounds.CALL_COST)
            bounds.count_deep([*args, *kwargs.values()])
            if isinstance(owner, str | list | tuple | dict):
                args = bounds.method_call(name, owner, args)
            return bounds.cap(super().call(__context, __obj, *args, **kwargs))

    @pass_environment
    def attr(env, obj, name):  # Jinja2's reads Python's attribute first: a dict's method
        return env.getattr(obj, str(name))

    env = Sandbox(undefined=StrictUndefined, autoescape=False, finalize=_finalize, keep_trailing_newline=True)
    env.filters["attr"] = attr
    env.filters = {n: bounds.checked_filter(n, f) for n, f in env.filters.items() if n in FILTERS}
    env.tests = {n: bounds.checked_test(f) for n, f in env.tests.items()}
    for name in _REFUSED_GLOBALS:
        env.globals.pop(name, None)
    env.globals.update(_HOOKS)
    _GLOBALS.update(env.globals)
    return env


_GLOBALS: dict[str, Any] = {}
_HOOK_IDS = frozenset(map(id, _HOOKS.values()))


class _Compiled:
    """One template, compiled: what it renders and the columns it reads."""

    def __init__(self, source: str, key: str):
        from jinja2 import TemplateSyntaxError

        try:
            self._compile(source, key)
        except TemplateSyntaxError as exc:  # an unknown filter or test
            raise SpecError(key, f"not a valid prompt template: line {exc.lineno}: {exc.message}") from exc
        except (RecursionError, SyntaxError) as exc:  # Jinja2's parser or Python's compiler
            raise SpecError(key, f"nested too deeply to compile: {_short(exc)}") from None
        self.source = source

    def _compile(self, source: str, key: str) -> None:
        from jinja2 import TemplateSyntaxError, meta, nodes

        env = _environment()
        try:
            tree = env.parse(source)
        except TemplateSyntaxError as exc:
            raise SpecError(key, f"not a valid Jinja2 template: line {exc.lineno}: {exc.message}") from exc
        line = bounds.too_deep(tree)
        if line is not None:
            raise SpecError(key, f"line {line}: nested too deeply: more than {MAX_NESTING} levels")
        _refuse(tree, key)
        self.columns = frozenset(meta.find_undeclared_variables(tree) - set(env.globals))
        #: the columns it reads without a guard (``is defined``, ``default``): those an input
        #: must have
        self.required = frozenset(meta.find_undeclared_variables(_unguarded(env.parse(source), nodes)))
        self.required &= self.columns
        _add_hooks(tree, nodes)
        self.template = env.from_string(tree)

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


def _add_hooks(tree, nodes) -> None:
    """Make the tree call the bounds: each loop's iterable counted (its body's weight each
    iteration), each comparison's operands, a slice's copy and ``a ~ b`` capped, the operands of
    ``~`` measured before they are written out as text, and ``x.name(...)`` a method call
    (any other ``x.name`` reads a field)."""

    def hook(name, node, *args):
        call = nodes.Call(nodes.Name(f"__batchspec_{name}", "load"), [node, *args], [], None, None)
        call.set_lineno(node.lineno)
        return call

    for node in list(tree.find_all(nodes.Compare)):
        node.expr = hook("counted", node.expr)
        for operand in node.ops:
            operand.expr = hook("counted", operand.expr)
    for node in list(tree.find_all(nodes.Concat)):
        node.nodes = [hook("text", n) for n in node.nodes]
    for node in list(tree.find_all(nodes.Call)):
        if isinstance(node.node, nodes.Getattr):
            node.node = hook("method", node.node.node, nodes.Const(node.node.attr))

    def swap(value):
        if isinstance(value, nodes.Concat) or (
            isinstance(value, nodes.Getitem) and isinstance(value.arg, nodes.Slice)
        ):
            return hook("cap", value)
        return value

    for node in list(tree.find_all(nodes.Node)):
        for field in node.fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                setattr(node, field, [swap(v) for v in value])
            elif isinstance(value, nodes.Node):
                setattr(node, field, swap(value))
    for loop in list(tree.find_all(nodes.For)):  # last: the hooks in its body weigh too
        loop.iter = hook("loop", loop.iter, nodes.Const(bounds.body_weight(loop, nodes)))


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
            why = bounds.refused_arguments(name, len(args), {k.key for k in node.kwargs})
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
    """The job's template (``input.prompt_template``, ``input.messages_template`` or
    ``input.pair_templates``), compiled (a bad one is a :class:`~batchspec.errors.SpecError`
    naming its key), and rendered per row."""

    def __init__(
        self,
        prompt: str | None,
        messages: Sequence[Mapping[str, str]] | None,
        pair: Sequence[str] | None = None,
    ):
        self.messages = messages is not None
        #: ``input.pair_templates``: a row's two texts, the query's and the document's
        self.pair = pair is not None
        #: the spec key it comes from, named where an input lacks a column it reads
        self.key = (
            "input.pair_templates"
            if self.pair
            else "input.messages_template"
            if self.messages
            else "input.prompt_template"
        )
        if pair is not None:
            self.parts = [(None, _compiled(t, f"input.pair_templates[{i}]")) for i, t in enumerate(pair)]
        elif prompt is not None:
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

    def render(
        self, values: Mapping[str, Any]
    ) -> tuple[str | list[dict[str, str]] | list[str] | None, str | None]:
        """(the prompt, the messages or a pair's two texts, None) or (None, why not): the row's
        error, naming the column where one is at fault. Never raises."""
        variables = {}
        for column in self.columns:
            value = values.get(column)
            if isinstance(value, bytes | bytearray):
                return None, f"binary cell in column {column!r}: a template renders text"
            if value is not None:
                variables[column] = value
        bounds.begin_row()
        try:
            if self.pair:
                return [c.render(variables) for _, c in self.parts], None
            if not self.messages:
                return self.parts[0][1].render(variables), None
            return [{"role": role, "content": c.render(variables)} for role, c in self.parts], None
        except Exception as exc:  # noqa: BLE001 (whatever one row's render raises is its error)
            return None, self._why(exc, values)
        finally:
            bounds.end_row()

    def fill(self, row, values: Mapping[str, Any], where: str = "") -> None:
        """Render the row's prompt or messages from its ``values`` (column -> value) into
        ``row`` (a :class:`~batchspec.io.rows.Row`), or set its error (its first one kept;
        ``where`` is added to the message: ``: line 4``)."""
        rendered, why = self.render(values)
        if why is None:
            if self.pair:
                row.prompt, row.pair = rendered
                side = next((i for i, text in enumerate(rendered) if not text.strip()), None)
                if side is not None:
                    why = f"empty pair text: input.pair_templates[{side}] renders only whitespace"
            elif self.messages:
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
        if isinstance(exc, RenderStopped):
            return "template not rendered: the run is stopping"
        if isinstance(exc, _NullValue):
            return "template error: it prints a null value (a null field or item; give it a default)"
        if isinstance(exc, _Binary):
            return "template error: it prints binary data"
        if isinstance(exc, _Callable):
            return "template error: it prints a function or a method (a method is to be called)"
        return f"template error: {type(exc).__name__}: {_short(exc)}"


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


def prompt_template(spec) -> PromptTemplate | None:
    """The input spec's template, compiled; None when prompts come from a column."""
    if not spec.templated:
        return None
    return PromptTemplate(spec.prompt_template, spec.messages_template, spec.pair_templates)


def check_columns(template: PromptTemplate, names, url: str) -> None:
    """Exit 2 naming the first column the template reads without a guard that the shard lacks
    (:attr:`PromptTemplate.required`); one it guards may be missing."""
    have = set(names)
    for column in template.required:
        if column not in have:
            raise SpecError(
                template.key,
                f"the template reads column {column!r}, which {url} does not have "
                f"(columns: {', '.join(sorted(have)) or 'none'})",
            )
