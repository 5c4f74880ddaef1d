"""The packaging check: the sdist and wheel that ``python -m build`` makes work when installed, away from the checkout.

Every test runs against the editable checkout, so a file the package reads at run time that the wheel
leaves out (the spec, the CUDA sources) goes unnoticed there. This check:

1. builds the sdist, and the wheel from it, with the standard front end, from a copy of the checkout's
   files (those git tracks or would track: stale ``build/`` or ``*.egg-info`` output cannot hide a
   packaging mistake);
2. reads the sdist: it carries ``specs/`` byte for byte (a wheel built from it needs the spec);
3. reads the wheel: every module of ``paramfsm/``, the shipped specs byte for byte under
   ``paramfsm/specs/``, the CUDA kernel sources, the license, its metadata (the version is
   ``paramfsm.__version__``) and entry point, and nothing else (no tests, benchmarks or examples);
4. installs the wheel with its ``hf``, ``verify``, ``accelerate``, ``peft`` and ``lightning`` extras and
   ``torch==2.13.0`` into a new virtual environment that sees nothing of the checkout or of ``.venv``, and
   from a temporary folder runs ``.ci/wheel_smoke.py`` (imports, data files, a one-rank training loop against plain torch),
   ``paramfsm --help``, ``paramfsm spec check`` and ``paramfsm verify`` on the demo model.

Usage: ``python .ci/check_wheel.py`` with a Python that has ``build`` (``make check-wheel`` uses .venv).
Each step prints one line with its time; the last line counts them. Exit 1 when one fails (the
temporary folder is then kept and named); 0 otherwise.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from email.parser import Parser
from fnmatch import fnmatch
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the CPU wheel CI tests; an unpinned torch would pull a multi-GB CUDA build
EXTRAS = "hf,verify,accelerate,peft,lightning"
VERIFY = ["verify", "paramfsm.testing.subjects:tiny_transformer", "--examples", "3", "--no-shrink"]
KERNEL_SOURCES = ("*.cu", "*.cuh")


class CheckFailed(Exception):
    """A step found the package wrong; the message says what."""


def run(command: list, cwd: Path, env: dict | None = None, timeout: int = 600) -> str:
    """Run a command; its stdout, or CheckFailed with the end of its output when it fails."""
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise CheckFailed(f"{' '.join(map(str, command))} exited {done.returncode}:\n{tail}")
    return done.stdout


def checkout_files() -> list[str]:
    """The checkout's files that git tracks or would track, relative to it."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], REPO)
    files = sorted(name for name in set(listed.split("\0")) if name and (REPO / name).is_file())
    expect(bool(shipped_specs(files)), "the checkout has no specs/*.toml")
    return files


def shipped_specs(files: list[str]) -> list[str]:
    return [name for name in files if fnmatch(name, "specs/*.toml")]


def version() -> str:
    """``paramfsm.__version__``, read from the source as setuptools reads it."""
    tree = ast.parse((REPO / "paramfsm" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise CheckFailed("paramfsm/__init__.py sets no __version__")


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


# ------------------------------------------------------------------------ steps


def build(files: list[str], work: Path) -> tuple[Path, Path]:
    """The sdist and the wheel built from it, made from a copy of ``files``."""
    source = work / "source"
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    run([sys.executable, "-m", "build", "--outdir", work / "dist", source], work, timeout=300)
    sdists, wheels = sorted((work / "dist").glob("*.tar.gz")), sorted((work / "dist").glob("*.whl"))
    expect(len(sdists) == 1 and len(wheels) == 1, f"expected one sdist and one wheel, got {sdists + wheels}")
    return sdists[0], wheels[0]


def check_sdist(sdist: Path, specs: list[str]) -> str:
    root = f"paramfsm-{version()}"
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
        for spec in specs:
            member = f"{root}/{spec}"
            expect(member in names, f"the sdist has no {spec}")
            expect(archive.extractfile(member).read() == (REPO / spec).read_bytes(), f"the sdist's {spec} differs")
    return f"{sdist.name}: {', '.join(specs)}"


def wheel_expected(files: list[str]) -> dict[str, Path]:
    """Path in the wheel -> the checkout file it must equal, for everything under ``paramfsm/``."""
    packaged = [name for name in files if fnmatch(name, "paramfsm/*.py")
                or any(fnmatch(name, f"paramfsm/engine/effects/kernels/{pattern}") for pattern in KERNEL_SOURCES)]
    expected = {name: REPO / name for name in packaged}
    expected.update({f"paramfsm/{name}": REPO / name for name in shipped_specs(files)})
    return expected


def check_wheel(wheel: Path, files: list[str]) -> str:
    dist_info = f"paramfsm-{version()}.dist-info"
    expected = wheel_expected(files)
    expect(any(name.endswith(".cu") for name in expected), "no CUDA kernel source found in the checkout")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        package = {name for name in names if not name.startswith(dist_info + "/")}
        missing, extra = sorted(set(expected) - package), sorted(package - set(expected))
        expect(not missing, f"the wheel lacks {missing}")
        expect(not extra, f"the wheel has files it should not: {extra}")
        differ = [name for name, source in expected.items() if archive.read(name) != source.read_bytes()]
        expect(not differ, f"the wheel's copies differ from the checkout's: {differ}")
        expect(archive.read(f"{dist_info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes(), "no LICENSE")
        metadata = Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode("utf-8"))
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode("utf-8")
    expect(metadata["Version"] == version(), f"metadata version {metadata['Version']} is not {version()}")
    for field in ("Summary", "License-Expression", "Requires-Python"):
        expect(bool(metadata[field]), f"the metadata has no {field}")
    extras = set(metadata.get_all("Provides-Extra") or ())
    expect({"hf", "verify", "cuda", "test", "accelerate", "peft", "lightning"} <= extras, f"the metadata's extras are {sorted(extras)}")
    expect("paramfsm = paramfsm.cli:main" in entry_points, "no paramfsm console script")
    specs = sorted(name for name in expected if name.startswith("paramfsm/specs/"))
    return f"{wheel.name}: {len(expected)} files ({', '.join(specs)}), version {version()}"


def environment(work: Path) -> dict:
    """The variables the new environment's commands run with: its bin/ first, no path into the checkout."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env.update(PATH=f"{work / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONNOUSERSITE="1",
               VIRTUAL_ENV=str(work / "venv"))
    return env


def install(wheel: Path, work: Path) -> str:
    venv = work / "venv"
    run([sys.executable, "-m", "venv", venv], work)
    python = venv / "bin" / "python"
    # --no-compile: byte-compiling all of torch up front takes longer than compiling what the checks import.
    run([python, "-m", "pip", "install", "--quiet", "--no-compile", f"{wheel}[{EXTRAS}]", TORCH], work,
        environment(work))
    return f"{wheel.name}[{EXTRAS}] and {TORCH} into {venv}"


def smoke(work: Path) -> str:
    shutil.copy2(REPO / ".ci" / "wheel_smoke.py", work / "run")
    return run([work / "venv" / "bin" / "python", "wheel_smoke.py", REPO], work / "run", environment(work)).strip()


def command(args: list[str], work: Path, needle: str) -> str:
    out = run([work / "venv" / "bin" / "paramfsm", *args], work / "run", environment(work), timeout=300)
    expect(needle in out, f"paramfsm {' '.join(args)} printed no {needle!r}:\n{out[-2000:]}")
    return out.strip().splitlines()[-1][:160]


# ------------------------------------------------------------------------ main


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="paramfsm-wheel-"))
    (work / "run").mkdir()
    results: list[bool] = []

    def step(name: str, action, *args, fatal: bool = False):
        start = time.monotonic()
        try:
            value = action(*args)
        except (CheckFailed, subprocess.TimeoutExpired) as exc:
            print(f"[check-wheel] FAIL {name} ({time.monotonic() - start:.1f}s): {exc}", flush=True)
            results.append(False)
            if fatal:
                raise
            return None
        detail = value if isinstance(value, str) else ""
        print(f"[check-wheel] ok {name} ({time.monotonic() - start:.1f}s) {detail}".rstrip(), flush=True)
        results.append(True)
        return value

    started = time.monotonic()
    try:
        files = step("list the checkout's files", checkout_files, fatal=True)
        specs = shipped_specs(files)
        sdist, wheel = step("python -m build (sdist, then the wheel from it)", build, files, work, fatal=True)
        step("sdist contents", check_sdist, sdist, specs)
        step("wheel contents and metadata", check_wheel, wheel, files)
        step("install into a new virtual environment", install, wheel, work, fatal=True)
        step("import, data files, one-rank training", smoke, work)
        step("paramfsm --help", command, ["--help"], work, "spec")
        step("paramfsm spec check", command, ["spec", "check"], work, "OK: ")
        step(f"paramfsm {' '.join(VERIFY)}", command, VERIFY, work, "OK: ")
    except (CheckFailed, subprocess.TimeoutExpired):
        pass
    failed = results.count(False)
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    print(f"[check-wheel] {time.monotonic() - started:.0f}s in all" + (f"; files kept in {work}" if failed else ""))
    print(f"check-wheel: {results.count(True)} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
