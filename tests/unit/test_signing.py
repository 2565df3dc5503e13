"""Signed delta batches (issue 41, part 4), the pure parts: the HMAC itself, which entries the
coordinator refuses and why (`coordinator.workers.keys.refusals`), what a worker reads from its
registration's answer and what the coordinator's answer holds when it mints nothing."""

from services.contracts.messages import FIELD, DeltaBatch
from services.coordinator.api.schemas import WorkerRegistered
from services.coordinator.workers.keys import COORDINATOR, refusals
from services.infra.signing import SIGNATURE_FIELD, key_bytes, new_key, sign, verify
from services.rollout.presence import Registration

KEY, OTHER = key_bytes(new_key()), key_bytes(new_key())


def batch(worker_id: str) -> DeltaBatch:
    return DeltaBatch(worker_id=worker_id, version=0, items=[])


def entry(entry_id: bytes, b: DeltaBatch, key: bytes | None) -> tuple[bytes, dict[bytes, bytes]]:
    message = b.encode()
    fields = {FIELD: message}
    if key is not None:
        fields[SIGNATURE_FIELD] = sign(key, message).encode()
    return entry_id, fields


def test_a_signature_checks_out_only_under_its_key_and_for_its_bytes():
    assert len(KEY) == 32 and KEY != OTHER
    s = sign(KEY, b"payload")
    assert verify(KEY, b"payload", s) and verify(KEY, b"payload", s.encode())
    assert not verify(OTHER, b"payload", s)
    assert not verify(KEY, b"payload!", s)
    assert not verify(KEY, b"payload", None) and not verify(KEY, b"payload", "")


def test_the_coordinator_refuses_unsigned_forged_and_unknown_batches():
    mine, claimed, unsigned, stranger = batch("w1"), batch("w2"), batch("w1"), batch("w9")
    entries = [
        entry(b"1-0", mine, KEY),  # w1, signed with w1's key
        entry(b"2-0", claimed, KEY),  # names w2, signed with w1's key
        entry(b"3-0", unsigned, None),
        entry(b"4-0", stranger, KEY),  # a worker with no key
    ]
    messages = [(b"1-0", mine), (b"2-0", claimed), (b"3-0", unsigned), (b"4-0", stranger)]
    refused = refusals(messages, entries, {"w1": KEY, "w2": OTHER})
    assert set(refused) == {b"2-0", b"3-0", b"4-0"}
    assert "key of worker w2" in refused[b"2-0"]
    assert "unsigned" in refused[b"3-0"]
    assert "no signing key" in refused[b"4-0"]


def test_a_batch_the_coordinator_signed_passes_in_any_worker_name():
    handed = batch("w-dead")  # a dead worker's releases, handed to another shard
    entries = [entry(b"1-0", handed, OTHER)]
    assert refusals([(b"1-0", handed)], entries, {COORDINATOR: OTHER}) == {}
    assert set(refusals([(b"1-0", handed)], entries, {COORDINATOR: KEY})) == {b"1-0"}


def test_the_registration_answer_holds_the_minted_fields_only_when_minted():
    plain = WorkerRegistered(id="w1", pool="reserved", engine="hf", slots=1, alive=False)
    answer = plain.model_dump(mode="json")
    assert not {"redis_username", "redis_password", "signing_key"} & set(answer)
    assert answer["run_id"] is None  # the other fields as before
    assert Registration.of(answer) == Registration()
    minted = WorkerRegistered(
        **plain.model_dump(),
        redis_username="spotrl-worker-w1",
        redis_password="pw",
        signing_key="ab" * 32,
    ).model_dump(mode="json")
    assert Registration.of(minted) == Registration("spotrl-worker-w1", "pw", "ab" * 32)
    assert Registration.of({"detail": "x"}) == Registration() == Registration.of([])
