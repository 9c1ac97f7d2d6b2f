"""The console progress display: a live bar on a terminal, the README's plain lines elsewhere."""

import io
from pathlib import Path

import pytest

from maxmoe.training.metrics import MetricsLogger
from maxmoe.training.progress import ProgressDisplay

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    display = ProgressDisplay(3, stream=out)
    display.update(1, "one")
    display.print("kept")
    display.update(3, "three")
    display.close()
    assert out.getvalue() == "one\nkept\nthree\n"  # no carriage returns, no escape codes


def test_plain_lines_with_elapsed_time():
    out = io.StringIO()
    display = ProgressDisplay(2, mode="plain", stream=out, elapsed=True)
    display.update(0, "compiling a")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith("s  compiling a") and lines[0].split("s", 1)[0].strip().isdigit()


@pytest.mark.parametrize("mode, stream", [("auto", FakeTerminal()), ("bar", io.StringIO())])
def test_live_bar_on_a_terminal_or_when_asked(mode, stream):
    display = ProgressDisplay(4, mode=mode, stream=stream)
    display.print("a line [that is not markup]")
    display.update(2, "halfway")
    display.close()
    text = stream.getvalue()
    assert "\x1b[" in text and "\r" in text  # redrawn in place
    assert "a line [that is not markup]\n" in text and "halfway" in text


def test_off_writes_nothing():
    out = FakeTerminal()
    display = ProgressDisplay(4, mode="off", stream=out)
    display.update(1, "x")
    display.print("y")
    display.close()
    assert out.getvalue() == ""


def test_metrics_console_lines_are_the_readme_example(tmp_path):
    expected = [
        "step     10/300  loss 6.4594  4,136 tok/s  MFU n/a  ETA 2m23s",
        "step    100  eval_loss 2.1975",
        "step    300/300  loss 2.8209  3,849 tok/s  MFU n/a  ETA 0m00s",
    ]
    assert all(line in README.splitlines() for line in expected)
    out = io.StringIO()  # not a terminal: progress=auto prints plain lines
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=300, stream=out)
    logger.log({"step": 10, "loss": 6.45941, "tokens_per_s": 4136.2, "mfu": None, "step_time_s": 0.4951})
    logger.log({"step": 100, "eval_loss": 2.19752})
    logger.log({"step": 300, "loss": 2.82093, "tokens_per_s": 3849.0, "mfu": None, "step_time_s": 0.532})
    logger.close()
    assert out.getvalue().splitlines() == expected
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_metrics_of_other_processes_stay_silent(tmp_path):
    out = FakeTerminal()
    logger = MetricsLogger(tmp_path, enabled=False, total_steps=10, progress="bar", stream=out)
    logger.message("hello")
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert out.getvalue() == "" and not (tmp_path / "metrics.jsonl").exists()


def test_skipped_steps_show_on_the_console(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=300, stream=out)
    record = {"tokens_per_s": 1000.0, "mfu": None, "step_time_s": 0.1}
    logger.log({"step": 10, "loss": 6.5, "skipped_steps": 0, **record})
    logger.log({"step": 20, "loss": float("nan"), "skipped_steps": 3, **record})
    logger.close()
    assert out.getvalue().splitlines() == [
        "step     10/300  loss 6.5000  1,000 tok/s  MFU n/a  ETA 0m29s",
        "step     20/300  loss nan  1,000 tok/s  MFU n/a  ETA 0m28s  skipped 3 non-finite",
    ]
