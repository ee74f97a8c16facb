"""The extension's description, as Slicer's Extensions Index reads it, without the network.

The top-level ``CMakeLists.txt`` (extension metadata) and the catalog entry submitted to
Slicer/ExtensionsIndex (``Resources/ExtensionsIndex/MedVolR1.json``) must agree with each other
and with the rules of the index: a repository whose name starts with ``Slicer``, icon and
screenshot URLs that name files of this repository, contributors as ``Name (Org)``, a description
of one or two sentences, ``cmake_minimum_required`` from the CMake of Slicer 5.10's extension template
(the minimum Slicer) to the policies of 5.12.3's (the tested target), the
same dependencies and category in both files, and an Apache-2.0 ``LICENSE`` at the top level.

Each rule is a function that returns the problems it finds; the real files must give none, and
each rule is also run on a copy of the real file with one thing wrong, so that a rule that can no
longer fail is noticed. The index's own checker (which needs the network) is described in
``Resources/ExtensionsIndex/README.md``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
CMAKE = REPO / "CMakeLists.txt"
ENTRY = REPO / "Resources" / "ExtensionsIndex" / "MedVolR1.json"
LICENSE = REPO / "LICENSE"

EXTENSION_NAME = "MedVolR1"
# Utilities/Templates/Extensions/Default/CMakeLists.txt of Slicer v5.12.3
CMAKE_MINIMUM = "cmake_minimum_required(VERSION 3.20.6...3.28.0 FATAL_ERROR)"
BRANCH = "main"
# the properties of slicer-extension-catalog-entry-schema-v1.0.2.json (it allows no others)
SCHEMA_KEYS = {"$schema", "category", "scm_url", "scm_revision", "scm_type", "build_dependencies",
               "dicom_support_rule", "build_subdirectory", "enabled", "tier"}
SCHEMA_REQUIRED = {"$schema", "category", "scm_url"}
SCHEMA_URL = re.compile(r"^https://raw\.githubusercontent\.com/Slicer/Slicer/main/Schemas/"
                        r"slicer-extension-catalog-entry-schema-v\d+\.\d+\.\d+\.json#?$")
REPO_PREFIXES = ("Slicer", "Slicer-", "Slicer_", "SlicerExtension-", "SlicerExtension_")


# ---- parsing ---------------------------------------------------------------------------------

def cmake_metadata(text: str) -> Dict[str, str]:
    """``EXTENSION_*`` variables (quoted or not), ``project`` and ``cmake_minimum_required``."""
    meta = {}
    for name, quoted, bare in re.findall(r'^\s*set\(\s*(EXTENSION_\w+)\s+(?:"([^"]*)"|([^\s)]+))\s*\)', text, re.M):
        meta.setdefault(name, quoted if quoted or not bare else bare)
    project = re.search(r"^\s*project\(\s*([^\s)]+)", text, re.M)
    meta["project"] = project.group(1) if project else ""
    minimum = re.search(r"^\s*cmake_minimum_required\([^)]*\)", text, re.M)
    meta["cmake_minimum_required"] = minimum.group(0).strip() if minimum else ""
    return meta


def github_repository(url: str) -> Optional[Tuple[str, str]]:
    """``(owner, name)`` of a github.com repository URL (``.git``, ``#fragment`` and a trailing
    slash allowed), else None."""
    m = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?(?:#[\w.-]*)?", url)
    return (m.group(1), m.group(2)) if m else None


def raw_file(url: str) -> Optional[Tuple[str, str, str, str]]:
    """``(owner, name, branch, path)`` of a raw.githubusercontent.com URL, else None."""
    m = re.fullmatch(r"https://raw\.githubusercontent\.com/([\w.-]+)/([\w.-]+)/([\w.-]+)/(\S+)", url)
    return m.groups() if m else None


def sentences(text: str) -> List[str]:
    """Sentences of a plain-text description: a ``.``, ``!`` or ``?`` followed by a space and a
    capital letter or a digit ends one (``5.10`` and ``3D`` do not)."""
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9])", text.strip()) if s]


def split_contributors(text: str) -> List[str]:
    """Contributors separated by commas outside parentheses (``A (Org1, Sub), B (Org2)``)."""
    out, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    out.append(current.strip())
    return out


# ---- rules -----------------------------------------------------------------------------------

def cmake_problems(text: str, root: Path = REPO) -> List[str]:
    meta, problems = cmake_metadata(text), []
    if meta["cmake_minimum_required"] != CMAKE_MINIMUM:
        problems.append(f"cmake_minimum_required is {meta['cmake_minimum_required']!r}, not {CMAKE_MINIMUM!r}")
    if meta["project"] != EXTENSION_NAME or meta.get("EXTENSION_NAME") != EXTENSION_NAME:
        problems.append(f"project() and EXTENSION_NAME must both be {EXTENSION_NAME}")
    home = github_repository(meta.get("EXTENSION_HOMEPAGE", ""))
    if home is None:
        return problems + [f"EXTENSION_HOMEPAGE is not a GitHub repository: {meta.get('EXTENSION_HOMEPAGE')!r}"]
    if not home[1].startswith(REPO_PREFIXES):
        problems.append(f"the repository name {home[1]!r} must start with Slicer")
    urls = [("EXTENSION_ICONURL", meta.get("EXTENSION_ICONURL", ""))]
    urls += [("EXTENSION_SCREENSHOTURLS", u) for u in meta.get("EXTENSION_SCREENSHOTURLS", "").split()]
    if len(urls) < 2:
        problems.append("EXTENSION_SCREENSHOTURLS names no screenshot")
    for key, url in urls:
        parts = raw_file(url)
        if parts is None:
            problems.append(f"{key} is not a raw.githubusercontent.com URL: {url!r}")
            continue
        owner, name, branch, path = parts
        if (owner, name) != home or branch != BRANCH:
            problems.append(f"{key} {url} is not on {BRANCH} of the homepage repository {'/'.join(home)}")
        if not (root / path).is_file():
            problems.append(f"{key} {url} names {path}, which is not a file of the repository")
        if not path.lower().endswith((".png", ".jpg", ".jpeg", ".gif")):
            problems.append(f"{key} {url} is not a PNG, JPEG or GIF image")
    for who in split_contributors(meta.get("EXTENSION_CONTRIBUTORS", "")):
        if not re.fullmatch(r"[^(),]+ \([^()]+\)", who):
            problems.append(f"contributor {who!r} is not in the form 'Name (Org)'")
    description = meta.get("EXTENSION_DESCRIPTION", "")
    if not 1 <= len(sentences(description)) <= 2:
        problems.append(f"EXTENSION_DESCRIPTION has {len(sentences(description))} sentences, not 1 or 2")
    if "Research use only" not in description:
        problems.append("EXTENSION_DESCRIPTION does not say 'Research use only'")
    if meta.get("EXTENSION_DEPENDS", "").split() != ["PyTorch"]:
        problems.append(f"EXTENSION_DEPENDS is {meta.get('EXTENSION_DEPENDS')!r}, not 'PyTorch'")
    if meta.get("EXTENSION_CATEGORY") != "Segmentation":
        problems.append(f"EXTENSION_CATEGORY is {meta.get('EXTENSION_CATEGORY')!r}, not 'Segmentation'")
    return problems


def entry_problems(raw: bytes, cmake_text: str, name: str = ENTRY.name) -> List[str]:
    """The catalog entry against the schema's keys, the index's file rules and the CMake metadata."""
    problems = []
    if b"\r" in raw:
        problems.append("the entry has CR or CRLF line endings (the index wants LF only)")
    if not raw.endswith(b"\n"):
        problems.append("the entry does not end with a newline")
    try:
        entry = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return problems + [f"the entry does not parse as JSON: {exc}"]
    if not isinstance(entry, dict):
        return problems + ["the entry is not a JSON object"]
    meta = cmake_metadata(cmake_text)
    if Path(name).stem != meta["project"]:
        problems.append(f"the entry's file name {name} is not the project name {meta['project']}.json")
    if SCHEMA_REQUIRED - entry.keys():
        problems.append(f"the entry lacks required keys {sorted(SCHEMA_REQUIRED - entry.keys())}")
    if entry.keys() - SCHEMA_KEYS:
        problems.append(f"keys not in the schema: {sorted(entry.keys() - SCHEMA_KEYS)}")
    if not SCHEMA_URL.match(str(entry.get("$schema", ""))):
        problems.append(f"$schema is not a catalog entry schema URL: {entry.get('$schema')!r}")
    home = github_repository(meta.get("EXTENSION_HOMEPAGE", ""))
    if home is None or entry.get("scm_url") != f"https://github.com/{home[0]}/{home[1]}.git":
        problems.append(f"scm_url {entry.get('scm_url')!r} is not the homepage repository {home}")
    if entry.get("scm_revision") != BRANCH:
        problems.append(f"scm_revision is {entry.get('scm_revision')!r}, not {BRANCH!r}")
    if entry.get("scm_type", "git") != "git":
        problems.append("scm_type is not git")
    if entry.get("build_dependencies") != meta.get("EXTENSION_DEPENDS", "").split():
        problems.append(f"build_dependencies {entry.get('build_dependencies')!r} differ from EXTENSION_DEPENDS "
                        f"{meta.get('EXTENSION_DEPENDS')!r}")
    if entry.get("build_subdirectory", ".") != meta.get("EXTENSION_BUILD_SUBDIRECTORY", "."):
        problems.append("build_subdirectory differs from EXTENSION_BUILD_SUBDIRECTORY")
    if entry.get("category") != meta.get("EXTENSION_CATEGORY"):
        problems.append(f"category {entry.get('category')!r} differs from EXTENSION_CATEGORY "
                        f"{meta.get('EXTENSION_CATEGORY')!r}")
    tier = entry.get("tier")
    if not (isinstance(tier, int) and not isinstance(tier, bool) and tier == 1):
        problems.append(f"tier is {tier!r}; a new extension is tier 1 (experimental)")
    return problems


def license_problems(text: str) -> List[str]:
    head = " ".join(text.split()[:40])
    if "Apache License Version 2.0, January 2004" not in head:
        return ["LICENSE is not the Apache License, Version 2.0"]
    if "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" not in text or "END OF TERMS AND CONDITIONS" not in text:
        return ["LICENSE is not the full Apache-2.0 text"]
    return []


# ---- the real files --------------------------------------------------------------------------

def test_cmake_metadata_follows_the_index_rules():
    text = CMAKE.read_text(encoding="utf-8")
    meta = cmake_metadata(text)
    assert meta["project"] == EXTENSION_NAME and meta["EXTENSION_HOMEPAGE"]
    assert cmake_problems(text) == []


def test_catalog_entry_parses_and_agrees_with_cmake():
    raw = ENTRY.read_bytes()
    entry = json.loads(raw)
    assert entry["scm_url"] == "https://github.com/medvol-r1/SlicerMedVolR1.git"
    assert entry_problems(raw, CMAKE.read_text(encoding="utf-8")) == []


def test_license_is_apache_2():
    assert license_problems(LICENSE.read_text(encoding="utf-8")) == []


# ---- each rule fails on a wrong file ---------------------------------------------------------

def _sub(pattern: str, replacement: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        out, n = re.subn(pattern, replacement, text, count=1, flags=re.M)
        assert n == 1, f"the mutation {pattern!r} matched nothing"
        return out
    return mutate


def _set(var: str, value: str) -> Callable[[str], str]:
    return _sub(rf'^set\({var} "[^"]*"\)', f'set({var} "{value}")'.replace("\\", "\\\\"))


CMAKE_MUTATIONS = {
    "old cmake minimum": (_sub(r"^cmake_minimum_required\(.*\)$", "cmake_minimum_required(VERSION 3.16.3...3.19.7 FATAL_ERROR)"),
                          "cmake_minimum_required"),
    "project renamed": (_sub(r"^project\(MedVolR1\)", "project(SlicerMedVolR1)"), "project() and EXTENSION_NAME"),
    "repository without Slicer": (lambda t: t.replace("medvol-r1/SlicerMedVolR1", "medvol-r1/MedVolR1Slicer"),
                                  "must start with Slicer"),
    "homepage not on GitHub": (_set("EXTENSION_HOMEPAGE", "https://example.org/SlicerMedVolR1"), "not a GitHub repository"),
    "icon not in the tree": (lambda t: t.replace("Icons/MedVolR1Slicer.png", "Icons/Missing.png"), "not a file"),
    "icon is a web page": (lambda t: t.replace("https://raw.githubusercontent.com/medvol-r1/SlicerMedVolR1/main/MedVolR1Slicer",
                                               "https://github.com/medvol-r1/SlicerMedVolR1/blob/main/MedVolR1Slicer"),
                           "not a raw.githubusercontent.com URL"),
    "screenshot in another repository": (lambda t: t.replace("SlicerMedVolR1/main/Resources/Screenshots",
                                                             "SlicerOther/main/Resources/Screenshots"),
                                         "not on main of the homepage repository"),
    "screenshot on another branch": (lambda t: t.replace("SlicerMedVolR1/main/Resources/Screenshots",
                                                         "SlicerMedVolR1/master/Resources/Screenshots"),
                                     "not on main of the homepage repository"),
    "screenshot not an image": (lambda t: t.replace("Screenshots/evidence_anchor.png", "Screenshots/README.md"),
                                "not a PNG"),
    "no screenshot": (_sub(r'^set\(EXTENSION_SCREENSHOTURLS "[^"]*"\)\n', ""), "names no screenshot"),
    "contributor without org": (_set("EXTENSION_CONTRIBUTORS", "MedVol-R1 for 3D Slicer contributors"), "'Name (Org)'"),
    "second contributor without org": (_set("EXTENSION_CONTRIBUTORS", "Jane Doe (Org), John Doe"), "'John Doe'"),
    "three sentences": (_set("EXTENSION_DESCRIPTION", "Segments a CT. Research use only, not a medical device. Needs 5.10."),
                        "3 sentences"),
    "no research-use notice": (_set("EXTENSION_DESCRIPTION", "Segments a CT from a free-form clinical query."),
                               "Research use only"),
    "depends NA": (_set("EXTENSION_DEPENDS", "NA"), "EXTENSION_DEPENDS"),
    "category": (_set("EXTENSION_CATEGORY", "Utilities"), "EXTENSION_CATEGORY"),
}


@pytest.mark.parametrize("name", sorted(CMAKE_MUTATIONS))
def test_a_wrong_cmake_file_fails(name):
    mutate, expected = CMAKE_MUTATIONS[name]
    problems = cmake_problems(mutate(CMAKE.read_text(encoding="utf-8")))
    assert any(expected in p for p in problems), problems


def _json_edit(**changes) -> Callable[[bytes], bytes]:
    def mutate(raw: bytes) -> bytes:
        entry = json.loads(raw)
        for key, value in changes.items():
            key = key.replace("dollar_", "$")
            if value is None:
                entry.pop(key)
            else:
                entry[key] = value
        return (json.dumps(entry, indent=2) + "\n").encode()
    return mutate


ENTRY_MUTATIONS = {
    "not JSON": (lambda raw: raw.replace(b'"category"', b"category"), "does not parse"),
    "CRLF": (lambda raw: raw.replace(b"\n", b"\r\n"), "line endings"),
    "no final newline": (lambda raw: raw.rstrip(b"\n"), "newline"),
    "scm_url of the old repository": (_json_edit(scm_url="https://github.com/medvol-r1/MedVolR1Slicer.git"), "scm_url"),
    "scm_revision a hash": (_json_edit(scm_revision="355dff9"), "scm_revision"),
    "no build_dependencies": (_json_edit(build_dependencies=[]), "build_dependencies"),
    "extra dependency": (_json_edit(build_dependencies=["PyTorch", "SlicerIGT"]), "build_dependencies"),
    "category": (_json_edit(category="Utilities"), "category"),
    "no category": (_json_edit(category=None), "required keys"),
    "key not in the schema": (_json_edit(scmurl="https://github.com/medvol-r1/SlicerMedVolR1.git"), "not in the schema"),
    "no $schema": (_json_edit(dollar_schema=None), "required keys"),
    "tier as text": (_json_edit(tier="1"), "tier"),
    "tier 5": (_json_edit(tier=5), "tier"),
}


@pytest.mark.parametrize("name", sorted(ENTRY_MUTATIONS))
def test_a_wrong_catalog_entry_fails(name):
    mutate, expected = ENTRY_MUTATIONS[name]
    problems = entry_problems(mutate(ENTRY.read_bytes()), CMAKE.read_text(encoding="utf-8"))
    assert any(expected in p for p in problems), problems


def test_the_entry_follows_the_cmake_file():
    """A homepage, dependency list or category changed in CMakeLists.txt alone fails the entry."""
    raw, text = ENTRY.read_bytes(), CMAKE.read_text(encoding="utf-8")
    for mutate, expected in ((CMAKE_MUTATIONS["repository without Slicer"][0], "scm_url"),
                             (_set("EXTENSION_DEPENDS", "PyTorch SlicerIGT"), "build_dependencies"),
                             (_set("EXTENSION_CATEGORY", "Utilities"), "category"),
                             (CMAKE_MUTATIONS["project renamed"][0], "file name")):
        problems = entry_problems(raw, mutate(text))
        assert any(expected in p for p in problems), (expected, problems)


@pytest.mark.parametrize("text,expected", [
    ("MIT License\n\nCopyright (c) 2026\n\nPermission is hereby granted", "not the Apache License"),
    ("                                 Apache License\n                           Version 2.0, January 2004\n", "full"),
])
def test_a_wrong_license_fails(text, expected):
    assert any(expected in p for p in license_problems(text))


def test_the_parsers():
    assert sentences("Segments a CT in 3D Slicer 5.10: a box. Research use only.") == \
        ["Segments a CT in 3D Slicer 5.10: a box.", "Research use only."]
    assert split_contributors("A B (Org, Sub), C (D)") == ["A B (Org, Sub)", "C (D)"]
    assert github_repository("https://github.com/o/SlicerX#readme") == ("o", "SlicerX")
    assert github_repository("https://github.com/o/SlicerX.git") == ("o", "SlicerX")
    assert github_repository("https://gitlab.com/o/SlicerX") is None
    assert raw_file("https://raw.githubusercontent.com/o/r/main/a/b.png") == ("o", "r", "main", "a/b.png")
    meta = cmake_metadata('set(EXTENSION_NAME X)\nset(EXTENSION_DEPENDS "A B")\nproject(X)\n')
    assert (meta["EXTENSION_NAME"], meta["EXTENSION_DEPENDS"], meta["project"]) == ("X", "A B", "X")
