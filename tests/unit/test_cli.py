"""The CLI validates a run spec exactly as the API does, before sending anything."""

from services.cli.main import build_parser, main


def test_submit_refuses_an_invalid_spec_naming_the_field(tmp_path, capsys):
    spec = tmp_path / "run.toml"
    spec.write_text('model = "/models/m"\ngroup_size = 0\n')
    assert main(["submit", str(spec), "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "group_size" in err and "greater than or equal to 1" in err


def test_up_options_exist():
    args = build_parser().parse_args(
        [
            "up",
            "--steps",
            "3",
            "--model",
            "m",
            "--task",
            "math",
            "--reserved",
            "0",
            "--preemptible",
            "2",
        ]
    )
    assert (args.steps, args.model, args.task, args.reserved, args.preemptible) == (
        3,
        "m",
        "math",
        0,
        2,
    )
