import pytest
import torch

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


@pytest.fixture
def exact_cuda_math():
    """TF32 rounds convolutions and matmuls to 10 mantissa bits; compare in full float32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
