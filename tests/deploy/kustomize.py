"""Rendering the overlays of ``deploy/kuberay``: ``kubectl kustomize`` when
it is installed (``render``), else a minimal, strict renderer of our own
(``render_subset``), which the tests compare with the real one wherever both run.

The subset: ``resources`` (files, or folders with their own kustomization),
``patches`` that are JSON 6902 operation lists (``add``, ``replace``,
``remove``) with a ``target`` naming the object, and ``images`` (``name``
with ``newName`` / ``newTag`` / ``digest``, applied to every container's
image, custom resources included, as kustomize 5 does). That is all the
overlays may use: any other kustomization key, a strategic-merge patch
(whose list semantics differ for CRDs such as RayService) or a target that
matches nothing is an error, so a manifest cannot rely on something the
subset silently skips.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
TARGET_KEYS = {"group", "version", "kind", "name"}
IMAGE_KEYS = {"name", "newName", "newTag", "digest"}


def kubectl() -> Optional[str]:
    """``kubectl`` on PATH if it renders kustomizations (kustomize 5 built in), else None."""
    path = shutil.which("kubectl")
    if path is None:
        return None
    try:
        out = subprocess.run([path, "version", "--client"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if "Kustomize Version: v5" in out else None


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects of ``kubectl kustomize folder``: by kubectl itself when it
    is installed, else by ``render_subset``."""
    path = kubectl()
    if path is None:
        return render_subset(folder)
    proc = subprocess.run([path, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {folder} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None]


def render_subset(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` would print (ours: see the module doc)."""
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
            objects.extend(render_subset(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)
    for patch in kustomization.get("patches", []):
        _apply_patch(folder, patch, objects)
    for image in kustomization.get("images", []):
        assert set(image) <= IMAGE_KEYS and "name" in image, f"{folder}: images entries take {sorted(IMAGE_KEYS)}"
        for obj in objects:
            _set_images(obj, image)
    return objects


def _set_images(node: Any, image: dict[str, str]) -> None:
    """Applies one ``images`` entry to every container under ``node``."""
    if isinstance(node, list):
        for item in node:
            _set_images(item, image)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                ref = container.get("image", "")
                name, tag, digest = _split_image(ref)
                if name != image["name"]:
                    continue
                name = image.get("newName", name)
                if "digest" in image:
                    container["image"] = f"{name}@{image['digest']}"
                else:
                    tag = image.get("newTag", tag)
                    container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
        else:
            _set_images(value, image)


def _split_image(ref: str) -> tuple[str, str, str]:
    ref, _, digest = ref.partition("@")
    name, tag = ref, ""
    if ":" in ref.rsplit("/", 1)[-1]:
        name, _, tag = ref.rpartition(":")
    return name, tag, digest


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
