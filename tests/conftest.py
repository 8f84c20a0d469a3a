"""Shared test setup: offline, seeded, CPU; GPU-only tests skip without CUDA."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

# The helper modules beside the tests hold shared checks (law tests, engine comparisons): pytest rewrites their
# asserts as it does the test modules', so a failing check shows its values.
pytest.register_assert_rewrite(
    *sorted(p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith(("test_", "conftest")))
)


def _module_cost_class(items) -> dict[str, tuple[int, int]]:
    """A sort key per module, longest first: class 0 for a module with tests marked ``slow`` (multi-process runs),
    1 for one with tests that load the real model, 2 for the rest; within a class, more such tests first."""
    marked: dict[str, list[int]] = {}
    for item in items:
        counts = marked.setdefault(item.nodeid.split("::")[0], [0, 0])
        counts[0] += "slow" in item.keywords
        counts[1] += "real_model" in item.keywords
    return {module: (0, -slow) if slow else (1, -real) if real else (2, 0) for module, (slow, real) in marked.items()}


def pytest_configure(config):
    # Several pytest-xdist workers share the cores: every torch op of a worker runs on one thread, in module and
    # session fixtures too (the autouse fixture below applies per test, after those are set up). Two threads per
    # worker on a busy 2-core machine cost a fixture 3-4 times its work.
    if getattr(config, "workerinput", {}).get("workercount", 1) > 1:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The longest modules first: pytest-xdist's loadscope hands out whole modules in this order (the Makefile turns
    # off its own reordering by test count), so a long module never starts last while the other worker idles.
    cost = _module_cost_class(items)
    items.sort(key=lambda item: cost[item.nodeid.split("::")[0]])  # stable: collection order within a class
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_and_threads(request):
    """Seed every test. Tiny-model tests run on one intra-op thread: threads only add overhead on tiny
    tensors, and spinning thread pools stall badly on a busy 2-core machine (25x slower seen here).
    Tests that run the real model keep all threads, unless pytest-xdist runs several workers: each worker then
    gets one thread, so the workers share the cores instead of oversubscribing them."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    if "real_model" not in request.keywords or int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """A module whose module fixtures run tiny models (``pytest.mark.usefixtures("one_thread")``): they run on one
    intra-op thread, as its tests do, also outside pytest-xdist. Idle pool threads spinning on a busy 2-core host
    cost a fixture 3-4 times its work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded real target (SmolLM2-135M-Instruct) and its tokenizer, loaded once per session."""
    from core import assets

    return assets.load_model("smollm2"), assets.load_tokenizer("smollm2")
