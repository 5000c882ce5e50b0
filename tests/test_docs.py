"""The docs cannot drift: every ```python block of README.md and docs/*.md runs, and the site builds.

A page's blocks share one namespace and run in order, in a temporary folder (what they write stays there), on
the CPU. A block that needs what one test process cannot give (a GPU, a launcher such as torchrun) is fenced
```python {.no-run}: at most MAX_SKIPPED are, and the paragraph right above each says what it needs.
The site is built with `mkdocs build --strict` (warnings are errors); without mkdocs installed that test is
skipped and the code blocks still run.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import amp_compiler

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
MAX_SKIPPED = 6
# What a skipped block may need: said in the paragraph right above it.
SKIP_REASON = re.compile(r"\bneeds?\b[^.]*\b(GPU|CUDA|torchrun|launcher|processes|ranks)\b", re.IGNORECASE | re.DOTALL)


def code_blocks(text: str) -> list[tuple[str, str, str]]:
    """(info string, code, the paragraph right above) of each top-level fenced block, in order."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info, start = lines[i][3:].strip(), i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
            above = []
            for line in reversed(lines[:start]):
                if not line.strip() and above:
                    break
                if line.strip():
                    above.insert(0, line)
            blocks.append((info, "\n".join(lines[start + 1:end]), "\n".join(above)))
            i = end + 1
        else:
            i += 1
    return blocks


def is_python(info: str) -> bool:
    return info.split(" ", 1)[0] == "python" or info.startswith("{.python")


def skipped(info: str) -> bool:
    return "no-run" in info


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_code_blocks_are_found_including_skipped_ones():
    text = "intro\n\n```python\na = 1\n```\n\nThis one needs torchrun.\n```python {.no-run}\nb\n```\n```bash\nls\n```\n"
    blocks = code_blocks(text)
    assert [(info, code) for info, code, _ in blocks] == [("python", "a = 1"), ("python {.no-run}", "b"),
                                                          ("bash", "ls")]
    assert blocks[1][2] == "This one needs torchrun." and skipped(blocks[1][0]) and not skipped(blocks[0][0])


def reset_accelerate_state() -> None:
    """Accelerate keeps one process-wide state; a page's Trainer and Accelerator (and other tests') build their own."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    AcceleratorState._reset_state(True)


@pytest.fixture
def fresh_process_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch, fresh_process_state):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for n, (info, code, _) in enumerate(code_blocks(page.read_text())):
        if not is_python(info) or skipped(info):
            continue
        try:
            exec(compile(code, f"{page_id(page)}, python block {n + 1}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page_id(page)}: python block {n + 1} failed:\n{code}") from error
        ran += 1
    if page.name not in ("performance.md", "how-it-works.md", "reference.md", "development.md", "scale-out.md"):
        assert ran, f"{page_id(page)} has no python block that runs"


def test_few_blocks_are_skipped_and_each_says_why():
    skips = [(page_id(page), above) for page in PAGES for info, _, above in code_blocks(page.read_text())
             if is_python(info) and skipped(info)]
    assert len(skips) <= MAX_SKIPPED, f"{len(skips)} blocks skipped (at most {MAX_SKIPPED}): {skips}"
    for page, above in skips:
        assert SKIP_REASON.search(above), f"{page}: a skipped block says not why right above it: {above!r}"


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert 180 <= len(text.splitlines()) <= 300, len(text.splitlines())
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert image.startswith("https://"), f"README image {image!r}: a relative path breaks on an index page"
    links = re.findall(r"\]\(https://github\.com/amp-compiler/amp-compiler/blob/main/(docs/[^)#]+)", text)
    assert links, "README links into the docs"
    for link in links:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def nav_pages(config: str) -> list[str]:
    return re.findall(r":\s*([\w./-]+\.md)\s*$", config, re.MULTILINE)


def test_every_page_is_in_the_nav_and_the_nav_names_only_pages():
    listed = nav_pages((ROOT / "mkdocs.yml").read_text())
    assert sorted(listed) == sorted(p.name for p in DOCS.glob("*.md")), listed
    assert listed[1] == "from-autocast.md", "the first guide is the one for people coming from torch.autocast"


def test_scale_out_page_keeps_the_section_the_launchers_fill():
    text = (DOCS / "scale-out.md").read_text()
    start, end = text.find("<!-- scale-out-paths -->"), text.find("<!-- /scale-out-paths -->")
    assert 0 <= start < end, "docs/scale-out.md lacks the scale-out-paths markers"


def test_site_builds_strict_with_every_public_name_in_the_reference(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reference = (site / "reference" / "index.html").read_text()
    for name in amp_compiler.__all__:
        assert re.search(rf'id="amp_compiler\.(?:[\w.]+\.)?{name}"', reference), f"{name} not in the API reference"
    for module in ("lightning", "huggingface", "accelerate"):
        assert f'id="amp_compiler.{module}"' in reference, f"amp_compiler.{module} not in the API reference"
    assert (site / "render-gpt-o1.png").exists()
