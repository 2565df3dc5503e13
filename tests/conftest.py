"""Shared fixtures: a tiny base model built once per session. Every test under tests/integration,
tests/compose, tests/swarm (real processes, real Redis, Docker) and tests/chart (the Helm chart,
rendered by helm) is marked `slow` here, at collection: `make test-fast` (-m "not slow") runs the
unit tests only."""

import os
from pathlib import Path

# Imported here, at collection, by one thread: FastAPI imports it late, inside the first test
# that validates a request, and pytest's assertion rewriter parses it then. CPython 3.11.7's
# parser can raise "SystemError: AST constructor recursion depth mismatch" when another thread
# moves the recursion depth while it parses (a fresh-clone CI failed a unit test so, once).
import pydantic.v1  # noqa: F401
import pytest

SLOW_FOLDERS = {"integration", "compose", "chart", "swarm"}

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A small untied Qwen2 model for the arithmetic task, briefly pre-trained."""
    import torch

    from services.trainer.init_model import InitModelSpec, init_model
    from tests.harness.models import SPECS

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("models") / "tiny"
    return init_model(out, InitModelSpec(**SPECS["tiny"]))


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory):
    """Another small base model for the same task, of other shapes than `tiny_model`'s."""
    import torch

    from services.trainer.init_model import InitModelSpec, init_model
    from tests.harness.models import SPECS

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("models") / "tiny-b"
    return init_model(out, InitModelSpec(**SPECS["tiny-b"]))


def require_vllm():
    """Skip where vLLM is not installed; in CI (`make test` installs it) its absence fails."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must test the vllm engine, but vllm does not import: {exc}")
        pytest.skip(f"vllm not installed (make setup-vllm): {exc}")


def granted(table, msg):
    """`msg` (a DeltaItem or a RequestLease) as the worker that holds its request's lease in
    `table` sends it: with that lease's grant. A message under another lease (or of a request
    not in the table) is left as it is."""
    r = table.requests.get(msg.request_id)
    return msg.replace(grant=r.grant) if r is not None and r.lease == msg.lease else msg


def granted_batch(table, batch):
    """A DeltaBatch whose deltas and releases carry their leases' grants in `table`."""
    return batch.replace(
        items=[granted(table, i) for i in batch.items],
        released=[granted(table, r) for r in batch.released],
    )


def apply(table, item, version=None):
    """`table.apply` of a delta sent by the worker that holds its lease."""
    return table.apply(granted(table, item), version)


def apply_all(table, items, version=None):
    """`table.apply_all` of deltas sent by the workers that hold their leases."""
    return table.apply_all([granted(table, i) for i in items], version)


def apply_held(table, batches, rules):
    """`collect.apply_batches` of batches sent by the workers that hold their leases (as the
    table's leases stand before the first)."""
    from services.core.collect import apply_batches

    return apply_batches(table, [granted_batch(table, b) for b in batches], rules)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    from tests.harness import parallel

    root = Path(__file__).parent
    for item in items:
        path = Path(str(item.fspath))
        if SLOW_FOLDERS & set(path.relative_to(root).parts):
            item.add_marker(pytest.mark.slow)
        item.add_marker(pytest.mark.xdist_group(parallel.group_of(path, root)))


def pytest_configure(config):
    """Under pytest-xdist, the controller prints the skip report from what the workers
    collected (`tests/harness/parallel.py`)."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        import tempfile

        config.pluginmanager.register(_WorkerGroups(tempfile.mkdtemp(prefix="spotrl-groups-")))


class _WorkerGroups:
    """The controller's side of the skip report when workers collect the tests."""

    def __init__(self, folder: str) -> None:
        self.folder, self.said = folder, False

    def pytest_configure_node(self, node):
        node.workerinput["spotrl_groups"] = self.folder

    def pytest_xdist_node_collection_finished(self, node, ids):
        from tests.harness import parallel

        if not self.said:  # every worker collects the same tests: said once
            self.said = True
            groups = parallel.read_groups(self.folder)
            node.config.stash[SKIP_GROUPS] = groups
            _say_start(node.config, groups)

    @pytest.hookimpl(tryfirst=True)  # before the report reads them
    def pytest_terminal_summary(self, terminalreporter, config):
        from tests.harness import parallel

        config.stash[SKIP_GROUPS] = parallel.read_groups(self.folder)


# The skip report (tests/harness/skip_report.py): the groups this machine cannot run, said
# when collection ends and again just before pytest's closing line, with the command that
# installs each.
SKIP_GROUPS = pytest.StashKey[dict[str, str | None]]()


def pytest_collection_finish(session):
    from tests.harness import skip_report

    groups = {
        item.nodeid: skip_report.group_of_item(
            (m.name for m in item.iter_markers()),
            getattr(item, "fixturenames", ()),
            Path(str(item.fspath)).name,
        )
        for item in session.items
    }
    worker = getattr(session.config, "workerinput", None)
    if worker is not None:  # a pytest-xdist worker: the controller says it
        from tests.harness import parallel

        parallel.write_groups(worker["spotrl_groups"], worker["workerid"], groups)
        return
    session.config.stash[SKIP_GROUPS] = groups
    _say_start(session.config, groups)


def _say_start(config, groups):
    from tests.harness import skip_report

    counts: dict[str, int] = {}
    for name in groups.values():
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    lines = skip_report.start_lines(skip_report.missing_by_group(counts), counts, ci)
    _write_block(config, "spotrl: groups of tests this machine lacks tools for", lines)


def pytest_terminal_summary(terminalreporter, config):
    """Just before pytest's closing line (which stays the last line: CI reads it)."""
    from tests.harness import skip_report

    groups = config.stash.get(SKIP_GROUPS, None)
    reporter = terminalreporter
    if groups is None:
        return
    if not any(reporter.stats.get(k) for k in ("passed", "failed", "skipped", "error")):
        return  # nothing ran (--collect-only, an interrupted collection)
    skipped = skip_report.skipped_by_group(reporter.stats.get("skipped", ()), groups)
    _write_block(config, "spotrl: skip report", skip_report.end_lines(skipped))


def _write_block(config, title, lines):
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not lines:
        return
    reporter.write_line("")
    reporter.write_sep("=", title, yellow=True, bold=True)
    for line in lines:
        reporter.write_line(line, yellow=True, bold=True)
