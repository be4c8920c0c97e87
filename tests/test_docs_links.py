"""Every relative link in README.md and docs/**/*.md points to a file or folder of the repository (links inside
code blocks and code spans are not links; web addresses and in-page anchors are not checked)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))

FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text: str) -> list[str]:
    """The targets of the page's inline links and images that name a path, without their #anchor."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def test_the_link_reader_finds_links_and_skips_code():
    text = (
        "See [code](docs/code.md#the-step), ![plot](studies/a.png) and [a page](https://example.com).\n"
        'Inline `[not](a_link.md)` and\n```\n[neither](this.md)\n```\n[anchor](#here) [x](../up/one.md "t")\n'
    )
    assert relative_links(text) == ["docs/code.md", "studies/a.png", "../up/one.md"]


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_every_relative_link_points_to_an_existing_file(page):
    with open(page) as f:
        links = relative_links(f.read())
    missing = [t for t in links if not os.path.exists(os.path.join(os.path.dirname(page), t))]
    assert not missing, f"{os.path.relpath(page, ROOT)} links to missing files: {missing}"


def test_the_pages_and_their_links_are_found():
    """The glob reaches pages in docs/ and below it, and README's links are read (a reader that found none would
    pass every page above)."""
    assert {"docs/code.md", "docs/studies/README.md"} <= {os.path.relpath(p, ROOT) for p in PAGES}
    with open(PAGES[0]) as f:
        assert len(relative_links(f.read())) >= 10
