"""Names a user gives (op lists, ONNX block lists) checked against the names that exist, so a typo is an
error with the nearest names rather than a rule that silently matches nothing.

    check_known_names("deny_ops", ["softmx"], known, kind="known ops")
    ValueError: deny_ops names ['softmx'], which are not known ops; nearest: softmx -> 'softmax', 'softmin'
"""
from __future__ import annotations

import difflib
from typing import Iterable


def check_known_names(what: str, names: Iterable[str], known: Iterable[str], *, kind: str, hint: str = "") -> None:
    """Raise ValueError naming every one of `names` not in `known`, each with its closest known names."""
    known = sorted(set(known))
    unknown = [name for name in names if name not in known]
    if not unknown:
        return
    nearest = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6) or \
            difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.6)
        if close:
            nearest.append(f"{name} -> {', '.join(map(repr, close))}")
    suggest = f"; nearest: {'; '.join(nearest)}" if nearest else ""
    raise ValueError(f"{what} names {unknown}, which are not {kind}{suggest}" + (f"\n{hint}" if hint else ""))
