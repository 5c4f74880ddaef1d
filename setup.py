"""Build hook: the wheel carries the shipped spec, ``specs/*.toml``, as package data in ``paramfsm/specs/``.

``specs/`` stays at the top of the repository, where users read it, and is the one copy in version
control: ``build_py`` copies it into the build tree, never into the source tree, so no second copy can
drift. An editable install copies nothing (``paramfsm.core.spec.shipped_spec`` reads the checkout's
``specs/`` then). The sdist carries ``specs/`` through MANIFEST.in, so a wheel built from it has the
spec too. Everything else about the package is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SPECS = Path(__file__).resolve().parent / "specs"


class BuildPyWithSpecs(build_py):
    """``build_py`` that also puts ``specs/*.toml`` into ``paramfsm/specs/`` of the build tree."""

    def _spec_outputs(self) -> dict[str, str]:
        """Build-tree path -> source path of each shipped spec; a build without one fails here."""
        sources = sorted(SPECS.glob("*.toml"))
        if not sources:
            raise FileNotFoundError(f"no spec to ship: {SPECS}/ has no *.toml (an sdist gets it from MANIFEST.in)")
        target = Path(self.build_lib, "paramfsm", "specs")
        return {str(target / source.name): str(source) for source in sources}

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for output, source in self._spec_outputs().items():
            self.mkpath(str(Path(output).parent))
            self.copy_file(source, output)

    def get_output_mapping(self) -> dict[str, str]:
        return {**super().get_output_mapping(), **self._spec_outputs()}

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, *self._spec_outputs()]


setup(cmdclass={"build_py": BuildPyWithSpecs})
