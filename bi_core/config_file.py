"""Reading a config file into plain data: every way it can fail is one line naming the file.

YAML itself lets a mapping repeat a key and keeps the last value; a config that says
``backend:`` twice is a mistake, so :class:`UniqueKeyLoader` refuses it with both lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from bi_core.errors import ConfigError


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives one key twice; ``path`` is the key's path (``serve.port``); ``where`` says
    where both are (lines, 1-based; columns too when they share a line)."""

    def __init__(self, path: str, first: yaml.Mark, second: yaml.Mark) -> None:
        self.path = path
        if first.line == second.line:
            self.where = f"line {first.line + 1}, columns {first.column + 1} and {second.column + 1}"
        else:
            self.where = f"lines {first.line + 1} and {second.line + 1}"
        super().__init__(f"{path}: given twice ({self.where})")


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (the document is checked before
    it is constructed, so the error carries the key's path)."""

    def construct_document(self, node: yaml.Node) -> Any:
        _check_unique_keys(self, node, "", set())
        return super().construct_document(node)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_unique_keys(loader: yaml.SafeLoader, node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias: its node was walked where its anchor is (and cycles end here)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(loader, item, f"{path}[{i}]", seen)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    marks: dict[Any, yaml.Mark] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base': explicit keys override merged ones
            _check_unique_keys(loader, value_node, path, seen)
            continue
        if not isinstance(key_node, yaml.ScalarNode):  # a list or mapping as a key: construction refuses it
            continue
        key = loader.construct_object(key_node)
        if key in marks:
            raise DuplicateKeyError(_join(path, key), marks[key], key_node.start_mark)
        marks[key] = key_node.start_mark
        _check_unique_keys(loader, value_node, _join(path, key), seen)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; every way reading it can fail is one line naming the file."""
    if path.is_dir():
        raise ConfigError("", f"config file {path} is a directory; pass a YAML file (e.g. configs/cpu_reference.yaml)")
    if not path.exists():
        raise ConfigError("", f"config file {path} does not exist")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError("", f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("", f"config file {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                              "pass a YAML file") from None
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except DuplicateKeyError as e:
        raise ConfigError(e.path, f"given twice in {path} ({e.where}); YAML would silently keep the last one, "
                                  "so keep one of them") from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path} is not valid YAML: {_yaml_problem(e, text)}") from None


def _yaml_problem(e: yaml.YAMLError, text: str) -> str:
    """YAML's multi-line message as one line: where (line, column; 1-based) and what."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    if isinstance(e, yaml.MarkedYAMLError) and (e.problem_mark or e.context_mark):
        mark = e.problem_mark or e.context_mark
        what = e.problem or e.context
        if e.problem and e.context and e.context_mark:
            what += f" ({e.context} at {at(e.context_mark)})"
        return f"{at(mark)}: {what}"
    position = getattr(e, "position", None)  # ReaderError: a character YAML does not allow
    if isinstance(position, int):
        line = text.count("\n", 0, position)
        column = position - (text.rfind("\n", 0, position) + 1)
        char = e.character if isinstance(e.character, int) else ord(e.character)
        return f"line {line + 1}, column {column + 1}: {e.reason} (character #x{char:04x})"
    return " ".join(str(e).split())
