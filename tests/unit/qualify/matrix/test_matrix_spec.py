"""The matrix spec (qwz/qualify/matrix/matrix_spec.py): expansion into cells, their ids and ``run``
arguments, exclusions, and every refusal naming the file, the line and the key."""

from __future__ import annotations

import itertools
import pathlib
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qwz.qualify import cli
from qwz.qualify.matrix.matrix_spec import AXES, SpecError, load, parse

HEADER = '[matrix]\nname = "t"\n'


def spec_of(text: str, tmp_path: pathlib.Path):
    path = tmp_path / "spec.toml"
    path.write_text(HEADER + textwrap.dedent(text))
    return load(path)


def refusal(text: str, tmp_path: pathlib.Path) -> str:
    with pytest.raises(SpecError) as caught:
        spec_of(text, tmp_path)
    return str(caught.value)


def test_a_group_is_the_product_of_its_axes_in_axis_order(tmp_path):
    spec = spec_of(
        """
        [defaults]
        blocks = 2
        [[cells]]
        name = "g"
        subject = ["qwz", "deepspeed"]
        stage = [1, 2]
        group_sizes = [[64, 8192]]
        workload = "mlp"
        steps = 6
        """,
        tmp_path,
    )
    assert [cell.id for cell in spec.cells] == [
        "qwz-s1-bf16-g64+8192-mlp-w2-default-seed0",
        "qwz-s2-bf16-g64+8192-mlp-w2-default-seed0",
        "deepspeed-s1-bf16-g64+8192-mlp-w2-default-seed0",
        "deepspeed-s2-bf16-g64+8192-mlp-w2-default-seed0",
    ]
    assert spec.cells[0].run_arguments() == [
        *("--subject", "qwz", "--stage", "1", "--dtype", "bf16"),
        *("--group-size", "64", "--group-size", "8192", "--workload", "mlp"),
        *("--world-size", "2", "--seed", "0", "--blocks", "2", "--steps", "6"),
    ]


def test_group_sizes_values_are_one_g_or_the_arms_of_one_run(tmp_path):
    spec = spec_of('[[cells]]\nname = "g"\ngroup_sizes = [64, [64, 8192], 8192]\n', tmp_path)
    assert [cell.value("group_sizes") for cell in spec.cells] == [(64,), (64, 8192), (8192,)]


def test_the_default_preset_passes_no_flag_and_false_booleans_pass_theirs(tmp_path):
    spec = spec_of(
        '[[cells]]\nname = "g"\npreset = ["default", "long"]\ncalibration = false\n', tmp_path
    )
    default, long = (cell.run_arguments() for cell in spec.cells)
    assert "--preset" not in default and "--no-calibration" in default
    assert long[long.index("--preset") + 1] == "long"


def test_an_exclude_removes_its_cells_and_keeps_them_as_rows_with_the_reason(tmp_path):
    spec = spec_of(
        """
        [[cells]]
        name = "g"
        stage = [1, 2]
        dtype = ["bf16", "fp16", "fp32"]
        [[cells.exclude]]
        stage = 1
        dtype = ["fp16", "fp32"]
        reason = "why not"
        [[out_of_scope]]
        scope = "offload"
        reason = "not supported"
        """,
        tmp_path,
    )
    ran = {(cell.value("stage"), cell.value("dtype")) for cell in spec.cells}
    assert ran == {(1, "bf16"), (2, "bf16"), (2, "fp16"), (2, "fp32")}
    assert dict(spec.declared[0].axes)["dtype"] == "fp16" and spec.declared[2].axes == ()
    assert [(row.id, row.kind, row.reason) for row in spec.declared] == [
        ("qwz-s1-fp16-g64-qwen3-tiny-w2-default-seed0", "excluded", "why not"),
        ("qwz-s1-fp32-g64-qwen3-tiny-w2-default-seed0", "excluded", "why not"),
        ("offload", "out of scope", "not supported"),
    ]


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        ('[[cells]]\nname = "g"\nstages = [1]\n', 5, "unknown key 'stages'"),
        (
            '[[cells]]\nname = "g"\n\nstage = [1, 3]\n',
            6,
            "stage: 3 is invalid: must be ZeRO stage 1",
        ),
        ('[[cells]]\nname = "g"\ngroup_sizes = [63]\n', 5, "must be a positive multiple of 8"),
        ('[[cells]]\nname = "g"\ndtype = "fp8"\n', 5, "'fp8' is invalid: must be one of bf16"),
        ('[[cells]]\nname = "g"\nworkload = ["mlp", "mlp"]\n', 5, "a value repeats"),
        ('[[cells]]\nname = "g"\nsteps = 0\n', 5, "steps: 0 is invalid: must be a positive"),
        ('[[cells]]\nname = "g"\nstage = true\n', 5, "stage: True is invalid"),
        ('[[cells]]\nname = "g"\nseed = []\n', 5, "seed is empty"),
        ('[defaults]\nblock = 2\n[[cells]]\nname = "g"\n', 4, "[defaults]: unknown key 'block'"),
        ('[[cells]]\nname = "g g"\n', 4, "name 'g g' is invalid"),
        ("[[cells]]\nstage = 1\n", 3, "name must be a non-empty string"),
        (
            '[[cells]]\nname = "g"\n[[cells.exclude]]\nstage = 1\nreason = "x"\n',
            5,
            "matches no cell of its group",
        ),
        ('[[cells]]\nname = "g"\n[[cells.exclude]]\nstage = 2\n', 5, "reason must be"),
        ('[[cells]]\nname = "g"\n[[cells.exclude]]\nreason = "x"\n', 5, "names no axis"),
        (
            '[[cells]]\nname = "a"\nexclude = [{stage = 1, reason = "x"}]\n'
            '[[cells]]\nname = "b"\n[[cells.exclude]]\nstage = 2\nreason = "y"\n',
            5,
            "'a' exclude #1: matches no cell",
        ),
        ('[[cells]]\nname = "a"\n[[cells]]\nname = "b"\n', None, "appears twice"),
        (
            '[[cells]]\nname = "g"\n[[cells.exclude]]\nstage = 2\nreason = "x"\n',
            None,
            "every cell is excluded",
        ),
        ("", None, "no [[cells]] group"),
        (
            '[[out_of_scope]]\nscope = "x"\n[[cells]]\nname = "g"\n',
            3,
            "[[out_of_scope]] #1: reason",
        ),
        ('[[cells]]\nname = "g"\nstage = [1\n', None, "not a valid TOML file"),
    ],
)
def test_refusals_name_the_file_the_line_and_the_rule(tmp_path, text, line, expected):
    message = refusal(text, tmp_path)
    assert expected in message, message
    place = f"{tmp_path / 'spec.toml'}:{line}:" if line else str(tmp_path / "spec.toml")
    assert message.startswith(place), message


def test_an_unknown_top_level_table_and_a_missing_matrix_name_are_refused(tmp_path):
    path = tmp_path / "spec.toml"
    with pytest.raises(SpecError, match="unknown key 'cell'"):
        parse('[matrix]\nname = "t"\n[[cell]]\nname = "g"\n', path)
    with pytest.raises(SpecError, match="no \\[matrix\\] table"):
        parse('[[cells]]\nname = "g"\n', path)
    with pytest.raises(SpecError, match="\\[matrix\\]: name must be"):
        parse('[matrix]\ndescription = "d"\n[[cells]]\nname = "g"\n', path)


def test_the_matrix_command_refuses_a_bad_spec_with_exit_2(tmp_path, capsys):
    path = tmp_path / "spec.toml"
    path.write_text(HEADER + '[[cells]]\nname = "g"\nstage = [1, 3]\n')
    assert cli.main(["matrix", str(path), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert f"{path}:5: [[cells]] 'g': stage: 3 is invalid" in error
    assert not (tmp_path / "out").exists()


# The run interface's values this build's parser does not know yet (other branches add them).
KNOWN_TO_RUN = {
    "dtype": ["bf16", "fp32"],
    "workload": ["mlp", "qwen3-tiny"],
    "preset": ["default"],
}


@st.composite
def groups(draw) -> dict:
    """A group of 1-3 values on each of a few axes, drawn from the values ``run`` accepts."""
    pools = {
        "subject": ["qwz", "deepspeed", "deepspeed-native"],
        "stage": [1, 2],
        "group_sizes": [64, 8192, [64, 8192], 128],
        "world_size": [1, 2, 4],
        "seed": [0, 1, 2**40],
        **KNOWN_TO_RUN,
    }
    return {
        axis: draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique_by=str))
        for axis, pool in pools.items()
        if draw(st.booleans())
    }


def _toml(value) -> str:
    return repr(value).replace("'", '"')


@given(groups())
def test_every_cell_is_one_product_element_and_run_parses_its_arguments_back(group):
    """Cells = the product of the axes, ids unique, and ``run``'s own parser reads every
    cell's arguments back into the cell's axis values."""
    text = HEADER + '[[cells]]\nname = "g"\n'
    text += "".join(f"{axis} = {_toml(values)}\n" for axis, values in group.items())
    spec = parse(text, pathlib.Path("spec.toml"))
    expected = [AXES[axis].default for axis in AXES]
    product = itertools.product(
        *(group.get(axis, [default]) for axis, default in zip(AXES, expected, strict=True))
    )
    assert len(spec.cells) == len(list(product))
    assert len({cell.id for cell in spec.cells}) == len(spec.cells)
    parser = cli.build_parser()
    for cell in spec.cells:
        parsed = parser.parse_args(["run", *cell.run_arguments(), "--out", "x"])
        assert parsed.subject == cell.value("subject")
        assert parsed.stage == cell.value("stage")
        assert parsed.dtype == cell.value("dtype")
        assert tuple(parsed.group_sizes) == cell.value("group_sizes")
        assert parsed.workload == cell.value("workload")
        assert parsed.world_size == cell.value("world_size")
        assert parsed.seed == cell.value("seed")


def test_list_prints_every_cell_and_row_and_running_needs_out(tmp_path, capsys):
    path = tmp_path / "spec.toml"
    path.write_text(HEADER + '[[cells]]\nname = "g"\nstage = [1, 2]\n'
                    '[[out_of_scope]]\nscope = "offload"\nreason = "no"\n')  # fmt: skip
    assert cli.main(["matrix", str(path), "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("qwz-s1-bf16-g64-qwen3-tiny-w2-default-seed0: run --subject qwz")
    assert lines[2] == "offload: not run (out of scope): no"
    assert cli.main(["matrix", str(path)]) == 2
    assert "--out DIR is required" in capsys.readouterr().err


SHIPPED_SPECS = sorted((pathlib.Path(__file__).resolve().parents[4] / "specs").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED_SPECS, ids=lambda path: path.name)
def test_every_shipped_spec_loads_and_run_parses_every_cell(path):
    """A spec the nightly or a maintainer runs must not be refused after the night started:
    it loads, and ``run``'s parser accepts every cell's arguments (argparse exits 2 on a flag
    or choice it does not know, e.g. a workload that was renamed)."""
    spec = load(path)
    assert spec.cells, f"{path.name} has no cell to run"
    parser = cli.build_parser()
    for cell in spec.cells:
        parser.parse_args(["run", *cell.run_arguments(), "--out", "x"])


def test_the_upstream_scope_spec_covers_what_the_cpu_can_qualify():
    """specs/upstream-scope.toml runs ZeRO-1 and -2, bf16, fp16 (qwz) and fp32, G 64 and
    8192, the MoE workload through DeepSpeed, world sizes 2 and 4 and the long preset."""
    spec = load(next(path for path in SHIPPED_SPECS if path.name == "upstream-scope.toml"))
    values = {axis: {cell.value(axis) for cell in spec.cells} for axis in AXES}
    assert {1, 2} <= values["stage"]
    assert {"bf16", "fp16", "fp32"} <= values["dtype"]
    assert {64, 8192} <= {size for sizes in values["group_sizes"] for size in sizes}
    assert {2, 4} <= values["world_size"]
    assert "long" in values["preset"]
    assert any(
        cell.value("workload") == "moe-tiny" and cell.value("subject") == "deepspeed"
        for cell in spec.cells
    )
    assert any(
        cell.value("dtype") == "fp16" and cell.value("subject") == "qwz" for cell in spec.cells
    )


def test_a_key_of_an_earlier_spec_runs_what_it_meant(tmp_path):
    """``compile = false`` was eager kernels; ``bucket_size`` set both buckets."""
    spec = parse(
        '[matrix]\nname = "m"\n[[cells]]\nname = "g"\ncompile = false\nbucket_size = 65536\n',
        tmp_path / "m.toml",
    )
    arguments = spec.cells[0].run_arguments()
    assert arguments[-6:] == [
        "--allgather-bucket-size", "65536", "--kernels", "eager", "--reduce-bucket-size", "65536",
    ]  # fmt: skip
    with pytest.raises(SpecError, match="compile: 'yes' is invalid: must be one of fused, eager"):
        parse('[matrix]\nname = "m"\n[[cells]]\nname = "g"\ncompile = "yes"\n', tmp_path / "m")
