"""mha-client argument parsing: value parsers, usage errors (exit 2), and no torch on import."""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import pytest

from mha_client.cli import (
    ENV_TARGET,
    UsageError,
    build_parser,
    float_list,
    int_list,
    main,
    prune_mask,
    random_shape,
    row_range,
)
from mha_client.report import format_table


def test_value_parsers():
    assert int_list("0,3") == [0, 3]
    assert int_list("5") == [5]
    assert float_list("1,0,0.5") == [1.0, 0.0, 0.5]
    assert row_range("2:7") == (2, 7)
    assert row_range("2:") == (2, None)
    assert row_range(":7") == (0, 7)
    assert random_shape("2,5") == (2, 5)
    assert random_shape("5") == (5,)


@pytest.mark.parametrize(
    ("parser", "text", "message"),
    [
        (int_list, "0,x", "comma-separated list of integers"),
        (float_list, "1,a", "comma-separated list of numbers"),
        (row_range, "abc", "START:END"),
        (row_range, "5", "START:END"),
        (row_range, "7:2", "are empty: END must be greater than START"),
        (row_range, "-3:", "start at -3: rows count from 0, so START must be >= 0"),
        (row_range, "-3:5", "START must be >= 0"),
        (random_shape, "2,0", "positive integers"),
        (random_shape, "1,2,3", "BATCH,SEQ_LEN"),
    ],
)
def test_bad_values_say_what_was_expected(parser, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parser(text)


def test_prune_heads_builds_a_mask():
    assert prune_mask([2, 5], 8) == [1, 1, 0, 1, 1, 0, 1, 1]
    assert prune_mask([], 2) == [1.0, 1.0]
    with pytest.raises(UsageError, match=r"\[8\] out of range.*8 heads \(0\.\.7\)"):
        prune_mask([1, 8], 8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["attend", "m", "--random-shape", "2,5", "--rows", "abc"], "argument --rows"),
        (["attend", "m", "--random-shape", "x"], "argument --random-shape"),
        (["attend", "m"], "one of the arguments --input --random-shape is required"),
        (["attend", "m", "--input", "a.npy", "--random-shape", "3"], "not allowed with"),
        (["attend", "m", "--random-shape", "3", "--causal", "--bidirectional"], "not allowed"),
        (["attend", "m", "--random-shape", "3", "--dtype", "int8"], "invalid choice"),
        (["--timeout", "0", "models"], "positive number of seconds"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_usage_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["attend", "m", "--random-shape", "3", "--heads", "0"], "add --weights"),
        (["attend", "m", "--random-shape", "3", "--save", "out.txt"], ".npz"),
        # session step --save takes what attend --save takes (numpy would write out.npy.npz)
        (["session", "step", "s", "--random-tokens", "2", "--save", "o.txt"], ".npz"),
        # load --concurrency 0 ran 1 client; 0 and -3 are refused alike
        (["load", "m", "--concurrency", "0", "--requests", "3"], "'0' is not a positive"),
        (["load", "m", "--concurrency", "-3", "--requests", "3"], "'-3' is not a positive"),
        (["load", "m", "--requests", "0"], "'0' is not a positive integer"),
        (["load", "m", "--requests", "3", "--warmup", "-1"], "'-1' is not an integer >= 0"),
        # --arrivals shapes the open loop only: a closed loop ignored it
        (["load", "m", "--requests", "3", "--arrivals", "uniform"], "give --rate with it"),
        # heads --lengths failed with "invalid literal for int()", exit 1; attend's said why
        (["heads", "m", "--random", "3", "--lengths", "a,b"], "argument --lengths"),
    ],
)
def test_checks_after_parsing_exit_2_before_any_call(argv, message, capsys):
    # The target is unreachable: exiting 2 proves these fail before touching the network.
    assert main(["--target", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_input_file_is_a_usage_error(tmp_path, capsys):
    missing = tmp_path / "missing.npy"
    assert main(["--target", "127.0.0.1:1", "attend", "m", "--input", str(missing)]) == 2
    assert "cannot read --input" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["attend", "m"], ["session", "step", "s1"], ["heads", "m"]])
@pytest.mark.parametrize(
    ("array", "says"),
    [
        (np.zeros(512, np.float32), "holds (512,); expected a 2-D"),
        (np.zeros((2, 512), np.int64), "holds int64; save it as float32 or float16"),
    ],
)
def test_an_input_file_that_cannot_work_is_a_usage_error_naming_it(
    tmp_path, capsys, command, array, says
):
    """Every command reading --input names the file and what it should hold (a session
    step: one sequence), before anything is sent (no server at the target)."""
    path = tmp_path / "x.npy"
    np.save(path, array)
    assert main(["--target", "127.0.0.1:1", *command, "--input", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--input {path} {says}" in err
    if command[0] == "session" and array.ndim == 1:
        assert "(1, tokens, embed_dim)" in err


def test_help_exits_0(capsys):
    assert main(["attend", "--help"]) == 0
    assert "--prune-heads" in capsys.readouterr().out


def test_target_from_env_and_flag_on_either_side(monkeypatch):
    monkeypatch.setenv(ENV_TARGET, "10.0.0.1:6000")
    assert build_parser().parse_args(["models"]).target == "10.0.0.1:6000"
    args = build_parser().parse_args(["--target", "a:1", "models", "--timeout", "5"])
    assert (args.target, args.timeout) == ("a:1", 5.0)
    assert build_parser().parse_args(["models", "--target", "b:2"]).target == "b:2"


def test_unreachable_server_names_the_target(capsys):
    assert main(["--target", "127.0.0.1:1", "--timeout", "5", "models"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: UNAVAILABLE: ")
    assert "127.0.0.1:1" in err


def test_format_table_aligns_columns():
    text = format_table(["name", "heads"], [["tiny", 4], ["bigger-name", 16]])
    lines = text.splitlines()
    assert lines[0] == "name         heads"
    assert lines[1] == "tiny             4"
    assert lines[2] == "bigger-name     16"


def test_importing_the_client_does_not_import_torch():
    code = (
        "import sys, mha_client.sdk, mha_client.cli, mha_client.heatmap; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'mha_serve', 'matplotlib')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, f"client imported {done.stdout}{done.stderr}"


def test_heads_takes_random_shape_as_attend_names_it():
    """`heads --random-shape L` is `heads --random L` (attend's flag name, one sequence)."""
    parser = build_parser()
    a = parser.parse_args(["heads", "gqa", "--random-shape", "12"])
    b = parser.parse_args(["heads", "gqa", "--random", "12"])
    assert a.random == b.random == 12
