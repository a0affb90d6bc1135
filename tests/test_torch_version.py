"""The torch versions autotune runs on: refused below the tested range, warned above it, in one line."""

import pytest

from autotune.errors import UsageError
from autotune.torch_version import check_torch, release


def test_a_torch_older_than_the_tested_range_is_refused_naming_it_and_the_fix():
    with pytest.raises(UsageError) as caught:
        check_torch("2.6.0+cu124")
    message = str(caught.value)
    assert "torch 2.6.0+cu124" in message and "pip install 'torch>=2.9'" in message and "\n" not in message


def test_the_tested_range_runs_quietly_and_a_newer_torch_with_a_warning():
    for version in ("2.9.1+cu128", "2.11.0+cu130", "2.13.0+cpu", "2.14.1"):
        assert check_torch(version) is None, version
    warning = check_torch("2.15.0")
    assert warning is not None and "2.15.0" in warning and "2.14.1" in warning


def test_versions_compare_by_release_not_as_text():
    assert release("2.10.0") > release("2.9.1") and release("2.11.0+cu130") == (2, 11)


def test_run_on_an_old_torch_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    import autotune.torch_version as torch_version
    from tests.conftest import cli_in_process

    monkeypatch.setattr(torch_version, "installed_torch", lambda: "2.6.0+cu124")
    code, out, err = cli_in_process(["run", "--mem-budget", "20GB"], tmp_path, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "torch 2.6.0+cu124" in err
    assert not (tmp_path / "studies").exists()
