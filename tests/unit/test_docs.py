"""The docs a newcomer reads: the README's shape, the generated configuration page, the site.

The README opens with the two commands that work on a fresh machine and stays short; the rest
is under docs/, built by MkDocs with --strict (a broken link or anchor fails the build), and
docs/configuration.md is what tools/settings_doc.py renders from the settings classes.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import settings_doc

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 160


def first_code_block(text: str) -> list[str]:
    """The commands of the first fenced code block, comments and blank lines left out."""
    m = re.search(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert m, "the README has no fenced code block"
    lines = (line.split("#", 1)[0].strip() for line in m.group(1).splitlines())
    return [line for line in lines if line]


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/"


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    assert text.index("```") < text.index("\n## "), "the commands come before any section"
    assert first_code_block(text) == ["make up", "make test"]


def test_readme_links_into_docs_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    assert links, "the README points into docs/"
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_configuration_page_is_generated_from_the_settings_classes():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == settings_doc.render(), (
        f"docs/configuration.md is stale: run `{settings_doc.WRITE_COMMAND}`"
    )


def test_configuration_page_has_every_setting():
    text = settings_doc.render()
    for settings in settings_doc.settings_classes():
        for field in settings.model_fields:
            assert f"`SPOTRL_{field.upper()}`" in text


def test_check_names_the_command_when_the_page_is_stale(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(settings_doc.render().replace("SPOTRL_SLOTS", "SPOTRL_SLOTZ"))
    monkeypatch.setattr(settings_doc, "PAGE", stale)
    monkeypatch.setattr(settings_doc, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["settings_doc", "--check"])
    assert settings_doc.main() == 1
    assert settings_doc.WRITE_COMMAND in capsys.readouterr().err


def test_site_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("mkdocs is not installed (make setup installs the dev extra)")
        pytest.skip("mkdocs is not installed: `make setup` installs it (CI fails here)")
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    cmd += ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "index.html").exists()
    assert (site / "configuration.html").exists()
