"""The generated results pages the docs link are current: each equals what
``python -m benchmark.render_results`` writes from its record."""

import json

import pytest

from benchmark.render_results import RESULTS, render

TABLED = sorted(p for p in RESULTS.glob("*.json")
                if isinstance(doc := json.loads(p.read_text()), dict) and isinstance(doc.get("table"), list))


def test_some_records_have_pages():
    assert TABLED, "no benchmark record carries a table"


@pytest.mark.parametrize("path", TABLED, ids=lambda p: p.stem)
def test_page_matches_its_record(path):
    page = path.with_suffix(".md")
    assert page.is_file(), f"{page.name} missing: run python -m benchmark.render_results {path.stem}"
    assert page.read_text() == render(path.stem, json.loads(path.read_text())), \
        f"{page.name} is stale: run python -m benchmark.render_results {path.stem}"
