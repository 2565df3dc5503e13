"""The deciding core: pure policies and bookkeeping that the services and the simulator share.

A core module takes state (and a clock, where it needs one) and returns decisions; it imports
only the contracts in `services.contracts` (messages, keys, run specs), never Redis, HTTP or a
service package. The services are thin asyncio shells that read, call the core and write what
it decided; the simulator drives the very same functions.
"""
