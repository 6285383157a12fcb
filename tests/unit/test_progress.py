"""The progress bar of `kvray demo` and `kvray bench`: a line per tenth into a log, one line
redrawn on a terminal."""

from __future__ import annotations

import pytest

from kvray.progress import Progress


def test_a_log_gets_a_line_per_tenth(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(40, "colocated")
    for _ in range(45):  # steps past the total leave the full bar as it is
        progress.step()
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11  # the first step, then each tenth
    assert lines[-1] == f"[{'#' * 30}] 40/40 colocated"


def test_a_terminal_gets_one_line_ended_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    progress = Progress(3)
    for case in ("a", "b", "c"):
        progress.step(case)
    progress.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("3/3 c\n")
    assert err.count("\r\033[K") == 3


def test_a_bar_stopped_short_is_ended_by_close(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    progress = Progress(3, "bench")
    progress.step()
    progress.close()
    assert capsys.readouterr().err.endswith("1/3 bench\n")
