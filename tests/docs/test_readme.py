"""What the READMEs and the documentation site tell a new user to run: the quick start is the file it names
and prints what each rank got, the commands it gives are there, and every script, example and hostfile a
command names exists where the command says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adasum.rule.reference import reference_allreduce

from helpers import run_recipe

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_readme_quick_start_is_the_example_file():
    quick = _section((ROOT / "README.md").read_text(), "Quick start")
    code = _blocks(quick, "python")
    assert code, "README's Quick start shows no python block"
    assert code[0] == (ROOT / "examples" / "quickstart.py").read_text(), \
        "README's Quick start differs from examples/quickstart.py"
    commands = "".join(_blocks(quick, "bash"))
    assert ". .venv/bin/activate" in commands, "README's Quick start does not activate .venv first"
    assert "mpiexec -n 4 python -m mpi4py examples/quickstart.py" in commands


def test_readme_keeps_the_two_commands():
    """The project's contract: these two commands, as written, in a bash block of README.md."""
    commands = "".join(_blocks((ROOT / "README.md").read_text(), "bash"))
    for command in ("bash scripts/run-example.sh", "bash scripts/run-tests.sh"):
        assert command in commands, f"README.md no longer shows {command!r}"


def _quickstart_inputs(size: int) -> list[list[np.ndarray]]:
    """The two layers examples/quickstart.py gives each rank."""
    return [[np.eye(size)[r], (r + 1) * np.array([1.0, 2.0])] for r in range(size)]


_LINE = re.compile(r"rank (\d+) of (\d+): orthogonal -> \[([^]]*)\] \(the sum\), parallel -> \[([^]]*)\] \(the mean\)")


def _parse(out: str) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """Each rank's line (the launcher may interleave the ranks' output, even within a line)."""
    return [(int(m[1]), int(m[2]), np.array(m[3].split(), dtype=float), np.array(m[4].split(), dtype=float))
            for m in _LINE.finditer(out)]


@pytest.mark.timeout(240)
def test_quick_start_prints_what_each_of_three_ranks_got():
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert mpiexec, "no mpiexec on PATH"
    env = dict(os.environ, MPIEXEC_TIMEOUT="180", OMP_NUM_THREADS="1")
    run = subprocess.run([mpiexec, "-n", "3", sys.executable, "-m", "mpi4py", "examples/quickstart.py"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, f"the quick start failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    parsed = _parse(run.stdout)
    assert sorted(p[0] for p in parsed) == [0, 1, 2] and {p[1] for p in parsed} == {3}, \
        f"want one line from each of 3 ranks, got:\n{run.stdout}"
    want = reference_allreduce(_quickstart_inputs(3))
    for rank, _, orthogonal, parallel in parsed:
        # The print shows numpy's default 8 significant digits.
        np.testing.assert_allclose(orthogonal, want[0], rtol=1e-7, err_msg=f"rank {rank}")
        np.testing.assert_allclose(parallel, want[1], rtol=1e-7, err_msg=f"rank {rank}")
        np.testing.assert_array_equal(orthogonal, np.ones(3), err_msg=f"rank {rank}: orthogonal layers add")
        np.testing.assert_array_equal(parallel, [2.0, 4.0], err_msg=f"rank {rank}: parallel layers average")


# Files a command reads: a script, a hostfile, a document, with or without a directory (a bare train.py is
# one that would have to be in the repository root).
_PATH = re.compile(r"(?<![\w./-])((?:[\w+-]+/)*(?:[\w+.-]+\.(?:py|sh|txt|md)|hostfiles/[\w+.-]+))(?![\w/])")


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_in_a_readme_command_exists(readme):
    """Every command in these READMEs runs from the repository root: what it names must be there."""
    missing = []
    for block in _blocks(readme.read_text(), "bash"):
        for line in block.splitlines():
            command = line.split("#", 1)[0]
            for path in _PATH.findall(command):
                if not (ROOT / path).exists():
                    missing.append(f"{path!r} in: {line.strip()}")
    assert not missing, f"{readme.relative_to(ROOT)}: commands name files that do not exist:\n" + "\n".join(missing)


# A recipe in the docs is an excerpt of a complete script: the HTML comment names the script, the fenced
# block after it shows some of its lines.
_EXCERPT = re.compile(r"^<!-- excerpt: (\S+) -->\n```\w*\n(.*?)^```", flags=re.S | re.M)


def _excerpts() -> list[tuple[Path, str, str]]:
    return [(readme, m[1], m[2]) for readme in READMES for m in _EXCERPT.finditer(readme.read_text())]


def _missing_line(excerpt: str, script: str) -> str | None:
    """None where every non-blank line of ``excerpt`` is a line of ``script``, in order, all indented by the
    same amount more than in the excerpt; else the first line that could not be found."""
    want = [line.rstrip() for line in excerpt.splitlines() if line.strip()]
    have = [line.rstrip() for line in script.splitlines()]
    first_unmatched = want[0]
    for indent in sorted({len(h) - len(h.lstrip()) for h in have if h.strip() == want[0].strip()}):
        prefix, i = " " * (indent - (len(want[0]) - len(want[0].lstrip()))), 0
        for line in have:
            if i < len(want) and line == prefix + want[i]:
                i += 1
        if i == len(want):
            return None
        first_unmatched = want[i]
    return first_unmatched


def test_python_blocks_are_marked_excerpts():
    """Every python block of the README and the docs is the quick start (the whole of examples/quickstart.py)
    or an excerpt marked with the script it comes from: no recipe stands alone, untested."""
    unmarked = []
    for readme in READMES:
        text = readme.read_text()
        for m in re.finditer(r"^```python\n", text, flags=re.M):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            block = text[m.end():text.index("\n```", m.end())]
            if not before.startswith("<!-- excerpt:") and block + "\n" != (ROOT / "examples" / "quickstart.py").read_text():
                unmarked.append(f"{readme.relative_to(ROOT)}: {block.splitlines()[0]!r}")
    assert not unmarked, "python blocks without an excerpt marker:\n" + "\n".join(unmarked)


def test_the_recipes_are_excerpts_of_their_scripts():
    found = _excerpts()
    named = {script for _, script, _ in found}
    for script in ("examples/ddp_hook.py", "examples/ddp_delta_hook.py", "examples/lightning_mnist1d.py",
                   "examples/accelerate_ddp.py", "examples/hf_trainer.py", "examples/horovod_style.py",
                   "examples/train_quickstart.py", "examples/distributed_optimizer.py"):
        assert script in named, f"no recipe in the docs is marked as an excerpt of {script}"
    drift = []
    for readme, script, block in found:
        path = ROOT / script
        assert path.is_file(), f"{readme.relative_to(ROOT)}: the excerpt names {script}, which does not exist"
        line = _missing_line(block, path.read_text())
        if line is not None:
            drift.append(f"{readme.relative_to(ROOT)}: {line.strip()!r} is not in {script} (in this order)")
    assert not drift, "recipes differ from their scripts:\n" + "\n".join(drift)


def test_an_excerpt_check_catches_drift():
    script = "import torch\n\nfor x in data:\n    step(x)\n    done()\n"
    assert _missing_line("for x in data:\n    step(x)\n", script) is None
    assert _missing_line("step(x)\ndone()\n", script) is None               # indented the same, deeper
    assert _missing_line("import torch\ndone()\n", script) == "done()"     # not at the same depth
    assert _missing_line("done()\nstep(x)\n", script) == "step(x)"          # out of order
    assert _missing_line("step(x, lr=1)\n", script) == "step(x, lr=1)"      # changed


_RUNS = re.compile(r"(?<![\w./-])(mpiexec|mpirun|python3?)\b")


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_that_run_commands_say_to_activate_the_venv(readme):
    """After the two commands, mpiexec and the python that has adasum are in .venv/bin: a page whose
    commands run them says to activate .venv, or writes them with .venv/bin/."""
    text = readme.read_text()
    bare = [line.strip() for block in _blocks(text, "bash") for line in block.splitlines()
            if _RUNS.search(line.split("#", 1)[0]) and ".venv/bin/" not in line]
    if bare:
        assert ". .venv/bin/activate" in text, \
            f"{readme.relative_to(ROOT)} runs {bare[0]!r} but never says to activate .venv (. .venv/bin/activate)"


_SCRIPT_OPTIONS = re.compile(r"(examples/[\w.]+\.py)((?:\s+(?:--?[\w-]+(?:\s+(?!--)[^\s#]+)?))*)")


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_option_a_command_passes_to_an_example_is_one_it_takes(readme):
    """`mpiexec ... examples/train.py --op mean`: each --option after an example script is defined in it."""
    unknown = []
    for block in _blocks(readme.read_text(), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for script, options in _SCRIPT_OPTIONS.findall(line.split("#", 1)[0]):
                source = (ROOT / script).read_text() if (ROOT / script).exists() else ""
                for option in re.findall(r"(?<!\S)(--[\w-]+)", options):
                    if f'"{option}"' not in source:
                        unknown.append(f"{script} {option} in: {line.strip()}")
    assert not unknown, f"{readme.relative_to(ROOT)}: options the scripts do not define:\n" + "\n".join(unknown)


def test_torch_pin_is_what_the_extra_installs():
    """``pip install ".[mpich,torch]"`` (README's install) and the development setup agree on torch: the
    version requirements-dev.txt pins lies in the ``torch`` extra's range, and the extra has an upper bound
    (a plain install would otherwise take an untested newer torch)."""
    import tomllib

    from packaging.requirements import Requirement

    pin = next(line for line in (ROOT / "requirements-dev.txt").read_text().splitlines() if line.startswith("torch=="))
    version = pin.split("==")[1].strip()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("torch", "triton"):
        (req,) = [Requirement(r) for r in extras[name] if r.startswith("torch")]
        assert req.specifier.contains(version), f"extra {name!r}: {req} excludes the pinned torch {version}"
        assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"extra {name!r}: {req} has no upper bound"
    assert version.rsplit(".", 1)[0] in (ROOT / "README.md").read_text(), "README.md does not name the pinned torch"


def _version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_version_is_the_same_everywhere():
    """pyproject's version is the package's, the changelog's top entry, the site's name and what the home
    page and the README say."""
    import adasum

    version = _version()
    assert adasum.__version__ == version
    entries = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert entries and entries[0] == version, f"CHANGELOG.md's top entry is {entries[:1]}, the project {version}"
    site_name = re.search(r"^site_name: (.*)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)[1]
    assert site_name == f"adasum {version}"
    assert f"adasum {version}" in (ROOT / "docs" / "index.md").read_text()
    assert f"version {version}" in (ROOT / "README.md").read_text()


def test_the_license_is_the_one_pyproject_declares():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_site_works_from_disk():
    assert re.search(r"^use_directory_urls: false$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)


def test_the_environment_report_is_documented():
    commands = "".join(_blocks((ROOT / "README.md").read_text(), "bash"))
    for command in ("python -m adasum", "mpiexec -n 2 python -m mpi4py -m adasum"):
        assert command in commands, f"README.md no longer shows {command!r}"
    template = (ROOT / ".github" / "ISSUE_TEMPLATE" / "bug_report.md").read_text()
    assert "python -m adasum" in template


def test_no_placeholder_install_url():
    assert "git+URL" not in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", ["mpich-hosts", "openmpi-hosts"])
def test_placeholder_hostfiles_say_to_replace_their_names(name):
    text = (ROOT / "hostfiles" / name).read_text()
    assert "node0" in text and "Replace the names with your hosts" in text
    assert f"hostfiles/{name}" in (ROOT / "README.md").read_text()
    assert "replace the names" in (ROOT / "docs" / "launching.md").read_text()


def test_every_option_of_the_example_is_documented():
    """docs/training.md lists examples/train.py's options: each one the script defines is named there."""
    defined = re.findall(r'add_argument\("(--[\w-]+)"', (ROOT / "examples" / "train.py").read_text())
    assert defined
    training = (ROOT / "docs" / "training.md").read_text()
    missing = [o for o in defined if f"`{o}" not in training]
    assert not missing, f"docs/training.md does not mention {missing}"


# (document, the sentence's pattern with the figure, the script it runs at 2 ranks)
_ACCURACIES = [
    ("README.md", r"examples/train_quickstart\.py` \(with `\.venv` active, as above\) prints ([\d.]+) %",
     "examples/train_quickstart.py"),
    ("docs/training.md", r"examples/distributed_optimizer\.py`\. It prints ([\d.]+) % test accuracy",
     "examples/distributed_optimizer.py"),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc, pattern, script", _ACCURACIES, ids=[s for _, _, s in _ACCURACIES])
def test_the_recipes_print_the_accuracy_the_docs_give(doc, pattern, script):
    said = re.search(pattern, " ".join((ROOT / doc).read_text().split()))
    assert said, f"{doc} no longer gives the accuracy of {script}"
    assert f"{said[1]} % test accuracy" in (ROOT / script).read_text(), f"{script}'s docstring gives another figure"
    run = run_recipe(script.removeprefix("examples/"))  # once per process: test_recipes.py checks this run too
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    got = [float(a) for a in re.findall(r"final test accuracy ([\d.]+)", run.stdout)]
    assert len(got) == 2, run.stdout
    assert all(f"{100 * a:.1f}" == said[1] for a in got), f"{script} printed {got}, {doc} says {said[1]} %"
