"""A minimal, strict ``kustomize build`` for the manifests in ``deploy/kuberay``.

``kubectl kustomize`` cannot run here, so the tests render the overlays with
this: ``resources`` (files, or folders with their own kustomization) and
``patches`` that are JSON 6902 operation lists (``add``, ``replace``,
``remove``) with a ``target`` naming the object. That is the whole subset the
overlays may use: any other kustomization key, a strategic-merge patch (whose
list semantics differ for CRDs such as RayService) or a target that matches
nothing is an error, so a manifest cannot rely on something this renderer
silently skips.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches"}
TARGET_KEYS = {"group", "version", "kind", "name"}


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` would print, in order."""
    folder = Path(folder)
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    assert not unknown, f"{folder}: kustomization keys {sorted(unknown)} are not supported by the test renderer"
    assert kustomization.get("kind") == "Kustomization", f"{folder}: kind must be Kustomization"
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (folder / entry).resolve()
        assert path.exists(), f"{folder}/kustomization.yaml: resource {entry} does not exist"
        if path.is_dir():
            objects.extend(render(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)
    for patch in kustomization.get("patches", []):
        _apply_patch(folder, patch, objects)
    return objects


def _apply_patch(folder: Path, patch: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    assert set(patch) <= {"path", "target"}, f"{folder}: only path + target patches are supported: {patch}"
    target = patch.get("target") or {}
    assert target and set(target) <= TARGET_KEYS, f"{folder}: a patch needs a target of {sorted(TARGET_KEYS)}"
    operations = yaml.safe_load((folder / patch["path"]).read_text())
    assert isinstance(operations, list), f"{folder}/{patch['path']}: only JSON 6902 patches (a list of ops)"
    matched = [obj for obj in objects if _matches(obj, target)]
    assert matched, f"{folder}: patch target {target} matches no object"
    for index, obj in enumerate(objects):
        if _matches(obj, target):
            patched = copy.deepcopy(obj)
            for op in operations:
                _apply_operation(patched, op, f"{folder}/{patch['path']}")
            objects[index] = patched


def _matches(obj: dict[str, Any], target: dict[str, str]) -> bool:
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    return (
        target.get("kind", obj.get("kind")) == obj.get("kind")
        and target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]
        and target.get("group", group) == group
        and target.get("version", version) == version
    )


def _apply_operation(doc: Any, op: dict[str, Any], where: str) -> None:
    kind = op.get("op")
    assert kind in ("add", "replace", "remove"), f"{where}: op {kind!r} is not supported"
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    parent = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        assert kind == "add" or index < len(parent), f"{where}: {op['path']} is past the end of its list"
        if kind == "add":
            parent.insert(index, op["value"])
        elif kind == "replace":
            parent[index] = op["value"]
        else:
            del parent[index]
        return
    assert kind == "add" or last in parent, f"{where}: {op['path']} does not exist ({kind} needs it)"
    if kind == "remove":
        del parent[last]
    else:
        parent[last] = op["value"]
