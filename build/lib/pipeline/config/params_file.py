"""``params.yaml`` read as a guard against what YAML lets through silently or slowly.

PyYAML's ``safe_load`` keeps the last of two equal keys without a word (a run written twice
trains its second copy), and a few hundred bytes of anchors and aliases (a "billion
laughs" file) stand for 10^9 values to whatever walks the result: pydantic, DVC's own
parser of ``params.yaml``. So, before anything else reads the file:

- its size is checked against :data:`MAX_BYTES` before a byte of it is read;
- the document is composed into a node graph (libyaml where installed; it caps nesting at
  1,000 levels), in which an alias is a reference to its anchor's node, not a copy;
- the values its aliases add once expanded are counted on that graph (an alias into its
  own anchor is refused: the document would never end) against :data:`MAX_ALIAS_VALUES`;
- every mapping is checked for a key written twice (a ``<<`` merge key may still be
  overridden: that is what merging means);

and only then is the graph turned into Python objects. Every refusal is a ``ConfigError``
naming the file (or the dotted key and both lines) and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from pipeline.errors import ConfigError

# A whole number of MB (the message says "1 MB"): the shipped params.yaml is 10 kB, the
# papers' profile 16 kB.
MAX_BYTES = 1_000_000
MAX_ALIAS_VALUES = 100_000  # values aliases may add once expanded (the files we ship: 0)
MERGE_TAG = "tag:yaml.org,2002:merge"
# libyaml's loader where PyYAML was built with it: faster, and its composer refuses deep
# nesting itself where PyYAML's pure-Python one recurses until Python's limit.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: Path) -> Any:
    """The document of the YAML file ``path`` (None if empty) after the checks of the
    module docstring; ``FileNotFoundError`` and ``yaml.YAMLError`` pass through."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ConfigError(
            "params",
            f"{path} is {_size(size)}; the limit is {MAX_BYTES // 1_000_000} MB: a params "
            "file holds settings (the shipped one is 10 kB); check that this is the file you "
            "meant",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("params", f"{path} is not UTF-8 text (byte {err.start})") from None
    loader = _LOADER(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_aliases(root, path)
        _check_duplicates(root, loader)
        return loader.construct_document(root)
    except RecursionError:
        raise ConfigError(
            "params", f"{path} nests deeper than can be read; a params file needs a few levels"
        ) from None
    finally:
        loader.dispose()


def _size(n: int) -> str:
    """``20.0 MB``, or bytes where one decimal would hide that ``n`` exceeds 1 MB."""
    shown = f"{n / 1e6:.1f} MB"
    return shown if shown != "1.0 MB" else f"{n:,} bytes"


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_aliases(root: Node, path: Path) -> None:
    """Refuse a graph that expands to more than :data:`MAX_ALIAS_VALUES` values beyond its
    own nodes, or that holds a cycle. Each node is visited once (iteratively: no recursion
    on deep documents), its expanded size the sum of its children's."""
    expanded: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            expanded[key] = 1 + sum(expanded[id(c)] for c in _children(node))
            continue
        if key in expanded:
            continue
        if key in on_path:
            line = node.start_mark.line + 1
            raise ConfigError(
                "params",
                f"{path}:{line}: an alias refers to the node that holds it, so the document "
                "never ends; write the value out",
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in expanded)
    added = expanded[id(root)] - len(expanded)
    if added > MAX_ALIAS_VALUES:
        raise ConfigError(
            "params",
            f"{path}: its aliases (*name) expand it by {added:,} values; the limit is "
            f"{MAX_ALIAS_VALUES:,}: write the repeated settings out, or alias less",
        )


def _check_duplicates(root: Node, loader: yaml.SafeLoader) -> None:
    """Refuse a mapping with a key written twice, naming its dotted key and both lines.
    Keys compare as the values they load to (``1`` and ``0x1`` are one key)."""
    seen: set[int] = set()
    stack: list[tuple[Node, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, SequenceNode):
            # reversed: the stack pops the first first, so a shared node gets its first path
            stack.extend(reversed([(item, _join(where, i)) for i, item in enumerate(node.value)]))
            continue
        if not isinstance(node, MappingNode):
            continue
        stack.extend(reversed([(value, _join(where, key.value)) for key, value in node.value]))
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == MERGE_TAG:
                continue  # a complex key fails its construction, with PyYAML's words
            key = loader.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                lines = f"lines {first_line[key]} and {line}"
                at = f"line {line}" if first_line[key] == line else lines
                raise ConfigError(_join(where, key_node.value), f"written twice, at {at}; keep one")
            first_line[key] = line


def _join(where: str, part: object) -> str:
    return f"{where}.{part}" if where else str(part)
