"""The consumer names of the workers' group on a jobs stream (`keys.WORKERS_GROUP`).

A worker reads its jobs as consumer `worker_id`, or, where the coordinator mints workers' users,
as `worker_id#secret` (`jobs_consumer`, the secret from the coordinator at registration): a name
no other worker can guess, so none can read (XREADGROUP from 0) the jobs pending under it and
learn their grants. The coordinator counts a consumer's jobs as its worker's (`consumer_worker`).
"""

SECRET_MARK = "#"  # no worker id holds it (coordinator.api.schemas.WorkerCreate)


def jobs_consumer(worker_id: str, secret: str = "") -> str:
    """The consumer name a worker reads its jobs as."""
    return f"{worker_id}{SECRET_MARK}{secret}" if secret else worker_id


def consumer_worker(consumer: str) -> str:
    """The worker reading as `consumer`."""
    return consumer.split(SECRET_MARK, 1)[0]
