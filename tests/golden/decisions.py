"""What a conversion decided, recorded so that a refactor can be checked against it (tests/golden/).

A record is, per converted graph of the result (the module itself, or each converted child of a model
that runs as written): the generated code and one decision per node (name, canonical op, precision,
rule). A conversion that raises records the error instead. `first_difference` says where two records part.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
from pathlib import Path

import torch
import torch.fx as fx

GOLDEN = Path(__file__).with_name("decisions.json.gz")
ZOO_LEVELS = ("O0", "O1", "O2", "O3")
ZOO_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def zoo_conversion(name: str, level: str, dtype: torch.dtype):
    """A zoo model converted as every zoo record is (or the exception convert() raised)."""
    from amp_compiler import convert
    from models import build

    task = build(name, size="small", seed=0)
    try:
        return convert(task.model, level, dtype=dtype, example_inputs=task.example_inputs)
    except Exception as error:  # noqa: BLE001 - recorded
        return error


def record(converted) -> dict:
    """The record of `converted`: a convert() result, or the exception the conversion raised."""
    if isinstance(converted, BaseException):
        return {"error": f"{type(converted).__name__}: {str(converted).splitlines()[0] if str(converted) else ''}"}
    graphs = {}
    for path, module in converted.named_modules():
        if isinstance(module, fx.GraphModule):
            code = module.code
            graphs[path] = {"sha256": hashlib.sha256(code.encode()).hexdigest(), "code": code,
                            "nodes": [_decision(node) for node in module.graph.nodes]}
    return {"graphs": graphs}


REPOSITORY = str(Path(__file__).resolve().parents[2])


def _decision(node) -> list:
    """A rule may quote the user's source line with its file (an opaque call's TraceError): the checkout's own
    folder is recorded as <repo>, so a clone elsewhere (CI's) records the same."""
    amp = node.meta.get("amp", {})
    rule = amp.get("rule")
    if isinstance(rule, str):
        rule = rule.replace(REPOSITORY, "<repo>")
    return [node.name, amp.get("op"), amp.get("precision"), rule]


@functools.cache
def load() -> dict:
    with gzip.open(GOLDEN, "rt", encoding="utf-8") as file:
        return json.load(file)


def save(records: dict) -> None:
    text = json.dumps(dict(sorted(records.items())), separators=(",", ":"), sort_keys=True)
    with gzip.GzipFile(GOLDEN, "wb", mtime=0) as file:   # mtime=0: the same records give the same bytes
        file.write(text.encode("utf-8"))


def first_difference(key: str, old: dict, new: dict) -> str | None:
    """None when `new` matches `old`, else one message: the first node whose decision differs, else the first
    node added or removed, else the first line of generated code that differs."""
    if "error" in old or "error" in new:
        if old.get("error") != new.get("error"):
            return f"{key}: conversion was {old.get('error', 'ok')!r}, now {new.get('error', 'ok')!r}"
        return None
    if set(old["graphs"]) != set(new["graphs"]):
        return f"{key}: converted graphs were {sorted(old['graphs'])}, now {sorted(new['graphs'])}"
    for path, was in old["graphs"].items():
        now, where = new["graphs"][path], f"{key}{f' ({path})' if path else ''}"
        difference = _first_decision_difference(was["nodes"], now["nodes"])
        if difference:
            return f"{where}: {difference}"
        if was["sha256"] != now["sha256"]:
            old_lines, new_lines = was["code"].splitlines(), now["code"].splitlines()
            line = next((i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b),
                        min(len(old_lines), len(new_lines)))
            shown = lambda lines: lines[line].strip() if line < len(lines) else "<end of code>"   # noqa: E731
            return (f"{where}: same decisions, generated code differs at line {line + 1}\n"
                    f"  old {shown(old_lines)}\n  new {shown(new_lines)}")
    return None


def _first_decision_difference(old: list, new: list) -> str | None:
    """The first node (in the old graph's order) whose decision changed, else the first node added or removed
    (a cast the change inserts or folds away is reported after the decision that caused it)."""
    new_by_name = {decision[0]: decision for decision in new}
    old_names = {decision[0] for decision in old}
    for decision in old:
        now = new_by_name.get(decision[0])
        if now is not None and now != decision:
            return f"decision of node {decision[0]} differs\n  old {_shown(decision)}\n  new {_shown(now)}"
    for decision in old:
        if decision[0] not in new_by_name:
            return f"node removed: {_shown(decision)}"
    for decision in new:
        if decision[0] not in old_names:
            return f"node added: {_shown(decision)}"
    return None


def _shown(decision: list) -> str:
    name, op, precision, rule = decision
    return f"{name} ({op}): precision {precision}, rule {rule!r}"
