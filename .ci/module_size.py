"""The module-size rule of ``make lint``: no module of ``paramfsm/`` over 400 lines of code.

Lines of code are what is left without blank lines, comments and docstrings (of the module, classes and
functions). Notes and docstrings explain the code and are never squeezed out to meet the rule; a module
that grows past it is split by concept.

    python .ci/module_size.py [ROOT] [--limit N]

Prints each module over the limit with its count and exits 1 if there is one; ``--top K`` lists the K
largest modules instead.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

LIMIT = 400


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines of ``source`` that hold code: not blank, not only a comment, not part of a docstring."""
    skip = _docstring_lines(ast.parse(source))
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
            continue
        for line in range(token.start[0], token.end[0] + 1):
            if line not in skip:
                code.add(line)
    return len(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="paramfsm")
    parser.add_argument("--limit", type=int, default=LIMIT)
    parser.add_argument("--top", type=int, default=0, help="list the largest modules instead")
    args = parser.parse_args(argv)
    sizes = sorted(((code_lines(path.read_text()), str(path)) for path in Path(args.root).rglob("*.py")),
                   reverse=True)
    if args.top:
        for count, path in sizes[:args.top]:
            print(f"{count:5d}  {path}")
        return 0
    over = [(count, path) for count, path in sizes if count > args.limit]
    for count, path in over:
        print(f"{path}: {count} lines of code (over {args.limit}): split it by concept")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
