"""Griffe extension: mount the repository's passes/ folder as amp_compiler.passes, as setuptools installs it."""
import re
from pathlib import Path

import griffe


def _escape_subscripts(text: str) -> str:
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):   # outside code spans
        pieces[i] = re.sub(r"\]\[", r"]\\[", pieces[i])
    return "`".join(pieces)


class MountPasses(griffe.Extension):
    def on_package(self, *, pkg, loader, **kwargs):
        if pkg.name != "amp_compiler" or "passes" in pkg.members:
            return
        folder = Path(pkg.filepath).parent.parent / "passes"
        passes = griffe.load(folder, search_paths=[folder.parent], docstring_parser=loader.docstring_parser,
                             extensions=loader.extensions)
        pkg.set_member("passes", passes)

    def on_object(self, *, obj, loader, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _escape_subscripts(obj.docstring.value)
