"""Chat templates (Jinja, from the model file) rendered in a sandbox, with a budget per render.

A template comes with the model file, so it is untrusted code. jinja2's sandbox already keeps it
away from Python's internals; `BudgetedSandbox` also bounds what one render may spend:

- time and steps: every loop iteration (`{% for %}`, also `loop(...)` in recursive loops), call,
  attribute or item lookup, operator and filter spends from a `RenderBudget`, and the render stops
  when its iterations or its seconds run out;
- memory: a value is never allowed to grow past `value_size` characters or items. Operations that
  can grow a value in one step (`*`, `**`, `+`, `%`, `str.replace`, `join`, `format`, `indent`,
  padding widths) are checked before they run; every value coming back from a call, lookup or
  filter is checked after; the output is counted as it is produced;
- recursion: calls (macros included) nest at most `call_depth` deep;
- `{% include %}`, `{% import %}` and `{% extends %}` find no other template.

Any failure, budget or not, is a `ChatTemplateError` (one line; the server answers it with 400).

Why counting inside the sandbox rather than a timeout around the render: a Python thread cannot be
stopped, so a template that loops forever would keep its thread, a core and its memory after the
timeout fired, and a process per render would cost milliseconds and a copy of the state it needs.
The checks run in the render's own thread, so there is nothing to clean up. Loops are counted by
compiling each `{% for %}` over `environment.count_iterations(...)` (jinja's `code_generator_class`),
since a loop over a plain list passes no other hook. What stays unbounded is a single C-level call on
capped inputs that none of the checks above foresees; the caps keep its inputs small.
"""

from __future__ import annotations

import functools
import json
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import BaseLoader, TemplateError, nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import loopcontrols
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from powerinfer.chat_formats import CHATML
from powerinfer.errors import ChatTemplateError

MAX_INT_BITS = 4096  # integers a template computes with (and 4300 digits is Python's str() limit)
MAX_JSON_INDENT = 64


@dataclass(frozen=True)
class RenderBudget:
    """What one render may spend."""

    seconds: float = 2.0
    iterations: int = 250_000  # loop iterations, all loops together
    value_size: int = 1_000_000  # characters of a string, items of a list (also the largest integer argument)
    output_chars: int = 4_000_000
    call_depth: int = 64


class _Spending:
    """One render's account: what is left of its budget."""

    def __init__(self, budget: RenderBudget):
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds
        self.iterations = budget.iterations
        self.depth = 0

    def step(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template: rendering took more than {self.budget.seconds:g} s")

    def iteration(self) -> None:
        self.iterations -= 1
        if self.iterations < 0:
            raise ChatTemplateError(f"chat template: more than {self.budget.iterations} loop iterations")
        self.step()


_spending: ContextVar[_Spending] = ContextVar("chat_template_spending")


def _account() -> _Spending:
    """The running render's account (compiling, which folds constants, gets a fresh one)."""
    try:
        return _spending.get()
    except LookupError:
        return _Spending(RenderBudget())


def _too_big(what: str) -> ChatTemplateError:
    return ChatTemplateError(f"chat template: {what} exceeds the render budget")


def _check_size(value: Any) -> Any:
    """`value`, if it is not larger than a template may hold."""
    limit = _account().budget.value_size
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) and len(value) > limit:
        raise _too_big(f"a {type(value).__name__} of {len(value)} items")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _too_big(f"an integer of {value.bit_length()} bits")
    return value


def _check_arguments(args: Iterable[Any]) -> None:
    """Integer arguments beyond `value_size` only serve to build huge values (widths, counts)."""
    limit = _account().budget.value_size
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > limit:
            raise _too_big(f"the number {arg}")


def _check_format(template: str, args: Iterable[Any]) -> None:
    """A %- or {}-format string whose widths or precisions are beyond `value_size`."""
    limit = _account().budget.value_size
    if any(int(digits) > limit for digits in re.findall(r"\d{7,}", template)):
        raise _too_big("a width in a format string")
    _check_arguments(args)


def _check_str_format(template: str, args: tuple, kwargs: dict) -> None:
    """`template.format(...)`: literal widths and integer arguments checked; a width taken from an
    argument (`{:{w}}`, `{:{0[1]}}`) could hide anywhere in them, so templates may not nest fields."""
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(template) if spec]
    except ValueError:
        return  # malformed: str.format raises it itself
    if any("{" in spec for spec in specs):
        raise ChatTemplateError("chat template: nested fields in a format specification are not allowed")
    _check_format(template, [*args, *kwargs.values()])


def _check_growth(result_size: int) -> None:
    if result_size > _account().budget.value_size:
        raise _too_big(f"a result of {result_size} items")


def _replaced_size(text: Any, old: Any, new: Any, count: Any = None) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        found = text.count(old) if old else len(text) + 1
        found = min(found, count) if isinstance(count, int) and count >= 0 else found
        _check_growth(len(text) + found * (len(new) - len(old)))


def _joined_size(separator: Any, items: Any) -> None:
    if isinstance(separator, str) and isinstance(items, (list, tuple)):
        _check_growth(len(separator) * len(items) + sum(len(i) for i in items if isinstance(i, str)))


def _indented_size(text: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    if isinstance(text, str):
        spaces = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
        _check_growth(len(text) + (text.count("\n") + 1) * spaces)


def _check_string_method(method: Any, args: tuple, kwargs: dict) -> None:
    """Pre-checks for the `str` methods whose result can outgrow their inputs many times over."""
    text, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(text, str):
        return
    if name == "replace":
        _replaced_size(text, *args, **kwargs)
    elif name == "join" and args:
        _joined_size(text, list(args[0]) if isinstance(args[0], (list, tuple)) else args[0])
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _check_growth(len(text) + text.count("\t") * tab)


class _CountedIterable:
    """An iterable whose every item spends one iteration of the render's budget."""

    def __init__(self, iterable: Iterable[Any]):
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        account = _account()
        for item in self.iterable:
            account.iteration()
            yield item

    def __len__(self) -> int:
        return len(self.iterable)  # a TypeError makes LoopContext count by consuming, as for any iterator


class _CountingCodeGenerator(CodeGenerator):
    """Compiles `{% for x in EXPR %}` as `{% for x in environment.count_iterations(EXPR) %}`."""

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        counted = nodes.Call(nodes.EnvironmentAttribute("count_iterations"), [node.iter], [], None, None)
        super().visit_For(nodes.For(node.target, counted.set_lineno(node.lineno), node.body, node.else_,
                                    node.test, node.recursive).set_lineno(node.lineno), frame)


class _NoOtherTemplates(BaseLoader):
    def get_source(self, environment: Any, template: str):
        raise TemplateError(f"a chat template cannot include, import or extend another template ({template!r})")


def _check_sum(values: Any, attribute: Any = None, start: Any = 0) -> None:
    if not isinstance(start, (int, float)):  # adding lists or strings one by one is quadratic
        raise ChatTemplateError("chat template: the sum filter adds numbers only here")


def _check_formatted(text: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(text, str):
        _check_format(text, [*args, *kwargs.values()])


def _check_json_indent(value: Any, ensure_ascii: Any = False, indent: Any = None, *_: Any, **__: Any) -> None:
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:  # repeated on every line, at every depth
        raise _too_big(f"a JSON indent of {indent}")


# Pre-checks of the built-in filters that can build a value much larger than their inputs (their
# arguments after the filtered value, as jinja passes them).
_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "replace": _replaced_size,
    "join": lambda items, separator="", *_, **__: _joined_size(separator, items),
    "indent": _indented_size,
    "format": _check_formatted,
    "sum": _check_sum,
    "tojson": _check_json_indent,
}


def _guarded_filter(name: str, function: Callable) -> Callable:
    """A built-in filter behind the budget: arguments checked before, the result after."""
    passes_context = getattr(function, "jinja_pass_arg", None) is not None  # jinja's pass_context & co.
    check = _FILTER_CHECKS.get(name)

    @functools.wraps(function)  # keeps the pass_context / pass_environment mark
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _account().step()
        values = args[1:] if passes_context else args  # the filtered value, then the filter's arguments
        _check_arguments([*values[1:], *kwargs.values()])
        if check is not None and values:
            check(*values, **kwargs)
        return _check_size(function(*args, **kwargs))

    return guarded


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """JSON as model templates expect it: jinja's own `tojson` escapes <, > and & for HTML."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise TemplateError(message)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with a budget per render (see the module's docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})  # also stops them from being folded at compile time
    code_generator_class = _CountingCodeGenerator

    def __init__(self) -> None:
        # as transformers renders chat templates: trimmed blocks, {% break %}/{% continue %}, its tojson
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], loader=_NoOtherTemplates())
        self.filters["tojson"] = _tojson
        self.filters = {name: _guarded_filter(name, f) for name, f in self.filters.items()}
        del self.globals["lipsum"]  # lipsum(n=...) writes paragraphs by the thousand; no chat template needs it
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    @staticmethod
    def count_iterations(iterable: Iterable[Any]) -> _CountedIterable:
        return _CountedIterable(iterable)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """jinja's sandboxed `str.format`/`format_map`, with the format string checked first."""
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None
        template = value.__self__

        @functools.wraps(sandboxed)
        def checked(*args: Any, **kwargs: Any) -> str:
            _check_str_format(template, args, kwargs)
            return sandboxed(*args, **kwargs)

        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's naming)
        account = _account()
        account.step()
        _check_arguments([*args, *kwargs.values()])
        _check_string_method(__obj, args, kwargs)
        if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop iterates them too
            args = (_CountedIterable(args[0]), *args[1:])
        if account.depth >= account.budget.call_depth:
            raise ChatTemplateError(f"chat template: calls nested deeper than {account.budget.call_depth}")
        account.depth += 1
        try:
            return _check_size(super().call(__context, __obj, *args, **kwargs))
        finally:
            account.depth -= 1

    def getattr(self, obj: Any, attribute: str) -> Any:
        _account().step()
        return _check_size(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        _account().step()
        return _check_size(super().getitem(obj, argument))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _account().step()
        sizes = [len(v) for v in (left, right) if isinstance(v, (str, bytes, list, tuple))]
        numbers = [v for v in (left, right) if isinstance(v, int)]
        if operator == "*" and len(sizes) == 1 and len(numbers) == 1:
            _check_growth(sizes[0] * max(numbers[0], 0))
        elif operator == "*" and len(numbers) == 2 and sum(n.bit_length() for n in numbers) > MAX_INT_BITS:
            raise _too_big("a product")
        elif operator == "**" and len(numbers) == 2 and right > 0 and left.bit_length() * right > MAX_INT_BITS:
            raise _too_big("a power")
        elif operator == "+" and len(sizes) == 2:
            _check_growth(sum(sizes))
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right if isinstance(right, (tuple, list)) else [right])
        return _check_size(super().call_binop(context, operator, left, right))


@contextmanager
def _budget_scope(budget: RenderBudget) -> Iterator[_Spending]:
    token = _spending.set(_Spending(budget))
    try:
        yield _spending.get()
    finally:
        _spending.reset(token)


def _describe(error: Exception) -> str:
    """One line for whatever a template raised (its own raise_exception message as it is)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, TemplateError) else f"{type(error).__name__}: {text}"


class ChatTemplate:
    """A compiled chat template; `render` raises `ChatTemplateError` for anything that goes wrong."""

    def __init__(self, source: str | None, budget: RenderBudget = RenderBudget()):
        self.budget = budget
        with _budget_scope(budget):
            try:
                self._template = BudgetedSandbox().from_string(source or CHATML)
            except ChatTemplateError:
                raise
            except Exception as error:  # a template is data: whatever breaks while compiling it is its fault
                raise ChatTemplateError(f"the model's chat template does not parse: {_describe(error)}") from None

    def render(self, **variables: Any) -> str:
        with _budget_scope(self.budget) as account:
            pieces, produced = [], 0
            try:
                for piece in self._template.generate(**variables):
                    produced += len(piece)
                    if produced > self.budget.output_chars:
                        raise _too_big(f"an output of more than {self.budget.output_chars} characters")
                    account.step()
                    pieces.append(piece)
            except ChatTemplateError:
                raise
            except Exception as error:  # a template is code from the model file: any failure is its own
                raise ChatTemplateError(f"chat template: {_describe(error)}") from None
            return "".join(pieces)
