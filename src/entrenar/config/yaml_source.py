"""YAML text read with the line of every key, for errors that say where a value was written.

Shared by recipes and merge configs: ``read_yaml_text`` (bytes -> text), ``load_yaml`` (text -> value and its
node, every problem a one-line ConfigError naming the source, line and column), ``key_lines`` (the line of each
key, duplicate keys refused) and ``Where`` (a key -> "FILE line N", or the ``--set`` that replaced it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from entrenar.config.rules import _show
from entrenar.errors import ConfigError

_MAX_DEPTH = 32  # a recipe needs 4 levels (section, key, lr_scale pattern); PyYAML recurses once per level


class Where:
    """Maps a key path (``training.max_steps``, ``models[1].parameters.weight``) to where its value was written:
    a file line or a ``--set``. A key written nowhere is reported at the nearest key above it, else the source."""

    def __init__(self, source: str, lines: dict[str, int] | None = None) -> None:
        self.source = source
        self._marks = {key: f"{source} line {line}" for key, line in (lines or {}).items()}

    def set_by(self, key: str, label: str) -> None:
        """``key`` (and all below it) now comes from an override labelled ``label``."""
        for old in [k for k in self._marks if k == key or k.startswith((key + ".", key + "["))]:
            del self._marks[old]
        self._marks[key] = label

    def __call__(self, key: str) -> str:
        while key:
            mark = self._marks.get(key)
            if mark is not None:
                return mark
            cut = max(key.rfind("."), key.rfind("["))
            key = key[:cut] if cut > 0 else ""
        return self.source


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing nesting deeper than ``_MAX_DEPTH`` before its recursion can overflow."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self._depth >= _MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, f"nested more than {_MAX_DEPTH} levels deep", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_yaml_text(path: Path, what: str = "file") -> str:
    """A YAML file's text; unreadable or non-UTF-8 bytes are a ConfigError naming the file (and line)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path} line {line}: not UTF-8 text (byte 0x{data[e.start]:02X})") from None


def load_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """YAML text -> (value, its node), with every problem (control characters, nesting, a scalar Python cannot
    build, any PyYAML error) a one-line ConfigError naming ``source``, line and column."""
    try:
        return _load_yaml(text)
    except _YamlProblem as e:
        raise e.at(source) from None


def key_lines(node: yaml.Node | None, source: str, depth: int | None = None,
              sequences: bool = False) -> dict[str, int]:
    """The 1-based line of every mapping key under ``node``, by key path (``a.b``; with ``sequences``, list items
    too: ``a[0].b``), ``depth`` levels of mappings down at most (None: all); a duplicate key (YAML keeps the last)
    is a ConfigError naming both lines."""
    lines: dict[str, int] = {}
    _record_lines(node, source, "", lines, depth, sequences)
    return lines


def _record_lines(node: yaml.Node | None, source: str, path: str, lines: dict[str, int], depth: int | None,
                  sequences: bool) -> None:
    if depth == 0:
        return
    if isinstance(node, yaml.SequenceNode) and sequences:
        for i, item in enumerate(node.value):
            child = f"{path}[{i}]"
            lines[child] = item.start_mark.line + 1
            _record_lines(item, source, child, lines, depth, sequences)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key, line = f"{path}.{key_node.value}" if path else key_node.value, key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"{source} line {line}: duplicate key '{key}' (first at line {seen[key]})")
        seen[key] = lines[key] = line
        _record_lines(value_node, source, key, lines, None if depth is None else depth - 1, sequences)


class _YamlProblem(Exception):
    """What is wrong with a YAML text and where (1-based line and column, when known)."""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(problem)
        self.problem, self.line, self.column = problem, line, column

    def at(self, source: str) -> ConfigError:
        where = f" line {self.line}, column {self.column}" if self.line is not None else ""
        return ConfigError(f"{source}{where}: malformed YAML: {self.problem}")


def _load_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """YAML text -> (value, its node); any problem, PyYAML's or Python's, is a ``_YamlProblem``."""
    try:
        loader = _Loader(text)  # the reader refuses control characters here
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        raise _YamlProblem(f"character U+{e.character:04X} is not allowed (YAML forbids control characters)",
                           line, column) from None
    try:
        node = loader.get_single_node()
        try:
            value = loader.construct_document(node) if node is not None else None
        except (ValueError, OverflowError, TypeError) as e:  # a scalar that fits its tag's pattern but not Python
            raise _scalar_problem(node, e) from None
    except yaml.MarkedYAMLError as e:
        raise _yaml_problem(e) from None
    except yaml.YAMLError as e:
        raise _YamlProblem(str(e)) from None
    except RecursionError:
        raise _YamlProblem("nested too deeply to read") from None
    finally:
        loader.dispose()
    return value, node


def _scalar_problem(root: yaml.Node, error: Exception) -> _YamlProblem:
    """The first scalar under ``root`` that cannot be built (an integer of thousands of digits, a date with
    month 13), found by building each scalar alone."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            try:
                yaml.SafeLoader("").construct_object(node)
            except (ValueError, OverflowError, TypeError, yaml.YAMLError) as e:
                mark = node.start_mark
                if "integer string conversion" in str(e):  # Python's guard against quadratic int parsing
                    problem = (f"an integer of {len(node.value):,} digits is too long "
                               f"(at most {sys.get_int_max_str_digits()})")
                else:
                    problem = f"cannot read {_show(node.value)} as {node.tag.rsplit(':', 1)[-1]}: {str(e)[:200]}"
                return _YamlProblem(problem, mark.line + 1, mark.column + 1)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(n for pair in reversed(node.value) for n in reversed(pair))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed(node.value))
    return _YamlProblem(str(error)[:200])


def _yaml_problem(e: yaml.MarkedYAMLError) -> _YamlProblem:
    """PyYAML's error as a ``_YamlProblem``: its 0-based marks made 1-based, its texts joined."""

    def at(mark: yaml.Mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    text = e.problem or "cannot parse"
    if e.context:
        started = ""
        if e.context_mark and e.problem_mark and e.context_mark.line != e.problem_mark.line:
            started = f" (started at {at(e.context_mark)})"
        text = f"{e.context}{started}: {text}"
    mark = e.problem_mark
    return _YamlProblem(text, mark.line + 1, mark.column + 1) if mark else _YamlProblem(text)
