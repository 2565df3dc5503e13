"""A run on the user's own task, with real services: prompts from a JSONL file through a prompt
template, scored by a user function from a module on the coordinator's allow list; through the
REST API and through `spotrl up --dataset ... --reward module:function`. A reward that raises,
hangs or returns NaN scores 0, is counted in the step's metrics and in /metrics, and the run goes
on. What cannot run is refused at submit with 422, and nothing is queued."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from services.coordinator.step.loop import stop_token_ids
from tests.data.user_reward import sum_is_right
from tests.harness.deploy import DeploymentConfig
from tests.integration.conftest import deploy_config, read_groups, small_spec, wait_final
from tests.integration.test_up import summary_of, up_command

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests.data.user_reward"
TEMPLATE = "{a}+{b}="


@pytest.fixture(scope="module")
def deployment_config(tmp_path_factory) -> DeploymentConfig:
    return deploy_config(
        tmp_path_factory.mktemp("deploy"),
        preemptible=0,
        reward_modules=[MODULE],
        extra_env={"PYTHONPATH": str(REPO)},  # the operator makes the module importable
    )


def sums_file(folder: Path, n: int = 8) -> Path:
    path = folder / "sums.jsonl"
    rows = [{"a": 10 + i, "b": 3 * i, "total": 10 + 4 * i} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def user_spec(model, dataset: Path, **over) -> dict:
    return (
        small_spec(
            model,
            task="dataset",
            dataset=str(dataset),
            prompt_template=TEMPLATE,
            reward=f"{MODULE}:sum_is_right",
            shuffle=False,
            steps=2,
            prompts_per_step=4,
            group_size=2,
        )
        | over
    )


def test_a_users_dataset_and_reward_train_end_to_end(client, deployment, tiny_model, tmp_path):
    dataset = sums_file(tmp_path)
    run_id = client.submit(user_spec(tiny_model, dataset))
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded" and run["weight_version"] == 2, run
    assert [row["reward_errors"] for row in client.metrics(run_id)] == [0, 0]
    # every group: the file's rows in order, the template's prompt, the user function's score
    tokenizer = Tokenizer.from_file(str(Path(tiny_model) / "tokenizer.json"))
    stop = set(stop_token_ids(Path(tiny_model)))
    rows = [json.loads(line) for line in dataset.read_text().splitlines()]
    groups = read_groups(deployment, run_id)
    assert len(groups) == 8
    for group in groups:
        row = rows[group.step * 4 + group.prompt_index]
        assert group.prompt_ids == tokenizer.encode(TEMPLATE.format(**row)).ids
        for response in group.responses:
            text = tokenizer.decode([t for t in response.token_ids if t not in stop])
            assert response.reward == sum_is_right("", text, row), (text, row)


def test_a_reward_that_raises_hangs_or_returns_nan_scores_zero_and_is_counted(
    client, deployment, tiny_model, tmp_path
):
    path = tmp_path / "kinds.jsonl"
    kinds = ["ok", "raise", "hang", "nan"]
    path.write_text("".join(json.dumps({"q": "1+1=", "kind": k}) + "\n" for k in kinds))
    spec = user_spec(
        tiny_model,
        path,
        prompt_template=None,
        prompt_field="q",
        reward=f"{MODULE}:misbehaves",
        reward_timeout_s=0.5,
        steps=1,
        max_error_share=0.8,  # 6 of 8 fail: the run goes on, degraded
    )
    run_id = client.submit(spec)
    run = wait_final(client, deployment, run_id)
    assert run["state"] == "succeeded" and run["health"] == "degraded", run
    assert [row["reward_errors"] for row in client.metrics(run_id)] == [6]
    assert run["reward_errors"] == 6  # the run's total, as GET /v1/runs/{id} shows it
    assert run["errors"]["reward"] == {
        "calls": 8,
        "failed": 6,
        "share": 0.75,
        "first": run["errors"]["reward"]["first"],
    }
    rewards = {
        g.prompt_index: [r.reward for r in g.responses] for g in read_groups(deployment, run_id)
    }
    assert rewards == {0: [1.0, 1.0], 1: [0.0, 0.0], 2: [0.0, 0.0], 3: [0.0, 0.0]}
    metrics = httpx.get(f"{deployment.coordinator_url}/metrics").text
    for kind in ("raised", "timeout", "not_finite"):
        line = f'spotrl_coordinator_reward_errors_total{{kind="{kind}"}}'
        assert any(m.startswith(line) and float(m.split()[-1]) >= 2 for m in metrics.splitlines())


def test_a_reward_that_raises_on_every_call_fails_the_run_saying_where(
    client, deployment, tiny_model, tmp_path
):
    spec = user_spec(tiny_model, sums_file(tmp_path), reward=f"{MODULE}:always_raises", steps=3)
    run = wait_final(client, deployment, client.submit(spec))
    assert run["state"] == "failed" and run["health"] == "failed", run
    assert run["error"].startswith("reward failed on 8 of 8 calls in step 0"), run
    assert "raised: ZeroDivisionError" in run["error"], run
    assert "user_reward.py:" in run["error"] and "in always_raises" in run["error"], run
    assert run["step"] <= 1, run


def test_the_math_built_in_scores_with_math_verify_in_a_reward_process(
    client, deployment, tiny_model
):
    # math_verify's own timeouts need a main thread: in the reward process it is one
    spec = small_spec(tiny_model, task="math", steps=1, prompts_per_step=2, group_size=2)
    run = wait_final(client, deployment, client.submit(spec))
    assert run["state"] == "succeeded", run
    assert [row["reward_errors"] for row in client.metrics(run["id"])] == [0]


def test_what_cannot_run_is_refused_at_submit(client, deployment, tiny_model, tmp_path):
    dataset = sums_file(tmp_path)
    bad_row = tmp_path / "bad.jsonl"
    bad_row.write_text('{"a": 1, "b": 2}\n{"a": 1}\n')
    before = len(client.runs())
    cases = [
        (
            {"reward": "os.path:join"},
            "scoring.reward",
            "'os.path' is not on the coordinator's allow list",
        ),
        ({"reward": f"{MODULE}:nope"}, "scoring.reward", "has no function 'nope'"),
        ({"dataset": str(tmp_path / "none.jsonl")}, "data.dataset", "does not exist"),
        ({"dataset": str(bad_row)}, "data.dataset", "bad.jsonl:2: no field 'b'"),
        ({"chat_template": True}, "data.chat_template", "has no chat template"),
    ]
    for over, place, message in cases:  # the field named by its place in the sectioned spec
        resp = httpx.post(
            f"{deployment.coordinator_url}/v1/runs", json=user_spec(tiny_model, dataset) | over
        )
        assert resp.status_code == 422, resp.text
        (error,) = resp.json()["detail"]
        assert error["loc"] == ["body", *place.split(".")] and message in error["msg"], error
    assert len(client.runs()) == before


def test_spotrl_up_runs_a_dataset_with_a_user_reward(tmp_path, tiny_model):
    dataset = sums_file(tmp_path)
    env = {**os.environ, "SPOTRL_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("SPOTRL_REWARD_MODULES", None)  # `spotrl up` allows the reward it is given
    task = ["--dataset", str(dataset), "--prompt-template", TEMPLATE]
    reward = ["--reward", f"{MODULE}:sum_is_right"]
    cmd = up_command(tiny_model, "--steps", "1", *task, *reward)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = summary_of(out.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 1, summary
    assert summary["reward_errors"] == 0 and summary["lost"] == 0, summary
    # without --model: the base model spotrl up builds only knows arithmetic
    no_model = [sys.executable, "-m", "services.cli.main", "up", *task, *reward]
    out = subprocess.run(no_model, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--dataset needs --model" in out.stderr, out.stderr
