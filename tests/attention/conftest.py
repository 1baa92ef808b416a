import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Keep the suite light on the shared machine (tiny tensors gain nothing from threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
