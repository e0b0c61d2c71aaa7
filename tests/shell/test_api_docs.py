"""docs/api.md is generated from the public docstrings and cannot drift from them."""

import importlib
import inspect
import pathlib

from policyworker._dev import api_docs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_api_reference_matches_the_docstrings():
    committed = (ROOT / "docs" / "api.md").read_text()
    assert committed == api_docs.render(), "run: python -m policyworker._dev.api_docs"


def test_every_documented_name_and_public_method_has_a_docstring():
    package = importlib.import_module("policyworker")
    missing = []
    for _, _, names in api_docs.SECTIONS:
        for name in names:
            obj = getattr(package, name)
            if not inspect.getdoc(obj):
                missing.append(name)
            if inspect.isclass(obj) and name not in api_docs._DOC_ONLY:
                missing += [
                    f"{name}.{member}"
                    for member, value in api_docs.public_members(obj)
                    if not (inspect.getdoc(value) or "").strip()
                ]
    assert missing == []


def test_every_name_policyworker_exports_is_documented():
    import policyworker

    documented = {name for _, _, names in api_docs.SECTIONS for name in names}
    assert set(policyworker.__all__) - documented == {*api_docs.ALIASES, "__version__"}
    for alias, name in api_docs.ALIASES.items():
        assert getattr(policyworker, alias) is getattr(policyworker, name)


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "api.md"
    stale.write_text("old\n")
    assert api_docs.main(["--check", "--output", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert api_docs.main(["--output", str(stale)]) == 0
    assert api_docs.main(["--check", "--output", str(stale)]) == 0
