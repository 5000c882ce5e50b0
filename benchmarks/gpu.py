"""One command for a CUDA machine: amp-compiler against torch.autocast, printed as one table.

    python benchmarks/gpu.py                 # CUDA: zoo + ResNet-18 / BERT-base / GPT-2 / ViT-B/16, <= 8 minutes
    python benchmarks/gpu.py --dry-run       # CPU, tiny sizes, seconds: keeps this script from rotting

Sections (one row each, alternated runs, medians; "ratio" = ours / the baseline named in the row):
  train   fp16 and bf16 train step (forward, backward, SGD): ours O1 and ours O2 with the weights stored low
          (low_weights; + amp_compiler.GradScaler for fp16) against torch.autocast (+ torch.amp.GradScaler for fp16), and the floor of any cast placement: the
          whole model in fp16/bf16 with no cast at all (not a recipe: norms and softmax rounded)
  infer   latency per call, the dtype of --infer-dtype: fp32 eager, autocast, ours, ours frozen; and the
          dtype casts one call makes (aten._to_copy), autocast's included
  onnx    ONNX Runtime latency (CUDA provider when usable): fp32 export, export_onnx fp16, convert_onnx fp16
  compile torch.compile (inductor; "eager" backend with --dry-run) of autocast and of ours, inference
  fp8     pre-norm transformer blocks (hidden 4096, MLP 16384, 4096 tokens: GEMMs large enough for fp8 to gain;
          dry run: hidden 32 with fp8_min_dim=16), bf16 autocast the baseline. "fp8 train": SGD step of bf16
          autocast, ours bf16 O1, ours bf16 O2 stored weights, ours fp8 current / delayed / rowwise, and torchao's
          convert_to_float8_training (tensorwise, under bf16 autocast) when torchao imports. "fp8 infer": latency
          of autocast, ours bf16 O1 frozen, ours fp8 current / rowwise, frozen and not, torchao float8. "fp8
          compile": the train step and inference of autocast, ours fp8 and torchao float8 under torch.compile,
          with the other compiles at the end. A GPU below compute capability 8.9 (no fp8 GEMM) gets one
          "skipped" row per fp8 section saying so
Sections run in that order (fp8 after infer, before onnx). A global time budget (--budget-s, default 450 s) skips what is left, saying so,
so the run ends in time; the compiles, slowest to set up, go last.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import amp_compiler  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    inputs: tuple
    target: torch.Tensor
    loss_fn: Callable


@dataclass
class Settings:
    device: str
    dry_run: bool
    repeats: int
    budget_s: float
    started: float
    compile_backend: str

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.started > self.budget_s


def _logits_loss(out, target):
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def real_cases(dry_run: bool) -> list[Case]:
    """ResNet-18, ResNet-50 and BERT-base / GPT-2 shaped HF configs; with --dry-run a ResNet-10 and tiny widths."""
    from models.torchvision_ops import import_torchvision
    import_torchvision()   # transformers imports torchvision, whose C ops the CPU build lacks
    import transformers
    batch, image, seq = (2, 16, 8) if dry_run else (32, 224, 128)
    width, layers, heads = (16, 1, 2) if dry_run else (768, 12, 12)
    torch.manual_seed(0)
    from torchvision.models.resnet import BasicBlock, ResNet
    resnet = ResNet(BasicBlock, [1, 1, 1, 1] if dry_run else [2, 2, 2, 2], num_classes=10)   # ResNet-10 / -18
    cases = [Case("resnet18", resnet, (torch.randn(batch, 3, image, image),), torch.randint(0, 10, (batch,)),
                  _logits_loss)]
    if not dry_run:
        from torchvision.models.resnet import Bottleneck
        cases.append(Case("resnet50", ResNet(Bottleneck, [3, 4, 6, 3], num_classes=10),
                          (torch.randn(batch, 3, image, image),), torch.randint(0, 10, (batch,)), _logits_loss))
    tokens = torch.randint(0, 1000, (batch // 2 or 1, seq))
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=1000, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * width, num_labels=3))
    cases.append(Case("hf_bert", bert, (tokens,), torch.randint(0, 3, (tokens.shape[0],)), _logits_loss))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=1000, n_embd=width, n_layer=layers, n_head=heads, n_positions=max(seq, 16), bos_token_id=0,
        eos_token_id=0, use_cache=False))
    cases.append(Case("hf_gpt2", gpt2, (tokens,), tokens, _logits_loss))
    from torchvision.models import VisionTransformer, vit_b_16   # inference only: a cast once placed before a
    vit = (VisionTransformer(32, 16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)   # transpose cost 41x
           if dry_run else vit_b_16())
    images = torch.randn(batch // 2 or 1, 3, 32 if dry_run else 224, 32 if dry_run else 224)
    cases.append(Case("vit_b_16", vit, (images,), torch.randint(0, 1000, (images.shape[0],)), _logits_loss))
    return cases


def zoo_cases(dry_run: bool) -> list[Case]:
    cases = []
    for name in ("mlp",) if dry_run else ZOO_NAMES:
        task = build(name, size="small" if dry_run else "full")
        inputs, target = task.make_batch(0)
        cases.append(Case(name, task.model, inputs, target, task.loss_fn))
    return cases


def to_device(case: Case, device: str) -> Case:
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return Case(case.name, case.model.to(device), tuple(move(v) for v in case.inputs), move(case.target),
                case.loss_fn)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def alternate(runs: dict[str, Callable], settings: Settings) -> dict[str, float]:
    """Median milliseconds per call of each run, runs alternated so drift hits them alike."""
    for run in runs.values():
        for _ in range(1 if settings.dry_run else 3):
            run()
    _sync(settings.device)
    samples = {name: [] for name in runs}
    for _ in range(settings.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            _sync(settings.device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def train_rows(case: Case, dtype: torch.dtype, settings: Settings) -> list[list]:
    device, model = settings.device, case.model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    gm = amp_compiler.convert(model, "O1", dtype=dtype, example_inputs=case.inputs).train()
    fp16 = dtype == torch.float16
    ours_scaler = amp_compiler.GradScaler(device, enabled=fp16)
    their_scaler = torch.amp.GradScaler(device, enabled=fp16)

    def ours():
        optimizer.zero_grad(set_to_none=True)
        ours_scaler.scale(case.loss_fn(gm(*case.inputs), case.target)).backward()
        ours_scaler.step(optimizer)
        ours_scaler.update()

    def autocast():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = case.loss_fn(model(*case.inputs), case.target)
        their_scaler.scale(loss).backward()
        their_scaler.step(optimizer)
        their_scaler.update()

    # The floor of any cast placement: the whole model in `dtype`, no cast anywhere (not a recipe: no fp32
    # master weights, norms and softmax rounded); a copy, so the other two keep their fp32 weights.
    low_model = copy.deepcopy(model).to(dtype)
    low_optimizer = torch.optim.SGD(low_model.parameters(), lr=1e-4)
    low_inputs = tuple(v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for v in case.inputs)

    def no_cast():
        low_optimizer.zero_grad(set_to_none=True)
        case.loss_fn(low_model(*low_inputs), case.target).backward()
        low_optimizer.step()

    # O2 as Apex defines it: weights stored low between steps, the fp32 masters (a copy of the model) stepped
    o2_model = copy.deepcopy(model)
    o2_optimizer = torch.optim.SGD(o2_model.parameters(), lr=1e-4)
    o2_gm = amp_compiler.convert(o2_model, "O2", dtype=dtype, example_inputs=case.inputs).train()
    amp_compiler.low_weights(o2_gm, o2_optimizer)
    o2_scaler = amp_compiler.GradScaler(device, enabled=fp16)

    def ours_o2():
        o2_optimizer.zero_grad(set_to_none=True)
        o2_scaler.scale(case.loss_fn(o2_gm(*case.inputs), case.target)).backward()
        o2_scaler.step(o2_optimizer)
        o2_scaler.update()

    ms = alternate({"ours": ours, "ours O2": ours_o2, "autocast": autocast, "no cast": no_cast}, settings)
    label = f"train {str(dtype).removeprefix('torch.')}"
    return [[label, case.name, "ours O1", f"{ms['ours']:.3f}", f"{ms['ours'] / ms['autocast']:.2f} of autocast"],
            [label, case.name, "ours O2 stored weights", f"{ms['ours O2']:.3f}",
             f"{ms['ours O2'] / ms['autocast']:.2f} of autocast"],
            [label, case.name, "autocast+GradScaler" if fp16 else "autocast", f"{ms['autocast']:.3f}", ""],
            [label, case.name, "all low, no cast (floor)", f"{ms['no cast']:.3f}",
             f"{ms['no cast'] / ms['autocast']:.2f} of autocast"]]


def infer_rows(case: Case, dtype: torch.dtype, settings: Settings, compiled: bool = False) -> list[list]:
    """Latency per call: eager (fp32, autocast, ours, ours frozen) or, with `compiled`, torch.compile of both."""
    device, model = settings.device, case.model.eval()
    gm = amp_compiler.convert(model, "O1", dtype=dtype, example_inputs=case.inputs).eval()

    def autocast_of(run):
        def call(*args):
            with torch.autocast(device, dtype=dtype):
                return run(*args)
        return call

    if compiled:
        torch._dynamo.reset()
        calls = {"autocast+compile": autocast_of(torch.compile(model, backend=settings.compile_backend)),
                 "ours+compile": torch.compile(gm, backend=settings.compile_backend)}
    else:
        frozen = amp_compiler.convert(model, "O1", dtype=dtype, example_inputs=case.inputs, freeze=True).eval()
        calls = {"fp32 eager": model, "autocast": autocast_of(model), "ours": gm, "ours frozen": frozen}
    with torch.inference_mode():
        ms = alternate({name: (lambda run=run: run(*case.inputs)) for name, run in calls.items()}, settings)
        casts = {} if compiled else {name: _casts_per_call(run, case.inputs) for name, run in calls.items()}
    label = f"{'compile' if compiled else 'infer'} {str(dtype).removeprefix('torch.')}"
    baseline = {"ours": "autocast", "ours frozen": "autocast", "ours+compile": "autocast+compile"}
    return [[label, case.name, name, f"{ms[name]:.3f}",
             f"{ms[name] / ms[baseline[name]]:.2f} of {baseline[name]}" if name in baseline else "",
             casts.get(name, "")] for name in calls]


def _casts_per_call(run, inputs) -> int:
    """Dtype-changing casts one call makes on this device (autocast's own included)."""
    from bench_convert import CastCounter
    with CastCounter() as counter:
        run(*inputs)
    return counter.casts


class TransformerBlock(torch.nn.Module):
    """Pre-norm block: causal attention (one qkv linear, SDPA, an output projection) and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        batch, seq, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


FP8_SCALINGS = ("current", "delayed", "rowwise")


def fp8_case(dry_run: bool) -> tuple[Case, dict]:
    """Transformer blocks whose GEMMs gain from fp8 (4096 tokens x 4096 x 16384), and the fp8 options for them:
    the default fp8_min_dim (1024) on the GPU; 16 in the dry run, so its 32-wide linears take the fp8 path."""
    width, heads, layers, batch, seq = (32, 2, 1, 2, 8) if dry_run else (4096, 32, 2, 4, 1024)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(TransformerBlock(width, heads) for _ in range(layers)))
    case = Case(f"blocks d{width} x{layers}", model, (torch.randn(batch, seq, width),),
                torch.randn(batch, seq, width), lambda out, target: F.mse_loss(out.float(), target))
    return case, ({"fp8_min_dim": 16} if dry_run else {})


def fp8_unsupported(device: str) -> str | None:
    """Why this device runs no fp8 GEMM, or None. The CPU runs _scaled_mm (slowly): the dry run checks the code."""
    if device != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"skipped: {torch.cuda.get_device_name()} is sm_{major}{minor}, fp8 GEMMs need 8.9+ (Ada, Hopper)"
    return None


def torchao_float8() -> Callable | None:
    """torchao's float8 training conversion (tensorwise recipe, nn.Linear swapped in place), if torchao imports."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    return lambda model: convert_to_float8_training(model, config=config)


def _autocast_bf16(module, device: str) -> Callable:
    def call(*args):
        with torch.autocast(device, dtype=torch.bfloat16):
            return module(*args)
    return call


def _sgd_step(module, case: Case, device: str, autocast: bool = False, stored_low: bool = False) -> Callable:
    """One SGD train step of `module` (under bf16 autocast; with its weights stored low by low_weights)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)
    if stored_low:
        amp_compiler.low_weights(module, optimizer)
    forward = _autocast_bf16(module, device) if autocast else module

    def step():
        optimizer.zero_grad(set_to_none=True)
        case.loss_fn(forward(*case.inputs), case.target).backward()
        optimizer.step()
    return step


def fp8_variants(case: Case, fp8_options: dict, settings: Settings, compiled: bool, train: bool) -> dict:
    """name -> (module, runs under bf16 autocast) of one fp8 section. Ours share the model's weights; O2 and
    torchao (which swaps modules) get their own copies."""
    model = case.model.train(train)
    convert = lambda level, **options: amp_compiler.convert(  # noqa: E731
        model, level, example_inputs=case.inputs, **options).train(train)
    fp8 = lambda scaling, **options: convert("fp8", fp8_scaling=scaling, **fp8_options, **options)  # noqa: E731
    to_float8 = torchao_float8()
    if compiled:
        variants = {"autocast bf16": (model, True), "ours fp8 current": (fp8("current", freeze=not train), False)}
        if to_float8:
            variants["torchao float8 tensorwise"] = (to_float8(copy.deepcopy(model)), True)
        torch._dynamo.reset()
        return {f"{name} + compile": (torch.compile(module, backend=settings.compile_backend), autocast)
                for name, (module, autocast) in variants.items()}
    if train:
        variants = {"autocast bf16": (model, True), "ours bf16 O1": (convert("O1", dtype=torch.bfloat16), False),
                    "ours bf16 O2 stored weights": (amp_compiler.convert(
                        copy.deepcopy(model), "O2", dtype=torch.bfloat16, example_inputs=case.inputs).train(), False)}
        variants.update({f"ours fp8 {scaling}": (fp8(scaling), False) for scaling in FP8_SCALINGS})
    else:
        variants = {"autocast bf16": (model, True),
                    "ours bf16 O1 frozen": (convert("O1", dtype=torch.bfloat16, freeze=True), False)}
        for scaling in ("current", "rowwise"):
            variants[f"ours fp8 {scaling}"] = (fp8(scaling), False)
            variants[f"ours fp8 {scaling} frozen"] = (fp8(scaling, freeze=True), False)
    if to_float8:
        variants["torchao float8 tensorwise"] = (to_float8(copy.deepcopy(model)), True)
    return variants


def fp8_rows(case: Case, fp8_options: dict, settings: Settings, compiled: bool = False) -> list[list]:
    """The fp8 section: train steps (SGD) and inference latency against bf16 autocast (module docstring)."""
    label = f"fp8 {'compile' if compiled else ''}".strip()
    unsupported = fp8_unsupported(settings.device)
    if unsupported:
        return [[label, case.name, unsupported, "", ""]]
    device, rows = settings.device, []
    for train in (True, False):
        variants = fp8_variants(case, fp8_options, settings, compiled, train)
        if train:
            runs = {name: _sgd_step(module, case, device, autocast, stored_low="O2" in name)
                    for name, (module, autocast) in variants.items()}
            ms = alternate(runs, settings)
        else:
            with torch.no_grad():   # torchao's Float8Linear under inference_mode + autocast: aten.to unsupported
                ms = alternate({name: (lambda call=_autocast_bf16(module, device) if autocast else module:
                                       call(*case.inputs)) for name, (module, autocast) in variants.items()}, settings)
        baseline = next(iter(ms))   # autocast bf16 (+ compile)
        rows += [[f"{label} {'train' if train else 'infer'}", case.name, name, f"{ms[name]:.3f}",
                  f"{ms[name] / ms[baseline]:.2f} of {baseline}" if name != baseline else ""] for name in ms]
    return rows


def onnx_rows(case: Case, settings: Settings) -> list[list]:
    from amp_compiler.onnx.export import export_fp32_reference
    from amp_compiler.onnx.sessions import execution_providers, make_session
    model, inputs = case.model.cpu().eval(), tuple(v.cpu() for v in case.inputs)
    provider = execution_providers()[0].removesuffix("ExecutionProvider")
    with tempfile.TemporaryDirectory() as directory:
        paths = {name: os.path.join(directory, f"{name}.onnx") for name in ("fp32", "export_onnx", "convert_onnx")}
        export_fp32_reference(model, inputs, paths["fp32"])
        amp_compiler.export_onnx(model, inputs, paths["export_onnx"], "O1", dtype=torch.float16)
        amp_compiler.convert_onnx(paths["fp32"], paths["convert_onnx"], "O1")
        runs = {}
        for name, path in paths.items():
            session = make_session(path)
            feeds = {i.name: v.numpy() for i, v in zip(session.get_inputs(), inputs)}
            runs[name] = lambda session=session, feeds=feeds: session.run(None, feeds)
        ms = alternate(runs, dataclasses.replace(settings, device="cpu"))   # ORT returns host arrays: no sync
    return [[f"onnx fp16 ({provider})", case.name, name, f"{ms[name]:.3f}",
             f"{ms[name] / ms['fp32']:.2f} of fp32" if name != "fp32" else ""] for name in runs]


def environment() -> str:
    """One line naming what the figures were measured with."""
    import onnxruntime
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}), {gpu}; onnxruntime {onnxruntime.__version__} "
            f"providers {onnxruntime.get_available_providers()}; {os.cpu_count()} CPU cores")


def print_table(rows: list[list], settings: Settings) -> None:
    from bench_convert import table
    where = torch.cuda.get_device_name() if settings.device == "cuda" else "CPU"
    table(f"amp-compiler vs torch.autocast on {where}, torch {torch.__version__}, median of {settings.repeats} "
          f"alternated runs{' (dry run: tiny sizes)' if settings.dry_run else ''}, "
          f"{time.perf_counter() - settings.started:.0f} s; casts: dtype casts per inference call",
          ["section", "model", "variant", "ms", "ratio", "casts"], [(row + [""] * 6)[:6] for row in rows])


def main(argv=None) -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, eager compile backend")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--infer-dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: train,infer,fp8,onnx,compile")
    parser.add_argument("--write-docs", action="store_true",
                        help="after printing, write the table into docs/performance.md")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.write_docs and args.dry_run:
        parser.error("--write-docs writes a GPU's figures into the docs: a --dry-run's CPU figures do not belong there")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run to check the script on CPU")
    settings = Settings("cpu" if args.dry_run else "cuda", args.dry_run, args.repeats or (1 if args.dry_run else 20),
                        args.budget_s, time.perf_counter(), "eager" if args.dry_run else "inductor")
    infer_dtype = torch.float16 if args.infer_dtype == "float16" else torch.bfloat16
    if args.dry_run:
        infer_dtype = torch.bfloat16   # fp16 arithmetic on CPU is slow and not what the dry run checks
    zoo = zoo_cases(args.dry_run)
    real = real_cases(args.dry_run)
    if args.dry_run:   # one model per front end and kind: every code path runs, in seconds
        real = [c for c in real if c.name in ("resnet18", "hf_gpt2", "vit_b_16")]
    print(environment(), file=sys.stderr, flush=True)
    skip = set(args.skip.split(","))
    cases = [*zoo, *real]
    jobs = []   # cheapest and most wanted first: the time budget cuts from the end (compiles)
    if "train" not in skip:   # dry run: CPU fp16 convolutions take seconds, so ResNet-18 trains in bf16 only
        jobs += [("train", case, dtype) for case in cases for dtype in (torch.float16, torch.bfloat16)
                 if case.name != "vit_b_16" and not (args.dry_run and dtype == torch.float16
                                                     and case.name == "resnet18")]
    if "infer" not in skip:
        jobs += [("infer", case, infer_dtype) for case in cases]
    blocks, fp8_options = fp8_case(args.dry_run) if "fp8" not in skip else (None, {})   # 1.6 GB fp32 on CUDA runs
    if blocks:
        jobs += [("fp8", blocks, torch.bfloat16)]
    if "onnx" not in skip:
        jobs += [("onnx", case, torch.float16) for case in zoo if case.name in ("mlp", "resnet", "bert")]
        jobs += [("onnx", case, torch.float16) for case in real if case.name == "resnet18" and not args.dry_run]
    if "compile" not in skip:
        jobs += [("compile", case, infer_dtype) for case in cases if case.name != "vit_b_16"]
        jobs += [("fp8 compile", blocks, torch.bfloat16)] if blocks else []
    rows: list[list] = []
    for section, case, dtype in jobs:
        if settings.out_of_time():
            rows.append([section, case.name, "skipped: time budget", "", ""])
            continue
        try:
            if section == "onnx":
                rows += onnx_rows(case, settings)
            else:
                moved = to_device(case, settings.device)
                if section.startswith("fp8"):
                    rows += fp8_rows(moved, fp8_options, settings, compiled=section == "fp8 compile")
                elif section == "train":
                    rows += train_rows(moved, dtype, settings)
                else:
                    rows += infer_rows(moved, dtype, settings, compiled=section == "compile")
        except Exception as error:  # noqa: BLE001 - one failure is a row, the table still prints
            rows.append([section, case.name, f"FAILED {type(error).__name__}: {str(error).splitlines()[0][:80]}",
                         "", ""])
        print(f"{time.perf_counter() - settings.started:6.1f} s  " + "  ".join(map(str, rows[-1])), file=sys.stderr,
              flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # doc_tables beside this script
    import doc_tables
    with doc_tables.captured() as printed:
        print_table(rows, settings)
    if args.write_docs:
        doc_tables.write_table("performance.md", "gpu", printed.text, doc_tables.command_line())
    return rows


if __name__ == "__main__":
    main()
