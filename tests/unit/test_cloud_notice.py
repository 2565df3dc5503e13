"""The cloud notice parsers (services.rollout.cloud_notice): each cloud's notice, its absence, and
garbage, which is a clear MetadataError and never a notice; the paced error log."""

import json
from datetime import UTC, datetime

import pytest

from services.rollout.cloud_notice import (
    MAX_ANSWER_BYTES,
    ErrorPace,
    MetadataError,
    Notice,
    TokenRejected,
    aws_action_probe,
    aws_token_probe,
    azure_events_probe,
    azure_name_probe,
    gcp_probe,
    read_aws_action,
    read_aws_token,
    read_azure_events,
    read_azure_name,
    read_gcp_preempted,
)

VM = "spot-vm-7"


def azure_event(**over) -> dict:
    event = {
        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": [VM],
        "EventStatus": "Scheduled",
        "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }
    return event | over


def azure_body(*events: dict) -> bytes:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)}).encode()


def test_the_probes_carry_each_clouds_headers():
    assert aws_token_probe(60).method == "PUT"
    assert aws_token_probe(60).headers == {"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    probe = aws_action_probe("tok")
    assert probe.path == "/latest/meta-data/spot/instance-action"
    assert probe.headers == {"X-aws-ec2-metadata-token": "tok"}
    assert gcp_probe().path == "/computeMetadata/v1/instance/preempted"
    assert gcp_probe().headers == {"Metadata-Flavor": "Google"}
    assert azure_events_probe().path == "/metadata/scheduledevents?api-version=2020-07-01"
    assert azure_events_probe().headers == azure_name_probe().headers == {"Metadata": "true"}


def test_aws_notice_no_notice_and_refused_token():
    assert read_aws_action(404, b"<html>Not Found</html>") is None
    notice = read_aws_action(200, b'{"action": "terminate", "time": "2026-11-26T21:40:00Z"}')
    assert notice == Notice(
        "aws", "terminate", datetime(2026, 11, 26, 21, 40, tzinfo=UTC), "2026-11-26T21:40:00Z"
    )
    assert read_aws_action(200, b'{"action": "hibernate", "time": "x"}').deadline is None
    with pytest.raises(TokenRejected):
        read_aws_action(401, b"")
    assert read_aws_token(200, b"AQAEAKx7==\n") == "AQAEAKx7=="


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (200, b"<html>oops", "not JSON"),
        (200, b'["terminate"]', "no action and time"),
        (200, b'{"action": "", "time": "2026-11-26T21:40:00Z"}', "no action and time"),
        (200, b'{"action": "stop"}', "no action and time"),
        (500, b"internal error", "unexpected HTTP 500"),
        (200, b"\xff\xfe" * 10, "not JSON"),
    ],
)
def test_aws_garbage_is_a_clear_error(status, body, says):
    with pytest.raises(MetadataError, match=says):
        read_aws_action(status, body)


def test_aws_token_garbage_is_a_clear_error():
    for status, body in [(403, b"Forbidden"), (200, b""), (200, b"a\x00b")]:
        with pytest.raises(MetadataError, match="aws token"):
            read_aws_token(status, body)


def test_gcp_notice_no_notice_and_garbage():
    assert read_gcp_preempted(200, b"FALSE") is None
    assert read_gcp_preempted(200, b"TRUE\n") == Notice("gcp", "preempted", None)
    for status, body, says in [
        (200, b"MAYBE", "neither TRUE nor FALSE"),
        (200, b"", "neither TRUE nor FALSE"),
        (403, b"Missing Metadata-Flavor header", "unexpected HTTP 403"),
    ]:
        with pytest.raises(MetadataError, match=says):
            read_gcp_preempted(status, body)


def test_azure_preempt_event_for_this_vm_is_the_notice():
    notice = read_azure_events(200, azure_body(azure_event()), VM)
    assert notice is not None and notice.cloud == "azure"
    assert notice.action == "Preempt 602d9444-d2cd-49c7-8624-8643e7171297"
    assert notice.deadline == datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)
    started = azure_event(EventStatus="Started", Resources=["SPOT-VM-7"], NotBefore="")
    notice = read_azure_events(200, azure_body(started), VM)
    assert notice is not None and notice.deadline is None


@pytest.mark.parametrize(
    "events",
    [
        [],
        [azure_event(EventType="Reboot"), azure_event(EventType="Freeze")],
        [azure_event(Resources=["spot-vm-8"])],  # another VM of the scale set
        [azure_event(EventStatus="Completed")],
    ],
    ids=["none", "not-preempt", "other-vm", "finished"],
)
def test_azure_other_events_are_no_notice(events):
    assert read_azure_events(200, azure_body(*events), VM) is None


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (200, b"{", "not JSON"),
        (200, b'{"DocumentIncarnation": 1}', "no Events list"),
        (200, b'{"Events": {"EventType": "Preempt"}}', "no Events list"),
        (200, b'{"Events": ["Preempt"]}', "malformed event"),
        (200, b'{"Events": [{"EventType": "Preempt", "Resources": "vm"}]}', "malformed event"),
        (400, b'{"error": "Bad request. Required metadata header not specified"}', "HTTP 400"),
    ],
)
def test_azure_garbage_is_a_clear_error(status, body, says):
    with pytest.raises(MetadataError, match=says):
        read_azure_events(status, body, VM)


def test_azure_name():
    assert read_azure_name(200, b"spot-vm-7") == "spot-vm-7"
    with pytest.raises(MetadataError, match="azure compute name"):
        read_azure_name(404, b"not found")


def test_an_error_quotes_only_the_start_of_a_long_answer():
    with pytest.raises(MetadataError) as caught:
        read_gcp_preempted(200, b"x" * MAX_ANSWER_BYTES)
    assert len(str(caught.value)) < 300


def test_a_notice_says_the_cloud_what_and_when():
    now = datetime(2026, 11, 26, 21, 38, tzinfo=UTC)
    aws = Notice("aws", "terminate", datetime(2026, 11, 26, 21, 40, tzinfo=UTC), "...")
    assert aws.describe(now) == "aws: terminate, deadline 2026-11-26T21:40:00+00:00 (in 120s)"
    assert Notice("gcp", "preempted", None).describe(now) == "gcp: preempted, no deadline stated"
    odd = Notice("aws", "stop", None, "soon").describe(now)
    assert odd == "aws: stop, deadline 'soon' (unreadable)"


def test_error_pace_logs_the_first_then_one_a_period_with_the_count_left_out():
    pace = ErrorPace(every_s=60)
    assert pace.due(0.0) == 0
    assert [pace.due(t) for t in (5.0, 10.0, 59.0)] == [None, None, None]
    assert pace.due(61.0) == 3
    pace.recovered()
    assert pace.due(62.0) == 0
