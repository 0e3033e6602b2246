"""Which parts of a JSON schema the engine's grammar backend cannot enforce.

Pure Python (no torch, no xgrammar, no jsonschema): the router calls it to
answer 400 before dispatch, the engine calls it again before compiling.
:func:`unsupported_schema_features` names every keyword whose constraint the
backend would drop, so a client that asked for ``uniqueItems`` never gets
duplicates back with a 200.

What xgrammar 0.2.8 enforces, as the engine compiles schemas
(``compile_json_schema(strict_mode=True)``, ``workers/structured/``). Verified
by compiling a schema per keyword with the default model's tokenizer and
checking with ``GrammarMatcher.accept_string`` + the stop token that
instances valid for the keyword are accepted and instances violating it are
rejected (``jsonschema`` as the oracle); "stricter" means some valid
instances are rejected too, never the reverse, so every output still
validates::

    keyword / feature                         verdict
    ---------------------------------------   ---------------------------------------------------
    type (one or a list), enum, const         enforced
    properties, required                      enforced (required: only names in properties)
    additionalProperties false / schema       enforced; unset means false (strict_mode: stricter)
    patternProperties, propertyNames          enforced; patterns match the whole name (stricter)
    minProperties, maxProperties              enforced with type object (or properties present)
    items (schema), prefixItems               enforced; unset items after prefixItems: none
    minItems, maxItems                        enforced with type array (or items present)
    minLength, maxLength                      enforced, but NOT beside pattern or format: refused
    pattern                                   enforced, matched against the whole string (stricter)
    format date, date-time, time, duration,   enforced (approximations: any month has 31 days,
      email, hostname, ipv4, ipv6, uuid, uri,   hostname labels are not capped at 63)
      uri-reference, uri-template,
      json-pointer, relative-json-pointer
    minimum, maximum, exclusiveMin/Maximum    enforced with type integer / number
    multipleOf                                enforced for type integer with a whole value only
    anyOf                                     enforced (no validation keywords beside it)
    oneOf                                     as anyOf (xgrammar's own warning): refused unless
                                              the branches are provably disjoint, see below
    allOf                                     one branch only; two or more are ignored: refused
    $ref #, #/$defs/..., #/definitions/...,   enforced, recursion too; keywords beside a $ref
      any local JSON pointer                    are ignored: refused
    unevaluatedProperties / -Items            enforced (ignored when strict_mode=False!)
    string / number keywords without type     ignored: refused (add "type")
    keywords beside enum / const / anyOf /    ignored: refused (beside enum/const, a type every
      oneOf / allOf                             value has is allowed)
    uniqueItems true, contains, minContains,  ignored: refused
      maxContains, not, if / then / else,
      dependentRequired, dependentSchemas,
      dependencies
    format idn-email, idn-hostname, iri,      ignored: refused
      iri-reference, regex, byte, unknown
    remote $ref, #anchor $ref, $dynamicRef,   not resolved (any value accepted): refused
      $recursiveRef
    contentEncoding / -MediaType / -Schema    not checked: refused
    items as a list, additionalItems          draft 7 tuples: refused (use prefixItems)

Annotations (title, description, default, examples, ...) and keywords JSON
Schema does not define are ignored by both sides, as JSON Schema says.

oneOf, the disjointness rule: the output must match exactly one branch, and
xgrammar only makes it match at least one. Every pair of branches (local
``$ref`` followed) must be provably disjoint: their types differ (integer
overlaps number), or both are const/enum with no common value, or one
property is required in both, with const/enum values in both and no common
value (pydantic's discriminated unions).
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

MAX_DEPTH = 128  # deeper schemas are refused: the walk (and the backend's) recurses
ENFORCED_FORMATS = frozenset({
    "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# Keywords the backend drops whatever the context (see the table).
_IGNORED = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
            "dependentSchemas", "dependencies", "contentEncoding", "contentMediaType", "contentSchema",
            "$dynamicRef", "$recursiveRef", "additionalItems")
_STRING = ("minLength", "maxLength", "pattern")
_NUMBER = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OBJECT = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
           "minProperties", "maxProperties", "unevaluatedProperties")
_ARRAY = ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems")
# Every keyword that constrains a value (anything else is an annotation).
VALIDATION_KEYWORDS = frozenset(("type", "enum", "const", "format", "anyOf", "oneOf", "allOf", "$ref")
                                + _IGNORED + _STRING + _NUMBER + _OBJECT + _ARRAY)
# Where subschemas live: keyword -> "one" (a schema), "list" or "map" (of schemas).
_CHILDREN = {"items": "one", "additionalProperties": "one", "unevaluatedProperties": "one",
             "unevaluatedItems": "one", "propertyNames": "one", "prefixItems": "list", "anyOf": "list",
             "oneOf": "list", "allOf": "list", "properties": "map", "patternProperties": "map",
             "$defs": "map", "definitions": "map"}


def unsupported_schema_features(schema: Any) -> list[str]:
    """Names every feature of ``schema`` the grammar backend would not enforce.

    Args:
        schema: A JSON schema (a dict or a bool), already syntax-checked.

    Returns:
        Readable names with the JSON path of the subschema, e.g.
        ``"uniqueItems at $.properties.tags"``; empty when all is enforced.
    """
    found: list[str] = []
    for path, node, implied in _subschemas(schema, "$", 0, None):
        if node is None:
            found.append(f"nesting deeper than {MAX_DEPTH} levels at {path}")
            continue
        found.extend(f"{what} at {path}" for what in _node_problems(node, schema, implied))
    return found


def _subschemas(node: Any, path: str, depth: int, implied: Optional[str]
                ) -> Iterator[tuple[str, Optional[dict], Optional[str]]]:
    """Every dict subschema with its path and the type its place implies (property names are
    strings), parents first; refused keywords are not entered. A subschema nested too deep
    comes as None (and its children do not come)."""
    if not isinstance(node, dict):
        return
    if depth > MAX_DEPTH:
        yield path, None, None
        return
    yield path, node, implied
    depth += 1
    for key, kind in _CHILDREN.items():
        value = node.get(key)
        if kind == "one" and isinstance(value, dict):
            yield from _subschemas(value, f"{path}.{key}", depth, "string" if key == "propertyNames" else None)
        elif kind == "list" and isinstance(value, list):
            for i, child in enumerate(value):
                yield from _subschemas(child, f"{path}.{key}[{i}]", depth, None)
        elif kind == "map" and isinstance(value, dict):
            for name, child in value.items():
                yield from _subschemas(child, f"{path}.{key}{_member(name)}", depth, None)


def _member(name: str) -> str:
    return f".{name}" if name.replace("_", "").isalnum() else f"[{json.dumps(name)}]"


def _node_problems(node: dict, root: Any, implied: Optional[str]) -> list[str]:
    """What one subschema (its own keywords, not its children's) asks that is not enforced."""
    problems = [key for key in _IGNORED if key in node]
    if node.get("uniqueItems") is True:
        problems.append("uniqueItems")
    if isinstance(node.get("items"), list):
        problems.append("items as a list (draft 7 tuple: use prefixItems)")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(key), bool):
            problems.append(f"{key} as a boolean (draft 4: give the bound as a number)")
    ref = node.get("$ref")
    if ref is not None:
        problems.extend(_ref_problems(ref, root))
    for combiner in ("$ref", "anyOf", "oneOf", "allOf", "enum", "const"):
        if combiner in node:
            problems.extend(_sibling_problems(node, combiner))
            break
    else:
        problems.extend(_typed_problems(node, implied))
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        problems.append(f"allOf with {len(node['allOf'])} branches (merge them into one schema)")
    if isinstance(node.get("oneOf"), list) and not _provably_disjoint(node["oneOf"], root):
        problems.append("oneOf with branches that may overlap (use anyOf, or give each branch a distinct "
                        "const on a required property)")
    return problems


def _sibling_problems(node: dict, combiner: str) -> list[str]:
    """Keywords beside ``$ref`` / anyOf / oneOf / allOf / enum / const: the backend ignores them."""
    siblings = [k for k in node if k in VALIDATION_KEYWORDS and k != combiner and k not in _IGNORED
                and not (k == "uniqueItems" and node[k] is not True)]
    if combiner in ("enum", "const") and "type" in siblings:
        values = node["enum"] if combiner == "enum" and isinstance(node["enum"], list) else [node.get("const")]
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        if all(_has_type(v, types) for v in values):
            siblings.remove("type")  # every value already has the type: nothing is lost
    return [f"{k} beside {combiner}" for k in siblings]


def _typed_problems(node: dict, implied: Optional[str]) -> list[str]:
    """Keywords that need a ``type`` naming their kind of value (xgrammar infers only objects and arrays)."""
    declared = node.get("type")
    types = set(declared if isinstance(declared, list) else [declared] if declared is not None else [])
    if implied is not None and not types:
        types.add(implied)
    if "properties" in node or "additionalProperties" in node:
        types.add("object")
    if "items" in node or "prefixItems" in node:
        types.add("array")
    problems = []
    wants = {"string": _STRING, "number": _NUMBER, "object": _OBJECT, "array": _ARRAY}
    for kind, keys in wants.items():
        ok = kind in types or (kind == "number" and "integer" in types)
        problems.extend(f'{k} without "type": "{kind}"' for k in keys if k in node and not ok
                        and not (k == "uniqueItems" and node[k] is not True))
    fmt = node.get("format")
    if fmt is not None and ("string" in types or not types):
        if fmt not in ENFORCED_FORMATS:
            problems.append(f"format {fmt!r}")
        elif not types:
            problems.append('format without "type": "string"')
        problems.extend(f"{k} beside format" for k in ("minLength", "maxLength") if k in node)
    if "pattern" in node:
        problems.extend(f"{k} beside pattern" for k in ("minLength", "maxLength") if k in node)
    if "multipleOf" in node and types & {"integer", "number"}:
        value = node["multipleOf"]
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if "number" in types or not whole:
            problems.append("multipleOf on a non-integer (only type integer with a whole value)")
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list):
        names = props if isinstance(props, dict) else {}
        problems.extend(f"required property {name!r} that is not in properties" for name in required
                        if name not in names)
    return problems


def _ref_problems(ref: Any, root: Any) -> list[str]:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return [f"$ref {ref!r} (only local refs such as '#/$defs/Name' are resolved)"]
    if _resolve(ref, root) is None:
        return [f"$ref {ref!r}, which does not resolve in this schema"]
    return []


def _resolve(ref: str, root: Any) -> Optional[Any]:
    """The subschema a local JSON-pointer ``$ref`` names, or None."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _follow(node: Any, root: Any) -> Any:
    """``node`` with local ``$ref`` chains followed (a bounded number of hops: refs may loop)."""
    for _ in range(32):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#")):
            return node
        node = _resolve(node["$ref"], root)
    return None


def _provably_disjoint(branches: list, root: Any) -> bool:
    resolved = [_follow(b, root) for b in branches]
    return all(_disjoint(a, b) for i, a in enumerate(resolved) for b in resolved[i + 1:])


def _disjoint(a: Any, b: Any) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    types_a, types_b = _types_of(a), _types_of(b)
    if types_a is not None and types_b is not None and not (types_a & types_b):
        return True
    values_a, values_b = _values_of(a), _values_of(b)
    if values_a is not None and values_b is not None and not (values_a & values_b):
        return True
    props_a, props_b = a.get("properties"), b.get("properties")
    if not (isinstance(props_a, dict) and isinstance(props_b, dict)):
        return False
    shared = set(a.get("required") or ()) & set(b.get("required") or ())
    for name in shared:
        va, vb = _values_of(props_a.get(name)), _values_of(props_b.get(name))
        if va is not None and vb is not None and not (va & vb):
            return True
    return False


def _types_of(node: dict) -> Optional[set[str]]:
    """The JSON types a branch allows (integer also counts as number), or None when unknown."""
    declared = node.get("type")
    if declared is not None:
        types = set(declared if isinstance(declared, list) else [declared])
    elif node.get("enum") is not None or "const" in node:
        types = {_type_of(v) for v in (node["enum"] if "enum" in node else [node["const"]])}
    else:
        return None
    if "integer" in types or "number" in types:
        types |= {"integer", "number"}
    return types


def _values_of(node: Any) -> Optional[set[str]]:
    """The values a const / enum allows, canonical JSON text (1 and 1.0 alike), or None."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = node["enum"]
    else:
        return None
    return {json.dumps(_canonical(v), sort_keys=True) for v in values}


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _has_type(value: Any, types: list) -> bool:
    kind = _type_of(value)
    return kind in types or (kind == "integer" and "number" in types)
