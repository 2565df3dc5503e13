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


def test_run_plot_is_a_png(tmp_path):
    from services.cli.plots import plot_run

    rows = [{"step": i, "reward_mean": 0.1 * i, "tokens_per_s": 100.0 + i} for i in range(5)]
    rows.append({"step": 5, "policy_loss": 0.0})  # a row with training fields only
    out = plot_run(rows, tmp_path / "m.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_free_ports_lie_below_the_kernels_ephemeral_range():
    """A service's port is chosen where no port-0 bind of another process can take it before
    the service binds it (vLLM's engine sockets did, in CI: "Address already in use")."""
    import socket

    from services.cli import procs

    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < procs.ephemeral_low() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free indeed
