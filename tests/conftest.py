import pytest

from tests.helpers import DATA_ROOT


@pytest.fixture(scope="session")
def data_root():
    """The real Fashion-MNIST copy; its absence is an error, not a skip."""
    if not (DATA_ROOT / "FashionMNIST" / "raw").is_dir():
        pytest.fail(f"Fashion-MNIST not found in {DATA_ROOT}; set FASHION_MNIST_ROOT to a folder holding FashionMNIST/raw")
    return DATA_ROOT


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
