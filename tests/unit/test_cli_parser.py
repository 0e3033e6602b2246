"""Unknown flags: the suggestion comes from the command that was typed."""

import pytest

from cluster.cli.main import build_parser


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    return capsys.readouterr().err


def test_suggests_a_flag_of_the_chosen_command(capsys):
    err = _error(capsys, ["bench", "latency", "--batch-size", "1"])
    assert "--batch-size: did you mean --batch-sizes?" in err


def test_never_suggests_the_flag_that_was_typed(capsys):
    # --output belongs to other commands; bench latency writes --json.
    err = _error(capsys, ["bench", "latency", "--output", "x"])
    assert "did you mean --output?" not in err
    assert "--output: did you mean --output-len?" in err


def test_names_the_commands_a_flag_belongs_to(capsys):
    err = _error(capsys, ["generate", "--rounds", "3"])
    assert "--rounds is a flag of bench latency" in err
