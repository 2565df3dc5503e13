"""The step's rules that the coordinator and the simulator share: the step controller and the
rules it decides with (the request tables, collection, reclaim, stalls, seeding, balancing, the
verdict on failed calls of user code), and the worker's batch-size estimate that the simulator's
engine runs too (`plateau`).

A core module takes state (and a clock, where it needs one) and returns decisions; it imports
only the contracts in `services.contracts` (messages, keys, run specs), never Redis, HTTP or a
service package (the pure-core contract in pyproject.toml). The services are thin asyncio shells
that read, call the core and write what it decided; the simulator drives the very same
functions. A pure rule that only one room uses lives in that room, beside its shell, and is
named in the pure-rooms contract instead (the worker's `delta_buffer`, `grace` and
`cloud_notice`; the API's `infra.rate_limit`; the CLI's `scale_decision`).
"""
