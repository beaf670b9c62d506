"""The README stays a guide of at most 400 lines, and the spec reference matches the schemas."""

from __future__ import annotations

import re
import runpy

from fixtures.launching import ROOT


def test_the_spec_reference_is_generated_from_the_committed_schemas():
    rendered = runpy.run_path(str(ROOT / "docs/spec_reference.py"))["render"]()
    committed = (ROOT / "docs/spec-reference.md").read_text()
    assert rendered == committed, "run `just schema`: docs/spec-reference.md is stale"


def test_the_readme_is_at_most_400_lines_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400, "the README is a guide: depth goes to docs/"
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)#][^)]*)\)", readme)}
    missing = sorted(t for t in targets if "://" not in t and not (ROOT / t).exists())
    assert not missing, f"README links to files that do not exist: {missing}"
    unlinked = sorted(
        f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in targets
    )
    assert not unlinked, f"the README does not link {unlinked}"
