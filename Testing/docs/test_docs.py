"""The documentation cannot rot silently.

* Every ``medvol`` / ``medvol-train`` command in a ``bash``/``sh``/``console`` block of a page is
  parsed by the real command-line parser (an option renamed or removed fails here, naming the page
  and line); every shell block passes ``bash -n``; ``python`` blocks compile; ``json``/``jsonl``
  blocks parse. Blocks meant as synopses (``[--option]`` placeholders) are fenced as ``text``.
* Blocks whose info string is ``bash runnable`` are run, in order of the page, in a scratch folder
  that sees the repository's folders (``Testing``, ``Resources``, …) and ``.venv``. They run with
  ``$MEDVOL_MODELS_JSON`` naming a manifest whose default preset is ``tiny``: a command written
  for the real default model runs end to end on the locally built smoke model, so its options,
  paths and outputs are checked, not the real model. Every output such a block names
  (``--out``, ``--output``, ``--qc``, …) must exist afterwards.
* Every relative link resolves, to a file and, with ``#anchor``, to a heading of that page.
* No tracked file refers to the folder beside the repository that the tests once read, and no
  page mentions an issue tracker.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

pytestmark = pytest.mark.docs  # every test here: `pytest -m docs Testing` runs the documentation check alone

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted({REPO / "README.md", REPO / "CHANGELOG.md", REPO / "Training" / "README.md",
                *REPO.glob("docs/*.md"), *REPO.glob("Testing/**/README.md"), *REPO.glob("Resources/**/README.md")})
SHELL = {"bash", "sh", "shell", "console"}
OUTPUT_OPTIONS = {"--out", "--output", "--qc", "--out-dir", "--anchor-out", "--output-dir"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    runnable: bool
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> List[Block]:
    out, lines = [], page.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if m:
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append(Block(page, start + 1, m.group(1).lower(), "runnable" in m.group(2).split(), "\n".join(body)))
        i += 1
    return out


ALL_BLOCKS = [b for p in PAGES for b in blocks(p)]
RUNNABLE = [b for b in ALL_BLOCKS if b.runnable]


# ---- commands in shell blocks ---------------------------------------------------------------

def shell_commands(text: str) -> List[List[str]]:
    """The simple commands of a shell block: continuations joined, comments, redirections and
    variable assignments dropped, split at ``&&``, ``||``, ``;``, ``|``, ``&`` and loop keywords;
    ``$VAR`` expanded to ``1`` (a loop index or a count in the examples)."""
    text = text.replace("\\\n", " ")
    cmds = []
    for line in text.split("\n"):
        line = re.sub(r"\$\{?\w+\}?", "1", line)
        line = re.sub(r"\d?>>?&?\s*\S+", " ", line)  # > file, 2>&1, >> log
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        cur: List[str] = []
        for tok in list(lex) + [";"]:
            if tok in {";", "&", "&&", "|", "||", ";;"} or tok in {"do", "done", "then", "fi", "wait"}:
                if cur:
                    cmds.append(cur)
                cur = []
            elif not cur and re.match(r"^\w+=", tok):
                continue  # VAR=value before a command
            else:
                cur.append(tok)
    return cmds


def cli_args(cmd: List[str]) -> Optional[tuple]:
    """``("medvol" | "medvol-train", args)`` for a command that runs one of our CLIs, else None."""
    prog = os.path.basename(cmd[0])
    if prog in ("medvol", "medvol-train"):
        return prog, cmd[1:]
    for i, tok in enumerate(cmd[:-1]):
        if tok == "-m" and cmd[i + 1] in ("medvolcore.cli", "medvoltrain"):
            return ("medvol" if cmd[i + 1] == "medvolcore.cli" else "medvol-train"), cmd[i + 2:]
    return None


def parser_for(prog: str) -> argparse.ArgumentParser:
    if prog == "medvol":
        from medvolcore.cli.app import build_parser
    else:
        pytest.importorskip("medvoltrain", reason="medvoltrain is not installed (bootstrap --no-training)")
        from medvoltrain.cli import build_parser
    return build_parser()


DOCUMENTED = [(b, cmd) for b in ALL_BLOCKS if b.lang in SHELL for cmd in shell_commands(b.text) if cli_args(cmd)]


def test_the_pages_show_commands_of_both_programs():
    """The extraction above finds what it should (a broken extractor would make the next test vacuous)."""
    progs = {cli_args(cmd)[0] for _, cmd in DOCUMENTED}
    assert progs == {"medvol", "medvol-train"}
    assert len(DOCUMENTED) >= 30
    assert len(RUNNABLE) >= 3


@pytest.mark.parametrize("block,cmd", DOCUMENTED, ids=[f"{b.where}:{' '.join(c[:3])}" for b, c in DOCUMENTED])
def test_documented_command_parses(block, cmd):
    prog, args = cli_args(cmd)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser_for(prog).parse_args(args)
        except SystemExit as e:
            if e.code not in (0, None):  # --help and --version exit 0
                pytest.fail(f"{block.where}: `{shlex.join(cmd)}` does not parse: {err.getvalue().strip()}",
                            pytrace=False)


def test_shell_extraction_handles_continuations_loops_and_redirections():
    cmds = shell_commands("for i in 0 1; do\n  CUDA_VISIBLE_DEVICES=$i medvol-train evaluate --shard $i/4 \\\n"
                          "      --no-progress > eval_$i.log 2>&1 &\ndone; wait\nmedvol info ct.nii.gz  # a comment\n")
    assert ["medvol-train", "evaluate", "--shard", "1/4", "--no-progress"] in cmds
    assert ["medvol", "info", "ct.nii.gz"] in cmds


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in SHELL | {"python", "json", "jsonl"}],
                         ids=lambda b: b.where)
def test_code_and_data_blocks_are_well_formed(block):
    if block.lang in SHELL:  # commands no test can run here (Slicer, pip, accelerate) are still valid shell
        proc = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, encoding="utf-8")
        assert proc.returncode == 0, f"{block.where}: not valid shell: {proc.stderr.strip()}"
    elif block.lang == "python":
        compile(block.text, block.where, "exec")
    elif block.lang == "json":
        json.loads(block.text)
    else:
        for line in filter(None, block.text.split("\n")):
            json.loads(line)


# ---- runnable blocks ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def docs_env(tmp_path_factory, isolated_medvol_home):
    manifest = tmp_path_factory.mktemp("docs_models") / "models.json"
    manifest.write_text(json.dumps({"schema": "medvol.models/1", "default": "tiny", "presets": {}}))
    env = dict(os.environ)
    env.update(MEDVOL_MODELS_JSON=str(manifest), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    return env


def scratch_checkout(root: Path) -> Path:
    """A folder where relative paths of the docs resolve as in the repository, but outputs land in
    the scratch folder: every top-level entry of the repository is a symbolic link, ``.venv`` is
    the running interpreter's environment."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".venv") and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(Path(sys.prefix))
    return root


def named_outputs(text: str) -> List[str]:
    outs = []
    for cmd in shell_commands(text):
        for opt, val in zip(cmd, cmd[1:]):
            if opt in OUTPUT_OPTIONS:
                outs.append(val)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where)
def test_runnable_block_runs(block, docs_env, tmp_path):
    if "medvol-train" in block.text:
        pytest.importorskip("medvoltrain", reason="medvoltrain is not installed (bootstrap --no-training)")
    if not (Path(sys.prefix) / "bin" / "medvol").exists() or shutil.which("medvol", path=docs_env["PATH"]) is None:
        pytest.skip(f"`medvol` is not installed beside {sys.executable}")
    cwd = scratch_checkout(tmp_path / "checkout")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=cwd, env=docs_env,
                          capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=600)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{block.where} failed with exit code {proc.returncode}:\n{log}"
    for out in named_outputs(block.text):
        assert (cwd / out).exists(), f"{block.where}: the block names {out} but did not write it\n{log}"
        assert not (cwd / out).is_symlink() and not str((cwd / out).resolve()).startswith(str(REPO) + os.sep), \
            f"{block.where}: {out} was written inside the repository"


# ---- links ----------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces → ``-``."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


LINKS = []
for _page in PAGES:
    _text = re.sub(r"```.*?```", "", _page.read_text(encoding="utf-8"), flags=re.S)
    for _m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", _text):
        if not re.match(r"^[a-z]+:", _m.group(1)):
            LINKS.append((_page, _m.group(1)))


def test_slug_follows_github():
    assert slug("Quick start: training, on the tiny preset (about a minute on a CPU)") == \
        "quick-start-training-on-the-tiny-preset-about-a-minute-on-a-cpu"
    assert slug("Early stop (`--stop-after-empty K`)") == "early-stop---stop-after-empty-k"


@pytest.mark.parametrize("page,target", LINKS, ids=[f"{p.relative_to(REPO)}->{t}" for p, t in LINKS])
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(REPO)}: link to {target}: {dest} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{page.relative_to(REPO)}: link to {target}: no such heading"


# ---- what no file may say -------------------------------------------------------------------

def tracked_text_files() -> Dict[Path, str]:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
        files = [REPO / n.decode() for n in names if n]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked archive)
        files = [p for p in REPO.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]
    out = {}
    for f in files:
        if f.is_file() and f.suffix in (".py", ".md", ".txt", ".json", ".yaml", ".yml", ".sh", ".cff", ".cmake", "") \
                and f.stat().st_size < 2_000_000:
            try:
                out[f] = f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
    return out


def test_nothing_refers_to_a_folder_beside_the_repository():
    beside = "../" + "shared"  # spelled in two parts so that this file does not match itself
    hits = [f"{f.relative_to(REPO)}" for f, text in tracked_text_files().items() if beside in text]
    assert not hits, f"files that refer to {beside}: {hits}"


def test_no_page_mentions_an_issue_tracker():
    pattern = re.compile(r"\bissues?\s+#?\d+|\bissue tracker\b|\btracker\b|\bthe (hardening|restructure) issue\b", re.I)
    hits = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1):
            if pattern.search(line):
                hits.append(f"{page.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
