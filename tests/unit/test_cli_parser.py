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



def test_commands_run_without_the_packages_other_commands_need(tmp_path):
    # A bare GPU machine (scripts/gpu_check.sh) has torch but no redis or ray: bench latency must still
    # parse and run, and a command that needs them says so.
    import pathlib
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('redis', 'ray'):\n"
        "    sys.modules[name] = None\n"
        "from cluster.cli.main import build_parser, main\n"
        "args = build_parser().parse_args(['bench', 'latency', '--batch-sizes', '1', '--roofline-tbps', '4.8'])\n"
        "assert args.batch_sizes == [1] and args.roofline_tbps == 4.8\n"
        "sys.exit(main(['redis-acl', '--anything']))\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "prefixserve redis-acl cannot run here: it needs the redis package" in result.stderr


def test_building_the_parser_imports_no_torch():
    # Every command's module is imported to add its flags: light commands (router-drain in a
    # pod's preStop hook, status, redis-acl) must not pay torch's import (over a second here).
    import subprocess
    import sys

    code = ("import sys; from cluster.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
