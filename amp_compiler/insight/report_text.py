"""Plain-text layout shared by explain() and diff(): rows grouped by module, repeated blocks folded,
long lists of module paths summarised.

    layers.0.attention
      linear     query  linear   float16  allow: dense matmul ...
    layers.1 through layers.11: same decisions as layers.0 (11 blocks of 62 rows)
"""
from __future__ import annotations

import re
import textwrap
from collections import defaultdict

WIDTH = 100
_DIGITS = re.compile(r"\d+")


def wrapped(label: str, items: list[str], width: int = WIDTH) -> list[str]:
    """"label: a, b, c" wrapped to `width` columns, continuation lines indented."""
    return textwrap.wrap(f"{label}: {', '.join(items)}", width, subsequent_indent="    ",
                         break_on_hyphens=False, break_long_words=False)


def summarise_paths(paths: list[str]) -> list[str]:
    """Module paths with numbered repeats folded: layers.0.key ... layers.11.key -> layers.[0-11].key,
    then siblings joined: layers.[0-11].{key,query,value}."""
    by_pattern: dict[tuple, list[int]] = defaultdict(list)
    order: list[tuple] = []
    for path in paths:
        parts = path.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        key = (tuple(parts[:index]), tuple(parts[index + 1:])) if index is not None else (tuple(parts), None)
        if key not in by_pattern:
            order.append(key)
        by_pattern[key].append(int(parts[index]) if index is not None else -1)
    folded = []
    for head, tail in order:
        if tail is None:
            folded.append(".".join(head))
            continue
        numbers = sorted(set(by_pattern[(head, tail)]))
        folded.append(".".join([*head, _number_set(numbers), *tail]))
    siblings: dict[str, list[str]] = defaultdict(list)
    for path in folded:
        parent, _, name = path.rpartition(".")
        siblings[parent].append(name)
    summary = []
    for parent, names in siblings.items():
        if parent and len(names) > 1:
            summary.append(f"{parent}.{{{','.join(names)}}}")
        else:
            summary += [f"{parent}.{name}" if parent else name for name in names]
    return summary


def _number_set(numbers: list[int]) -> str:
    if len(numbers) == 1:
        return str(numbers[0])
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"[{numbers[0]}-{numbers[-1]}]"
    return "[" + ",".join(map(str, numbers)) + "]"


def block_of(module: str) -> str | None:
    """The numbered block a module path lies in: layers.3.attention.query -> layers.3 (None if none)."""
    parts = module.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if index is None else ".".join(parts[:index + 1])


def _relative(module: str, group: str) -> str:
    return module[len(group) + 1:] if group and module.startswith(group + ".") else ("" if module == group else module)


def module_table(rows: list[dict], columns: list[str], leaf_modules=(), fold: bool = True) -> list[str]:
    """Rows grouped by module path (a leaf module's rows under its parent, named in the "where" column),
    numbered blocks whose rows repeat an earlier block's folded into one line. The last column is free
    width; the others are padded. Rows are dicts with "module" and the columns' keys."""
    leaves = set(leaf_modules)
    sections: list[tuple[str, dict[str, list[dict]]]] = []    # in graph order: a new one where the key changes
    for row in rows:
        module = row["module"]
        group = module.rpartition(".")[0] if module in leaves else module
        key = block_of(group) or group
        if not sections or sections[-1][0] != key:
            sections.append((key, {}))
        sections[-1][1].setdefault(group, []).append({**row, "where": _relative(module, group)})
    grouped = [r for _, groups in sections for group_rows in groups.values() for r in group_rows]
    widths = {c: min(32, max([len(str(r.get(c, ""))) for r in grouped] + [len(c)])) for c in columns[:-1]}
    if not any(r["where"] for r in grouped):
        columns = [c for c in columns if c != "where"]
    lines, first_with_signature = [], {}
    run: list[tuple[str, str, int]] = []     # consecutive folded blocks: (reference, block, rows)

    def flush_run():
        if run:
            reference, first, rows_each = run[0]
            span = first if len(run) == 1 else f"{first} through {run[-1][1]}"
            count = "" if len(run) == 1 else f"{len(run)} blocks of "
            lines.append(f"{span}: same decisions as {reference} ({count}{rows_each} rows)")
            run.clear()

    for key, groups in sections:
        signature = (_DIGITS.sub("#", key), tuple(_row_signature(r, g, key, columns)
                                                  for g, group_rows in groups.items() for r in group_rows))
        reference = first_with_signature.setdefault(signature, key)
        if fold and reference != key:
            if run and run[0][0] != reference:
                flush_run()
            run.append((reference, key, sum(len(group_rows) for group_rows in groups.values())))
            continue
        flush_run()
        for group, group_rows in groups.items():
            lines.append(group or "(top level)")
            for r in group_rows:
                cells = [f"{str(r.get(c, '')):<{widths[c]}}" for c in columns[:-1]] + [str(r.get(columns[-1], ""))]
                lines.append(("  " + "  ".join(cells)).rstrip())
    flush_run()
    return lines


def _row_signature(row: dict, group: str, block: str, columns: list[str]) -> tuple:
    # node names and rules mention the block's number (linear_4, layers_3_norm): compare without digits;
    # a cast's rule names the value it casts (matmul, matmul_2), its op and dtype say all
    ignored = ("node", "rule") if row.get("op") == "cast" else ("node",)
    return (_relative(group, block),) + tuple(_DIGITS.sub("#", str(row.get(c, ""))) for c in columns
                                              if c not in ignored)
