import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every attention test on one thread (`one_torch_thread`: tiny tensors gain nothing from
    threads, and the kernels' serial builds serve all of them)."""
