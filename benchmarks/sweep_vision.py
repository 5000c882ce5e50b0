"""Coverage sweep: every torchvision classification, segmentation and video model under 150M parameters and
the smallest model of each timm family, random init, converted and compared against torch.autocast.

    python benchmarks/sweep_vision.py                       # everything (an hour or more on a laptop CPU)
    python benchmarks/sweep_vision.py --limit 5             # the first 5 models
    python benchmarks/sweep_vision.py --only resnet18,timm:convnext_atto
    python benchmarks/sweep_vision.py --source timm --level O2 --dtype fp16 --timeout 300

Each model runs in its own subprocess (a crash or a hang costs one row) with a timeout. Per model it
builds the network (weights=None; batch-norm statistics set from a random batch, else random-init CNNs
shrink their outputs towards 0), makes a seeded input of the model's own input size, runs fp32, then
torch.autocast("cpu", dtype), then convert(level, dtype, example_inputs=...) and the converted module, and
records the first failing check as the cause:

    autocast fails   torch.autocast itself cannot run the model (not counted against us)
    build/input      the model or its input could not be made (not counted against us)
    convert: E       convert() raised E            run: E       the converted module raised E
    output type      another output type or structure than the model's (OrderedDict -> dict, ...)
    error            max |ours - fp32| > 2 x max |autocast - fp32| (floor: one rounding to the dtype)
    verify: E        amp_compiler.verify found a node whose real dtype is not the recorded one
    slow             inference time ours / autocast > 1.5 (median of --rounds alternating calls)
    timeout, crash   the subprocess ran out of time / died

Not run in CI (too slow); run it before closing a front-end or policy change. Prints one row per model
as it finishes (with convert()'s seconds and the row's, build and timing included), then the totals per
source and the failures grouped by cause.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # models/ is not installed

MAX_PARAMS = 150e6
SLOWDOWN_LIMIT = 1.5
AUTOCAST_SLACK = 2.0
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
TV_MODULES = ("", "segmentation", "video")     # classification, segmentation, video
SEGMENTATION_SIZE = 224
VIDEO_FRAMES = 8


# ------------------------------------------------------------------------------------------ enumeration
def _torchvision():
    from models.torchvision_ops import import_torchvision
    return import_torchvision()


def torchvision_models(max_params: float):
    """(spec, params) for the torchvision models under `max_params`, counted from the weights' metadata."""
    tv = _torchvision()
    for submodule in TV_MODULES:
        module = getattr(tv.models, submodule) if submodule else tv.models
        for name in tv.models.list_models(module=module):
            params = _tv_params(tv, name)
            if params is not None and params < max_params:
                yield f"tv:{name}", params


def _tv_params(tv, name: str):
    try:
        return list(tv.models.get_model_weights(name))[0].meta["num_params"]
    except Exception:  # noqa: BLE001 - a model without weights metadata: count it on the meta device
        import torch
        with torch.device("meta"):
            return sum(p.numel() for p in tv.models.get_model(name, weights=None).parameters())


def timm_models(max_params: float):
    """(spec, params): the model with the fewest parameters of each timm family (registering module),
    counted on the meta device (nothing is allocated or downloaded); timm's `test_*` models (unit-test
    miniatures) only where a family has nothing else."""
    _torchvision()                               # timm imports torchvision
    import timm
    import torch
    for family in timm.list_modules():
        best = None
        names = timm.list_models(module=family)
        for name in [n for n in names if not n.startswith("test_")] or names:
            try:
                with torch.device("meta"):
                    params = sum(p.numel() for p in timm.create_model(name, pretrained=False).parameters())
            except Exception:  # noqa: BLE001 - some models cannot be built on the meta device
                continue
            if params < max_params and (best is None or params < best[1]):
                best = (name, params)
        if best is not None:
            yield f"timm:{best[0]}", best[1]


def select(args):
    """The models to sweep, lazily (--limit stops the enumeration early)."""
    if args.only:
        for name in args.only.split(","):
            name = name.strip()
            yield (name if ":" in name else _qualify(name)), None
        return
    sources = {"torchvision": torchvision_models, "timm": timm_models}
    count = 0
    for source in (("torchvision", "timm") if args.source == "all" else (args.source,)):
        for item in sources[source](args.max_params):
            if args.limit is not None and count >= args.limit:
                return
            count += 1
            yield item


def _qualify(name: str) -> str:
    tv = _torchvision()
    return f"tv:{name}" if name in tv.models.list_models() else f"timm:{name}"


# --------------------------------------------------------------------------------------------- worker
def build(spec: str, batch: int):
    """(model in eval mode, positional inputs) for `spec` ("tv:name" or "timm:name"), seeded."""
    import torch
    torch.manual_seed(0)
    source, name = spec.split(":", 1)
    generator = torch.Generator().manual_seed(1)
    if source == "tv":
        tv = _torchvision()
        kind = _tv_kind(tv, name)
        kwargs = {"weights": None}
        if kind == "segmentation":
            kwargs["weights_backbone"] = None
        model = tv.models.get_model(name, **kwargs).eval()
        weights = list(tv.models.get_model_weights(name))[0]
        min_size = weights.meta.get("min_size", (1, 1))
        if kind == "segmentation":
            shape = (batch, 3, max(SEGMENTATION_SIZE, min_size[0]), max(SEGMENTATION_SIZE, min_size[1]))
        else:
            crop = list(weights.transforms().crop_size)
            height, width = (crop * 2)[:2]
            if kind == "video":
                frames = max(VIDEO_FRAMES, weights.meta.get("min_temporal_size", 1))
                shape = (batch, 3, frames, height, width)
            else:
                shape = (batch, 3, height, width)
    elif source == "timm":
        import timm
        model = timm.create_model(name, pretrained=False).eval()
        shape = (batch, *model.pretrained_cfg.get("input_size", (3, 224, 224)))
    else:
        raise ValueError(f"unknown source {source!r} in {spec!r} (expected tv: or timm:)")
    calibration = torch.Generator().manual_seed(2)
    calibrate_batch_norm(model, lambda n: torch.randn(n, *shape[1:], generator=calibration))
    return model, (torch.randn(*shape, generator=generator),)


CALIBRATION_BATCH = 4


def calibrate_batch_norm(model, make_input) -> None:
    """Running statistics of every batch norm set from one batch, as training would (a copy of
    tests/real_models.py's): with fresh statistics (mean 0, variance 1) deep random-init CNNs shrink their
    activations towards 0 layer after layer, and the error comparison would be vacuous."""
    import torch
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for module in norms:
        module.reset_running_stats()
        module.momentum, module.training = None, True
    with torch.no_grad():
        model(make_input(CALIBRATION_BATCH))
    for module, momentum in zip(norms, momenta):
        module.momentum, module.training = momentum, False


def _tv_kind(tv, name: str) -> str:
    for kind in ("segmentation", "video"):
        if name in tv.models.list_models(module=getattr(tv.models, kind)):
            return kind
    return "classification"


def _float_leaves(output):
    import torch
    from torch.utils import _pytree as pytree
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _max_error(output, reference) -> float:
    return max(((a.float() - b.float()).abs().max().item() for a, b in zip(_float_leaves(output),
                                                                         _float_leaves(reference))), default=0.0)


def _same_structure(output, reference) -> str | None:
    from torch.utils import _pytree as pytree
    if type(output) is not type(reference):
        return f"{type(output).__name__} for {type(reference).__name__}"
    if pytree.tree_structure(output) != pytree.tree_structure(reference):
        return "another output tree"
    for a, b in zip(_float_leaves(output), _float_leaves(reference)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{a.dtype}{list(a.shape)} for {b.dtype}{list(b.shape)}"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def freeze_garbage() -> None:
    """Collect, then freeze what survives, before timing: the garbage convert() leaves otherwise triggers
    gen-2 collections inside the timed calls (pauses of 0.2-4 s seen on Swin-V2)."""
    gc.collect()
    gc.freeze()


def _median_times(first, second, inputs, rounds: int) -> tuple[float, float]:
    """Median seconds per call of `first` and `second`, alternated so machine load hits both alike."""
    import torch
    times = ([], [])
    freeze_garbage()
    with torch.no_grad():
        first(*inputs), second(*inputs)          # warm-up: kernel selection, allocator
        for _ in range(rounds):
            for index, call in enumerate((first, second)):
                started = time.perf_counter()
                call(*inputs)
                times[index].append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def worker(args) -> dict:
    _torchvision()                               # before timm/transformers import torchvision
    import torch
    import amp_compiler
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    row = {"name": args.worker}
    try:
        model, inputs = build(args.worker, args.batch)
    except Exception as error:  # noqa: BLE001
        return {**row, "status": "skipped", "cause": "build/input", "detail": _first_line(error)}
    row["params"] = sum(p.numel() for p in model.parameters())
    row["input"] = list(inputs[0].shape)
    autocast_model = lambda *x: _autocast_call(model, dtype, *x)  # noqa: E731
    with torch.no_grad():
        reference = model(*inputs)
        try:
            autocast = autocast_model(*inputs)
        except Exception as error:  # noqa: BLE001
            return {**row, "status": "skipped", "cause": "autocast fails", "detail": _first_line(error)}
    row["error_autocast"] = _max_error(autocast, reference)
    scale = max((t.abs().max().item() for t in _float_leaves(reference)), default=0.0)
    row["scale"] = scale
    started = time.perf_counter()
    try:
        gm = amp_compiler.convert(model, args.level, dtype=dtype, example_inputs=inputs)
    except Exception as error:  # noqa: BLE001
        return {**row, "status": "fail", "cause": f"convert: {type(error).__name__}", "detail": _first_line(error)}
    row["convert_s"] = time.perf_counter() - started
    try:
        with torch.no_grad():
            output = gm(*inputs)
    except Exception as error:  # noqa: BLE001
        return {**row, "status": "fail", "cause": f"run: {type(error).__name__}", "detail": _first_line(error)}
    row["error_ours"] = _max_error(output, reference)
    ours_time, autocast_time = _median_times(gm, autocast_model, inputs, args.rounds)
    row["time_ratio"] = ours_time / autocast_time if autocast_time > 0 else math.inf
    row["time_ours_ms"], row["time_autocast_ms"] = 1e3 * ours_time, 1e3 * autocast_time
    mismatch = _same_structure(output, reference)
    if mismatch:
        return {**row, "status": "fail", "cause": "output type", "detail": mismatch}
    bound = max(AUTOCAST_SLACK * row["error_autocast"], UNIT_ROUNDOFF[args.dtype] * scale)
    if not math.isfinite(row["error_ours"]) or row["error_ours"] > bound:
        return {**row, "status": "fail", "cause": "error",
                "detail": f"{row['error_ours']:.3g} > {bound:.3g} (autocast {row['error_autocast']:.3g})"}
    verify = getattr(amp_compiler, "verify", None)
    if verify is not None:
        try:
            verify(gm, *inputs)
        except Exception as error:  # noqa: BLE001
            return {**row, "status": "fail", "cause": f"verify: {type(error).__name__}", "detail": _first_line(error)}
    if row["time_ratio"] > SLOWDOWN_LIMIT:
        return {**row, "status": "fail", "cause": "slow",
                "detail": f"{row['time_ours_ms']:.1f} ms vs autocast {row['time_autocast_ms']:.1f} ms"}
    return {**row, "status": "pass", "cause": "", "detail": ""}


def _autocast_call(model, dtype, *inputs):
    import torch
    with torch.autocast("cpu", dtype=dtype):
        return model(*inputs)


# --------------------------------------------------------------------------------------------- parent
def run_one(spec: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", spec, "--level", args.level,
               "--dtype", args.dtype, "--batch", str(args.batch), "--rounds", str(args.rounds),
               "--threads", str(args.threads)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"name": spec, "status": "fail", "cause": "timeout", "detail": f"> {args.timeout} s"}
    finally:
        elapsed = time.perf_counter() - started
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return {**json.loads(line), "seconds": elapsed}
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"name": spec, "status": "fail", "cause": "crash", "detail": f"exit {done.returncode}: {last[:200]}",
            "seconds": elapsed}


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def print_row(row: dict) -> None:
    params = row.get("params")
    verdict = row["status"] if not row["cause"] else f"{row['status']}: {row['cause']}"
    print(f"{row['name']:<44} {_fmt(params / 1e6 if params else None, '7.1f')}M  {verdict:<32} "
          f"err {_fmt(row.get('error_ours'), '9.3g')} / autocast {_fmt(row.get('error_autocast'), '9.3g')} "
          f"(scale {_fmt(row.get('scale'), '8.3g')})  "
          f"time x{_fmt(row.get('time_ratio'), '5.2f')}  convert {_fmt(row.get('convert_s'), '6.1f')} s "
          f"(row {_fmt(row.get('seconds'), '6.1f')} s)  {row.get('detail', '')[:90]}", flush=True)


def summarize(rows: list[dict]) -> None:
    print("\nper source: pass / fail / skipped (autocast fails, build)")
    by_source = defaultdict(lambda: defaultdict(int))
    for row in rows:
        by_source[row["name"].split(":")[0]][row["status"]] += 1
    for source, counts in by_source.items():
        print(f"  {source:<6} {counts['pass']:4d} / {counts['fail']:4d} / {counts['skipped']:4d}")
    causes = defaultdict(list)
    for row in rows:
        if row["status"] != "pass":
            causes[row["cause"]].append(row["name"])
    if causes:
        print("\nnot passing, by cause:")
        for cause, names in sorted(causes.items(), key=lambda item: -len(item[1])):
            print(f"  {cause} ({len(names)}): {', '.join(names)}")
    ratios = [row["time_ratio"] for row in rows if isinstance(row.get("time_ratio"), float) and
              math.isfinite(row["time_ratio"])]
    if ratios:
        print(f"\ninference time ours / autocast: median x{statistics.median(ratios):.2f}, "
              f"worst x{max(ratios):.2f}, above x{SLOWDOWN_LIMIT}: {sum(r > SLOWDOWN_LIMIT for r in ratios)}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=None, help="sweep only the first N models")
    parser.add_argument("--only", default=None,
                        help="comma-separated models: torchvision or timm names, or tv:NAME / timm:NAME")
    parser.add_argument("--source", choices=("all", "torchvision", "timm"), default="all")
    parser.add_argument("--level", default="O1")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per variant (median)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in the worker (0: default)")
    parser.add_argument("--max-params", type=float, default=MAX_PARAMS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        import warnings
        warnings.filterwarnings("ignore")
        print(json.dumps(worker(args)), flush=True)
        return 0
    if args.limit is not None and args.limit < 1:
        raise SystemExit("--limit must be >= 1")
    print(f"sweep: {args.level} {args.dtype} against torch.autocast(cpu), batch {args.batch}, "
          f"timeout {args.timeout:g} s per model")
    rows = []
    for spec, _ in select(args):
        row = run_one(spec, args)
        rows.append(row)
        print_row(row)
    if not rows:
        print("no model selected")
        return 1
    summarize(rows)
    return 0 if all(row["status"] != "fail" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
