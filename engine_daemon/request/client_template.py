"""A chat template sent by the client (`chat_template_kwargs.chat_template`), rendered under a budget.

Off by default: a client's Jinja is code. With `--allow-request-chat-template` it is rendered
in Jinja's immutable sandbox (no attribute tricks, `range` capped by Jinja at 100,000) with
three budgets a template cannot escape: a count of executed template lines (a 200-byte
nested loop once froze every stream for 69 s), a wall-clock deadline, and a cap on the size
of any string or list it builds and on its output (`'x' * 400000000` once took 1.5 GB).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from types import FrameType
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine_daemon.errors import RequestError, describe

MAX_TEMPLATE_CHARS = 65536
MAX_OUTPUT_CHARS = 4_000_000
MAX_LINES_EXECUTED = 2_000_000
MAX_SECONDS = 2.0


class TemplateBudgetExceeded(TemplateError):
    pass


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with sequence repetition and concatenation bounded in size."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise TemplateBudgetExceeded("exponent too large")
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(count, int) \
                        and len(sequence) * count > MAX_OUTPUT_CHARS:
                    raise TemplateBudgetExceeded("a repeated string or list would be too long")
        if (operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple))
                and len(left) + len(right) > MAX_OUTPUT_CHARS):
            raise TemplateBudgetExceeded("a string or list would be too long")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> BudgetedSandbox:
    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@contextmanager
def _line_budget() -> Iterator[None]:
    """Counts executed Python lines in this thread (templates compile to Python) and stops the render
    when the count or the deadline runs out, wherever it is."""
    deadline = time.monotonic() + MAX_SECONDS
    executed = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal executed
        if event == "line":
            executed += 1
            if executed > MAX_LINES_EXECUTED or (executed % 4096 == 0 and time.monotonic() > deadline):
                raise TemplateBudgetExceeded("the template ran past its budget")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def render(template: Any, variables: dict[str, Any]) -> str:
    """The template's text for these variables, or RequestError when it fails or overruns a budget."""
    if not isinstance(template, str) or not template or len(template) > MAX_TEMPLATE_CHARS:
        raise RequestError(400, "invalid_value", f"'chat_template' must be a string of 1 to {MAX_TEMPLATE_CHARS} "
                           "characters", param="chat_template_kwargs")
    try:
        with _line_budget():
            compiled = _environment().from_string(template)
            out: list[str] = []
            size = 0
            for chunk in compiled.generate(**variables):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise TemplateBudgetExceeded("the rendered prompt is too long")
                out.append(chunk)
    except TemplateBudgetExceeded as exc:
        raise RequestError(400, "chat_template_budget_exceeded", f"The request's chat template was stopped: {exc}",
                           param="chat_template_kwargs") from None
    except Exception as exc:  # jinja's syntax and runtime errors, the sandbox's SecurityError
        raise RequestError(400, "invalid_chat_template", f"The request's chat template failed: {describe(exc)}",
                           param="chat_template_kwargs") from None
    return "".join(out)
