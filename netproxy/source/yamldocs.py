"""YAML documents read defensively: duplicate keys and alias bombs are named, not obeyed.

PyYAML keeps the last of two equal keys without a word, so ``clusterIP`` given twice programs whichever
a reader did not look at; kubectl refuses such a manifest, and so does netproxy, naming the object and
the field.  Aliases are shared, not copied, when PyYAML builds the objects, but anything that walks a
"billion laughs" document (a repr in an error message, a copy) never ends, so a document whose aliases
expand it more than :data:`MAX_EXPANSION` times is refused before it is built, as go-yaml does.
Either way only that document is refused: the other documents of the file are used.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from netproxy.core.model import ValidationError, shown

_BASE: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser is ~10x faster
MAX_EXPANSION = 10
"""A document may expand (through aliases) to at most this many times its own size..."""
MIN_EXPANDED = 100_000
"""... or this many nodes, whichever is more: small documents may alias freely."""


# Where YAML allows them: after a space, a flow indicator or the start of a line; "a&b" in a URL is no anchor.
_ANCHOR = re.compile(r"(?:^|[\s\[{,])&[^\s,\[\]{}]", re.M)
_ALIAS = re.compile(r"(?:^|[\s\[{,])\*[^\s,\[\]{}]", re.M)


class _Loader(_BASE):  # type: ignore[misc]  # libyaml's loader class is untyped
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: Dict[int, Tuple[Any, str]] = {}
        """id(mapping) → (the mapping, the key given twice), for the mappings of this document."""

    def construct_checked_map(self, node: MappingNode) -> Iterator[Dict[Any, Any]]:
        data: Dict[Any, Any] = {}
        yield data
        own = node.value  # flatten_mapping (merge keys) replaces node.value but edits this list in place
        value = self.construct_mapping(node)
        data.update(value)
        if len(value) < len(own) or own is not node.value:
            seen = set()
            for key_node, _ in own:
                key = self.construct_object(key_node)
                if isinstance(key, str) and key in seen:
                    self.duplicates[id(data)] = (data, key)
                    break
                seen.add(key)


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_checked_map)


def read(text: str, source: str) -> List[Any]:
    """The documents of ``text`` (a file called ``source``): each a parsed document, or a
    :class:`ValidationError` standing for one that was refused.  Raises ``yaml.YAMLError`` (and
    ``ValueError`` for an integer past Python's digit limit) when the text is not YAML at all."""
    loader = _Loader(text)
    # Without an anchor and an alias there is nothing to expand: skip the walk (2-3 s at 10k services).
    aliased = bool(_ANCHOR.search(text) and _ALIAS.search(text))
    out: List[Any] = []
    try:
        index = 0
        while loader.check_node():
            node = loader.get_node()
            index += 1
            if node is None:
                continue
            bomb = _expansion(node) if aliased else None
            if bomb is not None:
                out.append(ValidationError(*_describe(node, index, source), bomb[0], bomb[1]))
                continue
            loader.duplicates = {}
            doc = loader.construct_document(node)
            if doc is None:
                continue
            if not isinstance(doc, Mapping):
                out.append(ValidationError("document", f"{index} of {source}", "(root)",
                                           f"is {shown(doc)}, not a Kubernetes object"))
                continue
            if loader.duplicates:
                path, key = _duplicate_path(doc, loader.duplicates)
                kind, ref = _kind_ref(doc, index, source)
                out.append(ValidationError(kind, ref, f"{path}{key}" if path else key,
                                           "is given twice (a duplicate YAML key)"))
                continue
            out.append(doc)
    finally:
        loader.dispose()
    return out


def not_an_object(doc: object) -> bool:
    """Whether ``doc`` (from :func:`read`) stands for a document that is no object at all."""
    return isinstance(doc, ValidationError) and doc.kind == "document" and doc.field_path == "(root)" \
        and doc.message.endswith("not a Kubernetes object")


def _children(node: Node) -> List[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _expansion(root: Node) -> Optional[Tuple[str, str]]:
    """(field path, message) when ``root``'s aliases expand it too far; None when it is fine.

    Sizes are counted over the node graph with memoisation (aliases are shared nodes), iteratively:
    libyaml allows nesting 1,000 deep, which Python's recursion would not survive."""
    size: Dict[int, int] = {}
    stack: List[Tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in size:
            continue
        kids = _children(node)
        if done:
            size[id(node)] = 1 + sum(size[id(k)] for k in kids)
            continue
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
    expanded, unique = size[id(root)], len(size)
    if expanded <= max(MIN_EXPANDED, MAX_EXPANSION * unique):
        return None
    # Name the field: follow the largest child down while it alone is the explosion.
    path, node = "", root
    while isinstance(node, MappingNode):
        key, value = max(node.value, key=lambda kv: size[id(kv[1])])
        if size[id(value)] * 2 < size[id(node)] or not isinstance(key, ScalarNode):
            break
        path, node = f"{path}.{key.value}" if path else str(key.value), value
    return path or "(root)", (f"YAML aliases expand it to {expanded:,} nodes from {unique:,} "
                              f"(more than {MAX_EXPANSION}x): refused as an alias bomb")


def _scalar(node: Node, *path: str) -> Optional[str]:
    """A scalar's text under ``node`` (a mapping) by key path, without building the document."""
    for key in path:
        if not isinstance(node, MappingNode):
            return None
        found = next((v for k, v in node.value if isinstance(k, ScalarNode) and k.value == key), None)
        if found is None:
            return None
        node = found
    return node.value if isinstance(node, ScalarNode) else None


def _describe(node: Node, index: int, source: str) -> Tuple[str, str]:
    """(kind, namespace/name) of a document not built, from its scalars when they are there."""
    return _kind_ref_of(_scalar(node, "kind"), _scalar(node, "metadata", "namespace"),
                        _scalar(node, "metadata", "name"), index, source)


def _kind_ref(doc: Mapping[str, Any], index: int, source: str) -> Tuple[str, str]:
    meta = doc.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return _kind_ref_of(doc.get("kind"), meta.get("namespace"), meta.get("name"), index, source)


def _kind_ref_of(kind: object, namespace: object, name: object, index: int, source: str) -> Tuple[str, str]:
    from netproxy.source.convert import ref_part

    if not isinstance(kind, str) or not kind.isidentifier() or len(kind) > 63:
        return "document", f"{index} of {source}"
    if name is None:
        return kind, f"{ref_part(namespace or 'default')}/? (document {index} of {source})"
    return kind, f"{ref_part(namespace or 'default')}/{ref_part(name)}"


def _duplicate_path(doc: Mapping[str, Any], flagged: Mapping[int, Tuple[Any, str]]) -> Tuple[str, str]:
    """("spec.ports[0].", "port") of the first mapping with a duplicate key, found by walking ``doc``
    (each container once: the document may share containers through aliases)."""
    seen = set()
    stack: List[Tuple[Any, str]] = [(doc, "")]
    while stack:
        value, path = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if id(value) in flagged:
            return path, flagged[id(value)][1]
        if isinstance(value, dict):
            stack.extend((v, f"{path}{k}.") for k, v in value.items() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            base = path[:-1] if path.endswith(".") else path
            stack.extend((v, f"{base}[{i}].") for i, v in enumerate(value) if isinstance(v, (dict, list)))
    return "", next(iter(flagged.values()))[1]
