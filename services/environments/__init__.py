"""Environments for multi-turn (agentic) episodes: the protocol (`protocol.py`), the model's tool
calls parsed from its chat format (`tool_calls.py`), the built-in environments and the loading of
a user's `module:Class` from an allow list (`builtin.py`, `choice.py`), and the killable,
sandboxed processes they run in (`runner.py`, `worker.py`, `sandbox.py`, `wire.py`).

What it does not do yet: take part in a run. The coordinator's request table (turns as
continuation jobs) and the trainer's masking build on it (issue 40).
"""
