"""The built-in `calculator` tool: arithmetic on numbers, read with Python's `ast` and never evaluated as code.

Allowed: int and float literals, + - * / // % **, parentheses, unary + and -. Anything else (names, calls,
attributes, strings, comparisons) is refused with a message the model can act on. Sizes are bounded so that no
expression can take long or use much memory: integers stay under MAX_INT_BITS bits, a power's result is estimated
before it is computed.
"""
from __future__ import annotations

import ast
import math
import operator

from grpo.tools.registry import register_tool

MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 1024        # about 308 decimal digits
MAX_EXPONENT = 10_000      # |exponent| of a float power (ints are bounded by their result's size)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError saying what is not allowed or went wrong."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({getattr(exc, 'msg', exc)})") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"only numbers are allowed, not {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("'^' is not a power here: write 2 ** 3 for 2 to the power 3")
    if isinstance(node, ast.Name):
        raise ValueError(f"names are not allowed ({node.id!r}); write the numbers themselves")
    if isinstance(node, ast.Call):
        raise ValueError("function calls are not allowed; use + - * / // % ** and parentheses")
    raise ValueError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")


def _check_power(base, exponent) -> None:
    """Refuse a power whose result would be huge, before computing it."""
    if isinstance(base, complex) or isinstance(exponent, complex):
        raise ValueError("complex results are not supported")
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent {exponent} is too large (at most {MAX_EXPONENT} in size)")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) > MAX_INT_BITS:
            raise ValueError(f"{base} ** {exponent} is too large (results stay under 2 ** {MAX_INT_BITS})")
    if base == 0 and exponent < 0:
        raise ValueError("division by zero (0 to a negative power)")
    if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
        raise ValueError("a negative number to a fractional power has no real value")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"the result is too large (integers stay under 2 ** {MAX_INT_BITS})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


def format_number(value: int | float) -> str:
    """Integers exactly; floats to 12 significant digits (0.1 + 0.2 -> 0.3), whole floats without '.0' (6 / 2 -> 3)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


@register_tool("calculator", timeout=5.0)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    return format_number(evaluate(expression))
